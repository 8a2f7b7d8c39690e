"""A seeded soak of the continuous-batching server (``pagedkv.serving``): thousands of requests of
random prompt and output lengths, some aborted at random points, a pool small enough that requests
get preempted, and at the end the page manager back to zero pages in use and every request's tokens
equal to the same request run alone.

    python -m pagedkv.demo.soak [--model tiny|smollm2] [--requests N] [--seed S] [--solo-share F]
                                [--json PATH] [--quick]

Everything the run does is drawn from ``--seed`` (``random.Random``): the prompts (a share of them
start with one of a few shared prefixes, so prefix pages are shared between live requests), their
lengths and output budgets, when each request is aborted, and the load: the server is kept fed up
to an outstanding-request target that a new draw changes every few steps (bursts and lulls). A
sprinkle of bad requests (empty prompt, a token outside the vocabulary, too long for the pool, a
live id) must be refused at submit with nothing changed, and a share of the steps fail in a random
layer's store (``fault_share``): the server must roll such a step back, and the soak runs it again.

Checks: ``check_invariants`` of the page manager every ``CHECK_EVERY_STEPS`` steps and at the end;
at the end no sequence and no page in use; for the requests of the solo sample (drawn by the seed,
all of them by default; compared as each request finishes), the tokens of a completed request equal those of the same request run
alone on its own server (greedy), and an aborted request's tokens are the start of them. A token that
differs is accepted only where the solo run's logits tie within ``TIE_TOLERANCE`` (float sums in
another order, e.g. a recomputed prefill against step-by-step decode, may then pick the other
token); such requests are counted and listed, and their later tokens are not compared.

Timing: wall clock around each ``step()``; a request's time to first token runs from its submission
(just before the step it arrives in) to the end of the step that generated its first token, its time
per output token is (finish - first token) / (tokens - 1). Solo runs happen between steps and their
time is taken out of the clock. Percentiles come from a histogram of 1%-wide buckets, and the
workload is drawn request by request, so the soak's own bookkeeping does not grow with its length;
resident memory (VmRSS) is sampled as the requests progress.

The ``tiny`` model is a seeded random Llama small enough for thousands of requests on two cores,
with an untied output head (a random model with tied embeddings mostly echoes its last input token,
which would hide a request reading another's pages).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from .. import gguf_model
from ..llama import LlamaPagedModel, make_kv_cache
from ..serving import ContinuousBatchingServer, Request, page_manager_for

# The page manager's own consistency check, every this many steps (it walks every page).
CHECK_EVERY_STEPS = 64
# Solo logits within this of the top logit (times max(1, |top logit|)) count as a tie: far above the
# float32 differences of summing in another order (~1e-6 relative), far below a real logit gap.
TIE_TOLERANCE = 1e-4


@dataclasses.dataclass
class SoakSettings:
    num_requests: int = 2000
    seed: int = 0
    num_pages: int = 48
    page_size: int = 4
    max_running: int = 8
    max_prefill_tokens: int = 96
    prompt_tokens: tuple[int, int] = (1, 40)  # uniform, inclusive
    new_tokens: tuple[int, int] = (1, 24)
    shared_prefix_share: float = 0.3  # of prompts that start with one of the shared prefixes
    shared_prefixes: int = 4
    abort_share: float = 0.1
    bad_request_share: float = 0.02
    fault_share: float = 0.01  # of steps whose forward fails in a random layer (then the step is retried)
    max_outstanding: int = 24  # the load target is drawn in [1, max_outstanding]
    load_period_steps: int = 16  # steps between draws of the load target
    solo_share: float = 1.0  # of requests compared with a solo run, drawn by the seed
    rss_samples: int = 10


@dataclasses.dataclass
class WorkItem:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    abort_after_steps: int | None  # steps after submission; None: never aborted
    bad: str | None  # which bad request this is, or None


@dataclasses.dataclass
class SoakResult:
    settings: dict
    model: str
    submitted: int
    refused: int
    completed: int
    completed_on_stop: int
    aborted: int
    aborted_running: int
    preemptions: int
    preempted_requests: int
    injected_faults: int
    prefix_cached_tokens: int
    steps: int
    generated_tokens: int
    seconds: float
    requests_per_second: float
    output_tokens_per_second: float
    ttft_ms: dict
    tpot_ms: dict
    peak_pages_used: int
    final_used_pages: int
    final_sequences: int
    final_free_pages: int
    checked: int
    checked_completed: int
    checked_aborted: int
    mismatches: list
    ties: list
    rss_mib: list  # [(requests finished or aborted, MiB)]

    @property
    def ok(self) -> bool:
        return not self.mismatches and self.final_used_pages == 0 and self.final_sequences == 0


def tiny_soak_model(seed: int = 0) -> gguf_model.LoadedModel:
    """A seeded random Llama: 2 layers, hidden 64, 4/2 heads of 16, vocab 128, untied head."""
    config = gguf_model.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        eos_token_id=0,
        name="soak-tiny-llama",
    )
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std):
        return torch.randn(*shape, generator=generator) * std

    h, d = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
    state = {"model.embed_tokens.weight": normal(config.vocab_size, h, std=1.0)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        state[prefix + "input_layernorm.weight"] = 1.0 + normal(h, std=0.1)
        state[prefix + "post_attention_layernorm.weight"] = 1.0 + normal(h, std=0.1)
        # Queries and keys scaled up so attention is peaked on a few positions: the output then
        # depends on which tokens sit where in the history, which is what the soak checks.
        state[prefix + "self_attn.q_proj.weight"] = normal(q_out, h, std=2.0 * h**-0.5)
        state[prefix + "self_attn.k_proj.weight"] = normal(kv_out, h, std=2.0 * h**-0.5)
        state[prefix + "self_attn.v_proj.weight"] = normal(kv_out, h, std=h**-0.5)
        state[prefix + "self_attn.o_proj.weight"] = normal(h, q_out, std=2.0 * q_out**-0.5)
        state[prefix + "mlp.gate_proj.weight"] = normal(config.intermediate_size, h, std=h**-0.5)
        state[prefix + "mlp.up_proj.weight"] = normal(config.intermediate_size, h, std=h**-0.5)
        state[prefix + "mlp.down_proj.weight"] = normal(h, config.intermediate_size, std=config.intermediate_size**-0.5)
    state["model.norm.weight"] = 1.0 + normal(h, std=0.1)
    state["lm_head.weight"] = normal(config.vocab_size, h, std=h**-0.5)
    return gguf_model.LoadedModel(config=config, state_dict=state, tokenizer=gguf_model.ByteTokenizer(),
                                  source="random", is_random=True)


def make_workload(settings: SoakSettings, vocab_size: int, stop_token_ids: Sequence[int]) -> Iterator[WorkItem]:
    """The requests of a soak, drawn from the seed, one at a time (a long soak holds only the live ones). Prompt tokens avoid the stop tokens (a prompt is
    allowed to hold them, but then the workload would depend on where they fall)."""
    rng = random.Random(settings.seed)
    stops = set(stop_token_ids)
    alphabet = [t for t in range(vocab_size) if t not in stops]
    low, high = settings.prompt_tokens
    prefixes = [[rng.choice(alphabet) for _ in range(rng.randint(settings.page_size, max(settings.page_size, high // 2)))]
                for _ in range(settings.shared_prefixes)]
    for request_id in range(settings.num_requests):
        length = rng.randint(low, high)
        if prefixes and rng.random() < settings.shared_prefix_share:
            prefix = rng.choice(prefixes)
            prompt = prefix[:length] + [rng.choice(alphabet) for _ in range(length - len(prefix))]
        else:
            prompt = [rng.choice(alphabet) for _ in range(length)]
        new_tokens = rng.randint(*settings.new_tokens)
        abort_after = rng.randint(0, 3 * new_tokens) if rng.random() < settings.abort_share else None
        bad = rng.choice(["empty", "token", "too_long", "live_id"]) if rng.random() < settings.bad_request_share else None
        yield WorkItem(request_id, prompt, new_tokens, abort_after, bad)


def _bad_request(item: WorkItem, kind: str, server: ContinuousBatchingServer, vocab_size: int) -> Request | None:
    if kind == "empty":
        return Request(item.request_id, server.step_index, "", [], item.max_new_tokens)
    if kind == "token":
        return Request(item.request_id, server.step_index, "", item.prompt[:-1] + [vocab_size], item.max_new_tokens)
    if kind == "too_long":
        tokens = server.page_manager.num_pages * server.page_manager.page_size + 1
        return Request(item.request_id, server.step_index, "", [item.prompt[0]] * tokens, item.max_new_tokens)
    live = server.running or list(server.waiting)
    if not live:
        return None
    return Request(live[0].request_id, server.step_index, "", item.prompt, item.max_new_tokens)


def _server_state(server: ContinuousBatchingServer) -> tuple:
    manager = server.page_manager
    return (
        [r.request_id for r in server.pending],
        [r.request_id for r in server.waiting],
        [r.request_id for r in server.running],
        manager.used_pages,
        manager.num_sequences,
    )


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class LatencyHistogram:
    """Counts of durations in buckets 1% wide (log scale), so a soak of any length keeps a fixed
    amount of memory; a percentile is read as its bucket's upper edge (at most 1% high)."""

    RATIO = 1.01
    SMALLEST = 1e-6  # seconds; shorter durations count in the first bucket

    def __init__(self):
        self.counts: dict[int, int] = {}
        self.total = 0

    def add(self, seconds: float) -> None:
        bucket = max(0, math.ceil(math.log(max(seconds, self.SMALLEST) / self.SMALLEST, self.RATIO)))
        self.counts[bucket] = self.counts.get(bucket, 0) + 1
        self.total += 1

    def percentile(self, fraction: float) -> float | None:
        if not self.total:
            return None
        rank = max(1, math.ceil(fraction * self.total))
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen >= rank:
                return self.SMALLEST * self.RATIO**bucket
        raise AssertionError("unreachable")

    def summary_ms(self) -> dict:
        p50, p99 = self.percentile(0.50), self.percentile(0.99)
        return {"p50": None if p50 is None else p50 * 1e3, "p99": None if p99 is None else p99 * 1e3,
                "count": self.total}


class InjectedFault(RuntimeError):
    """The failure ``_FaultyCache`` raises in a layer's store."""


class _FaultyCache:
    """The served cache, whose store raises ``InjectedFault`` in layer ``fail_layer`` when armed (once):
    the layers before it have stored their K/V for the step by then."""

    def __init__(self, kv_cache):
        self.kv_cache = kv_cache
        self.fail_layer: int | None = None

    def store(self, layer, *args):
        if layer == self.fail_layer:
            self.fail_layer = None
            raise InjectedFault(f"injected: store refused in layer {layer}")
        return self.kv_cache.store(layer, *args)

    def attention(self, *args, **kwargs):
        return self.kv_cache.attention(*args, **kwargs)


class _ModelWithCache:
    """The soak's model over another cache (the solo runs' pool), without a second copy of the weights."""

    def __init__(self, model: LlamaPagedModel, kv_cache):
        self.model, self.kv_cache = model, kv_cache

    def __call__(self, *args):
        saved = self.model.kv_cache
        self.model.kv_cache = self.kv_cache
        try:
            return self.model(*args)
        finally:
            self.model.kv_cache = saved


class SoloRunner:
    """Runs one request at a time on a server of its own (a pool that holds the longest request)."""

    def __init__(self, model: LlamaPagedModel, config, settings: SoakSettings, stop_token_ids: Sequence[int]):
        longest = settings.prompt_tokens[1] + settings.new_tokens[1]
        num_pages = -(-longest // settings.page_size) + 1
        self.kv_cache = make_kv_cache(config, num_pages, settings.page_size, device=next(model.parameters()).device)
        self.model = _ModelWithCache(model, self.kv_cache)
        self.stop_token_ids = list(stop_token_ids)
        self.vocab_size = config.vocab_size
        self.device = next(model.parameters()).device

    def run(self, prompt: list[int], max_new_tokens: int, record_logits: bool = False) -> Request:
        server = ContinuousBatchingServer(
            self.model, page_manager_for(self.kv_cache), self.stop_token_ids, self.device, max_prefill_tokens=10**6,
            max_running=1, record_logits=record_logits, vocab_size=self.vocab_size,
        )
        server.submit(Request(0, 0, "", list(prompt), max_new_tokens))
        while server.has_work():
            server.step()
        if server.page_manager.used_pages:
            raise RuntimeError(f"solo run left {server.page_manager.used_pages} pages in use")
        return server.finished[0]


def compare_with_solo(solo: SoloRunner, prompt, max_new_tokens, generated, finish_reason) -> tuple[str, dict]:
    """'equal', 'tie' (differs first where the solo logits tie) or 'mismatch', with details."""
    reference = solo.run(prompt, max_new_tokens).generated
    if finish_reason == "abort":
        equal = generated == reference[: len(generated)]
    else:
        equal = generated == reference
    if equal:
        return "equal", {}
    first = next((i for i, (a, b) in enumerate(zip(generated, reference)) if a != b), None)
    details = {"generated": generated, "solo": reference, "first_difference": first, "finish_reason": finish_reason}
    if first is None:  # one is a prefix of the other: a length or stop difference, never a tie
        return "mismatch", details
    logits = solo.run(prompt, max_new_tokens, record_logits=True).step_logits[first]
    top = float(logits.max())
    gap = top - float(logits[generated[first]])
    details["logit_gap"] = gap
    return ("tie" if gap <= TIE_TOLERANCE * max(1.0, abs(top)) else "mismatch"), details


def run_soak(
    settings: SoakSettings,
    loaded: gguf_model.LoadedModel,
    stop_token_ids: Sequence[int],
    model_name: str = "tiny",
    wrap_model: Callable | None = None,
    log: Callable[[str], None] | None = None,
) -> SoakResult:
    """Run the soak of the module docstring; ``wrap_model`` wraps the served model (tests inject
    faults with it: the solo runs use the model unwrapped)."""
    config = loaded.config
    rng = random.Random(settings.seed + 1)  # the load targets; the workload has its own stream
    items = make_workload(settings, config.vocab_size, stop_token_ids)
    sample_rng = random.Random(settings.seed + 2)

    kv_cache = make_kv_cache(config, settings.num_pages, settings.page_size)
    faulty_cache = _FaultyCache(kv_cache)
    model = LlamaPagedModel.from_state_dict(config, loaded.state_dict, kv_cache=faulty_cache)
    fault_rng = random.Random(settings.seed + 3)
    served = wrap_model(model) if wrap_model is not None else model
    manager = page_manager_for(kv_cache)
    server = ContinuousBatchingServer(
        served, manager, stop_token_ids, torch.device("cpu"), max_prefill_tokens=settings.max_prefill_tokens,
        max_running=settings.max_running, vocab_size=config.vocab_size,
    )
    solo = SoloRunner(model, config, settings, stop_token_ids)

    live: dict[int, WorkItem] = {}  # submitted and not yet retired
    abort_at: dict[int, list[int]] = {}
    submit_time: dict[int, float] = {}
    first_token_time: dict[int, float] = {}
    ttft, tpot = LatencyHistogram(), LatencyHistogram()
    mismatches, ties = [], []
    counts = dict(submitted=0, refused=0, completed=0, completed_on_stop=0, injected_faults=0, aborted=0,
                  aborted_running=0, preempted_requests=0, prefix_cached_tokens=0, generated_tokens=0,
                  peak_pages_used=0, checked_completed=0, checked_aborted=0)
    rss: list[tuple[int, float]] = []
    rss_every = max(1, settings.num_requests // settings.rss_samples)
    next_rss = rss_every
    target = 1
    steps = 0
    solo_seconds = 0.0

    def clock() -> float:
        # Wall time of the soak alone: solo comparisons run between steps and are taken out.
        return time.perf_counter() - solo_seconds

    def retire(request: Request, now: float) -> None:
        nonlocal solo_seconds
        item = live.pop(request.request_id)
        counts["generated_tokens"] += len(request.generated)
        counts["preempted_requests"] += request.preemptions > 0
        counts["prefix_cached_tokens"] += request.prefix_cached_tokens
        if request.finish_reason == "abort":
            counts["aborted"] += 1
        else:
            counts["completed"] += 1
            counts["completed_on_stop"] += request.finish_reason == "eos"
            first = first_token_time.get(request.request_id)
            if first is not None:
                ttft.add(first - submit_time[request.request_id])
                if len(request.generated) > 1:
                    tpot.add((now - first) / (len(request.generated) - 1))
        submit_time.pop(request.request_id, None)
        first_token_time.pop(request.request_id, None)
        if sample_rng.random() < settings.solo_share:
            solo_start = time.perf_counter()
            verdict, details = compare_with_solo(solo, item.prompt, item.max_new_tokens, request.generated,
                                                 request.finish_reason)
            counts["checked_aborted" if request.finish_reason == "abort" else "checked_completed"] += 1
            if verdict != "equal":
                (ties if verdict == "tie" else mismatches).append({"request_id": request.request_id, **details})
            solo_seconds += time.perf_counter() - solo_start

    item = next(items, None)
    start = clock()
    while item is not None or server.has_work():
        if steps % settings.load_period_steps == 0:
            target = rng.randint(1, settings.max_outstanding)
        while item is not None and len(live) < target:
            if item.bad is not None:
                bad = _bad_request(item, item.bad, server, config.vocab_size)
                if bad is not None:
                    before = _server_state(server)
                    try:
                        server.submit(bad)
                    except ValueError:
                        counts["refused"] += 1
                    else:
                        raise AssertionError(f"bad request ({item.bad}) {bad.request_id} was accepted")
                    if _server_state(server) != before:
                        raise AssertionError(f"refusing a bad request ({item.bad}) changed the server")
            submit_time[item.request_id] = clock()
            server.submit(Request(item.request_id, server.step_index, "", list(item.prompt), item.max_new_tokens))
            counts["submitted"] += 1
            live[item.request_id] = item
            if item.abort_after_steps is not None:
                abort_at.setdefault(server.step_index + item.abort_after_steps, []).append(item.request_id)
            item = next(items, None)
        for request_id in abort_at.pop(server.step_index, []):
            if request_id in live:
                running = any(r.request_id == request_id for r in server.running)
                server.abort(request_id)
                counts["aborted_running"] += running
        if server.has_work():
            if fault_rng.random() < settings.fault_share:
                faulty_cache.fail_layer = fault_rng.randrange(config.num_hidden_layers)
            try:
                record = server.step()
            except InjectedFault:
                # The step changed nothing (pagedkv.serving); the next iteration runs it again.
                counts["injected_faults"] += 1
                manager.check_invariants()
                continue
            steps += 1
            counts["peak_pages_used"] = max(counts["peak_pages_used"], record.pages_used)
            now = clock()
            for request in (*server.running, *server.finished):
                if request.generated and request.request_id not in first_token_time:
                    first_token_time[request.request_id] = now
            if steps % CHECK_EVERY_STEPS == 0:
                manager.check_invariants()
        now = clock()
        # finished and records are ours to drain (the server keeps them otherwise, one entry per
        # request and per step)
        for request in server.finished:
            retire(request, now)
        server.finished.clear()
        server.records.clear()
        done = counts["completed"] + counts["aborted"]
        if done >= next_rss:
            rss.append((done, round(_rss_mib(), 1)))
            if log:
                log(f"  {done}/{settings.num_requests} requests, step {steps}, rss {rss[-1][1]} MiB")
            next_rss += rss_every
    seconds = clock() - start
    manager.check_invariants()
    if not rss or rss[-1][0] != counts["completed"] + counts["aborted"]:
        rss.append((counts["completed"] + counts["aborted"], round(_rss_mib(), 1)))

    settings_dict = dataclasses.asdict(settings)
    return SoakResult(
        settings=settings_dict,
        model=model_name,
        submitted=counts["submitted"],
        refused=counts["refused"],
        completed=counts["completed"],
        completed_on_stop=counts["completed_on_stop"],
        aborted=counts["aborted"],
        aborted_running=counts["aborted_running"],
        preemptions=server.preemptions,
        preempted_requests=counts["preempted_requests"],
        injected_faults=counts["injected_faults"],
        prefix_cached_tokens=counts["prefix_cached_tokens"],
        steps=steps,
        generated_tokens=counts["generated_tokens"],
        seconds=seconds,
        requests_per_second=(counts["completed"] + counts["aborted"]) / seconds,
        output_tokens_per_second=counts["generated_tokens"] / seconds,
        ttft_ms=ttft.summary_ms(),
        tpot_ms=tpot.summary_ms(),
        peak_pages_used=counts["peak_pages_used"],
        final_used_pages=manager.used_pages,
        final_sequences=manager.num_sequences,
        final_free_pages=manager.free_pages,
        checked=counts["checked_completed"] + counts["checked_aborted"],
        checked_completed=counts["checked_completed"],
        checked_aborted=counts["checked_aborted"],
        mismatches=mismatches,
        ties=ties,
        rss_mib=rss,
    )


# ---------------------------------------------------------------------------------------------
# Command line

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.demo.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--requests", type=int, default=None, help="requests (default 2000 tiny, 40 smollm2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-pages", type=int, default=None, help="pool pages (default 48 tiny, 24 smollm2)")
    parser.add_argument("--page-size", type=int, default=None, help="tokens per page (default 4 tiny, 16 smollm2)")
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--solo-share", type=float, default=1.0,
                        help="share of requests compared with a solo run, drawn by the seed (default 1: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--rss-samples", type=int, default=10, help="resident memory readings over the run")
    parser.add_argument("--quick", action="store_true", help="300 requests (tiny) / 12 (smollm2)")
    return parser.parse_args(argv)


def settings_for(args: argparse.Namespace) -> SoakSettings:
    if args.model == "tiny":
        settings = SoakSettings(num_requests=300 if args.quick else 2000)
    else:
        # SmolLM2: pages of 16 as in the demo; a request takes up to 12 of the 24 pages, so a few
        # running requests fill the pool. Aborts and failing steps are made more frequent so that a
        # run of a few dozen requests (minutes on two cores) takes those paths too.
        settings = SoakSettings(num_requests=12 if args.quick else 40, num_pages=24, page_size=16,
                                max_prefill_tokens=512, prompt_tokens=(1, 160), new_tokens=(1, 32),
                                max_outstanding=12, load_period_steps=8, abort_share=0.2, bad_request_share=0.1,
                                fault_share=0.05)
    if args.requests is not None:
        settings.num_requests = args.requests
    if args.num_pages is not None:
        settings.num_pages = args.num_pages
    if args.page_size is not None:
        settings.page_size = args.page_size
    settings.max_running = args.max_running
    settings.seed = args.seed
    settings.solo_share = args.solo_share
    settings.rss_samples = args.rss_samples
    return settings


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    commit = _commit()  # now: the code that runs is the code of this commit (HEAD may move during the run)
    torch.set_num_threads(args.threads)
    settings = settings_for(args)
    if args.model == "tiny":
        loaded = tiny_soak_model(args.seed)
        stop_token_ids = [loaded.config.eos_token_id]
    else:
        loaded = gguf_model.load_model(allow_random=False)
        stop_token_ids = loaded.tokenizer.stop_token_ids

    def log(line):
        print(line, file=sys.stderr, flush=True)

    log(f"soak: {args.model}, {settings.num_requests} requests, seed {settings.seed}, {settings.num_pages} pages of "
        f"{settings.page_size}, max running {settings.max_running}, {args.threads} thread(s)")
    result = run_soak(settings, loaded, stop_token_ids, model_name=args.model, log=log)
    summary = {
        "command": "python -m pagedkv.demo.soak " + " ".join(sys.argv[1:] if argv is None else argv),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "commit": commit,
        "cpu": _cpu(),
        "torch": torch.__version__,
        "threads": args.threads,
        "load_average_after": os.getloadavg(),
        "ok": result.ok,
        **dataclasses.asdict(result),
    }
    text = json.dumps(summary, indent=1)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    print(f"{summary['command']}\ncommit {summary['commit']}, {summary['cpu']}, torch {summary['torch']}, "
          f"{args.threads} thread(s), finished {summary['finished_utc']} UTC, load average after "
          f"{', '.join(f'{x:.1f}' for x in summary['load_average_after'])}")
    print(
        f"{result.completed} completed ({result.completed_on_stop} on a stop token), {result.aborted} aborted ({result.aborted_running} while running), "
        f"{result.refused} bad requests refused, {result.injected_faults} steps failed in a layer and rerun; "
        f"{result.preemptions} preemptions of {result.preempted_requests} "
        f"requests; {result.prefix_cached_tokens} prompt tokens from shared pages; {result.steps} steps in "
        f"{result.seconds:.1f} s\n"
        f"{result.requests_per_second:.1f} requests/s, {result.output_tokens_per_second:.1f} output tokens/s; "
        f"time to first token p50 {result.ttft_ms['p50']:.2f} ms p99 {result.ttft_ms['p99']:.2f} ms; "
        f"per output token p50 {result.tpot_ms['p50']:.2f} ms p99 {result.tpot_ms['p99']:.2f} ms\n"
        f"pages in use at the end: {result.final_used_pages} (peak {result.peak_pages_used} of {settings.num_pages}), "
        f"sequences {result.final_sequences}\n"
        f"solo comparison: {result.checked} requests ({result.checked_completed} completed, {result.checked_aborted} "
        f"aborted): {len(result.mismatches)} mismatches, {len(result.ties)} differences at logit ties\n"
        f"resident memory (requests done, MiB): {result.rss_mib}"
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
