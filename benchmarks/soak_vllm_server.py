"""Soak test of vLLM's OpenAI server with pagedkv attention, beside vLLM's own CPU attention, same run.

Runs in the vLLM venv that scripts/test_vllm.sh builds (.deps/vllm-venv: aiohttp and psutil come with
vLLM; the model folder from tests/vllm_integration/write_hf_model.py). For each backend in turn
(``PAGEDKV_VLLM=1`` or not) it starts the OpenAI-compatible server (the module `vllm serve` runs) on
127.0.0.1 with a KV pool too small for the load, so that the scheduler preempts requests, and then:

1. Reference: each distinct prompt of the workload sent alone, one at a time (no batching, no
   preemption, no disconnects), greedy, on a freshly started server. These solo answers are what every
   answer under load must equal: the load changes only how requests are batched, chunked, preempted
   and recomputed, which greedy float32 decoding must not see. The two backends' solo answers are also
   compared with each other.
2. Load: CONCURRENCY closed-loop clients send streaming completions from one seeded request list
   (the same list for both backends): a prompt drawn from the pool (mixed prompt and output lengths,
   temperature 0, ignore_eos so every answer has exactly its max_tokens), a share of them
   disconnecting after a seeded number of tokens. New requests stop after DURATION seconds or
   MAX_REQUESTS requests, whichever comes first; those in flight finish.
3. Checks: every completed answer equals its prompt's solo answer token for token, and a disconnected
   one the same prefix; no HTTP error, no error event in a stream, no ERROR line or traceback in the
   server's log; no stall (STALL seconds without any token while requests are in flight, or a request
   past its DEADLINE); the scheduler preempted requests (vllm:num_preemptions); at the end, once a
   one-token probe request has made the engine report its state after everything else was freed,
   vllm:kv_cache_usage_perc, vllm:num_requests_running and vllm:num_requests_waiting are 0; the
   resident memory of the server's processes (API server and engine core), sampled every second,
   does not grow after warm-up (the first WARMUP_SHARE of the load's time): the last quarter's peak
   against the peak between warm-up and the last quarter.

Reported per backend: completed requests/s over the load's wall time, output tokens/s (every token
streamed, disconnected requests' too), p50/p99 time to first token (send to first token, every request
that got one) and time per output token ((last token - first token) / (tokens - 1), completed
requests), preemptions, prefix-cache hits, RSS over time. Results go to
benchmarks/results/NAME.{json,md} (NAME: vllm_soak_cpu[_quick]_DATE_COMMIT unless --name).

  .deps/vllm-venv/bin/python benchmarks/soak_vllm_server.py              # 600 s of load per backend
  .deps/vllm-venv/bin/python benchmarks/soak_vllm_server.py --quick      # 60 s per backend
  .deps/vllm-venv/bin/python benchmarks/soak_vllm_server.py --backends pagedkv --duration 120
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import aiohttp
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BACKENDS = ("pagedkv", "vllm")
FULL = dict(duration=600.0, max_requests=100000)
QUICK = dict(duration=60.0, max_requests=2000)
# A decode step of SmolLM2-135M takes well under a second on two cores, even under other load: a minute
# without a single token streamed while requests are in flight means the engine stopped.
STALL_SECONDS = 60.0
# A request's whole life, queueing and preemptions included; far above what the longest request needs
# behind CONCURRENCY others.
DEADLINE_SECONDS = 600.0
SERVER_START_SECONDS = 900.0  # vLLM's imports and engine start on a loaded two-core machine
WARMUP_SHARE = 0.25
RSS_INTERVAL_SECONDS = 1.0
# Growth allowed between the peak after warm-up and the last quarter's peak: more than the default KV pool
# (1024 tokens of float32 SmolLM2 K/V: 45 MiB) and well above the allocator's swings between samples (a few MiB),
# far below the 3 GiB the two processes hold.
RSS_GROWTH_LIMIT_MIB = 64.0
PROGRESS_INTERVAL_SECONDS = 15.0
# The server's log lines that report a failure (vLLM's logger writes the level first).
ERROR_LINE = re.compile(r"^(?:\x1b\[[0-9;]*m)?(?:ERROR|CRITICAL)\b|Traceback \(most recent call last\)|EngineDeadError")
SERVED_NAME = "soak"


@dataclasses.dataclass
class Request:
    index: int
    prompt: int  # index into the prompt pool
    disconnect_after: int | None  # tokens after which the client drops the connection


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]  # token ids
    max_tokens: list[int]  # per prompt: exact output length (ignore_eos)
    requests: list[Request]


def make_workload(args) -> Workload:
    """The seeded prompt pool and request list (the same for every backend)."""
    rng = random.Random(args.seed)
    prompts, max_tokens = [], []
    for _ in range(args.prompts):
        length = rng.randint(args.min_prompt, args.max_prompt)
        # token ids above the tokenizer's special tokens, below SmolLM2's vocabulary (49152)
        prompts.append([rng.randrange(100, 49152) for _ in range(length)])
        max_tokens.append(rng.randint(args.min_new, args.max_new))
    requests = []
    for index in range(args.max_requests):
        prompt = rng.randrange(args.prompts)
        disconnect_after = None
        if rng.random() < args.disconnect_share and max_tokens[prompt] > 1:
            disconnect_after = rng.randint(1, max_tokens[prompt] - 1)
        requests.append(Request(index, prompt, disconnect_after))
    return Workload(prompts, max_tokens, requests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI server in a child process on 127.0.0.1, its log in a file, its memory sampled."""

    def __init__(self, args, backend: str, log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, PAGEDKV_VLLM="1" if backend == "pagedkv" else "0")
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", args.dtype, "--block-size", str(args.block_size),
            "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs), "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
            # the pool: exactly NUM_BLOCKS blocks (the memory setting only has to admit them)
            "--num-gpu-blocks-override", str(args.num_blocks), "--kv-cache-memory-bytes", str(512 << 20),
            "--gpu-memory-utilization", "0.1",
        ]
        self.log = open(log_path, "w")
        # its own process group: stop() ends the server and the engine core it spawned, nothing else
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.rss_samples: list[tuple[float, int, int]] = []  # (monotonic time, API server RSS, children's RSS)

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    async def wait_ready(self, http: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited ({self.process.returncode}):\n{self.log_text()[-6000:]}")
            try:
                async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not come up in {SERVER_START_SECONDS:.0f} s:\n"
                                 f"{self.log_text()[-6000:]}")
            await asyncio.sleep(2)

    def rss(self) -> tuple[int, int]:
        """Resident bytes of the API server process and of its descendants (the engine core)."""
        try:
            parent = psutil.Process(self.process.pid)
            children = parent.children(recursive=True)
            own = parent.memory_info().rss
        except psutil.NoSuchProcess:
            return 0, 0
        total = 0
        for child in children:
            try:
                total += child.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return own, total

    def cpu_seconds(self) -> tuple[float, float]:
        """User + system CPU seconds the API server process and its descendants have used so far."""
        def used(process):
            times = process.cpu_times()
            return times.user + times.system

        try:
            parent = psutil.Process(self.process.pid)
            own, children = used(parent), parent.children(recursive=True)
        except psutil.NoSuchProcess:
            return 0.0, 0.0
        total = 0.0
        for child in children:
            try:
                total += used(child)
            except psutil.NoSuchProcess:
                pass
        return own, total

    async def sample_rss(self) -> None:
        while True:
            own, children = self.rss()
            self.rss_samples.append((time.monotonic(), own, children))
            await asyncio.sleep(RSS_INTERVAL_SECONDS)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """vLLM's Prometheus metrics that the checks read, each summed over its labels."""
    async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as response:
        text = await response.text()
    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:num_preemptions_total", "vllm:request_success_total", "vllm:prefix_cache_hits_total",
              "vllm:prefix_cache_queries_total")
    values = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


@dataclasses.dataclass
class Outcome:
    request: Request
    status: str = "pending"  # completed, disconnected, http_error, stream_error, timeout, short
    tokens: list[int] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    sent: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    detail: str = ""


class Progress:
    """What the stall watchdog and the progress lines read."""

    def __init__(self):
        self.last_token = time.monotonic()
        self.in_flight = 0
        self.tokens = 0


async def stream_completion(http, url: str, workload: Workload, request: Request, progress: Progress,
                            logprobs: int) -> Outcome:
    """One streaming completion; drops the connection after request.disconnect_after tokens when set."""
    outcome = Outcome(request)
    body = {"model": SERVED_NAME, "prompt": workload.prompts[request.prompt],
            "max_tokens": workload.max_tokens[request.prompt], "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "logprobs": logprobs, "return_tokens_as_token_ids": True}
    outcome.sent = time.monotonic()
    progress.in_flight += 1
    try:
        async with http.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=DEADLINE_SECONDS)) as response:
            if response.status != 200:
                outcome.status = "http_error"
                outcome.detail = f"HTTP {response.status}: {(await response.text())[:500]}"
                return outcome
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    outcome.status = "stream_error"
                    outcome.detail = json.dumps(event)[:500]
                    return outcome
                for choice in event.get("choices", []):
                    new = choice.get("token_ids") or []
                    if not new:
                        continue
                    now = time.monotonic()
                    if outcome.first_token is None:
                        outcome.first_token = now
                    outcome.last_token = now
                    progress.last_token = now
                    progress.tokens += len(new)
                    outcome.tokens.extend(new)
                    logprob_block = choice.get("logprobs") or {}
                    outcome.top_logprobs.extend(logprob_block.get("top_logprobs") or [])
                if request.disconnect_after is not None and len(outcome.tokens) >= request.disconnect_after:
                    # closes the socket under the stream: the server sees the client go mid-answer
                    response.close()
                    outcome.status = "disconnected"
                    return outcome
        expected = workload.max_tokens[request.prompt]
        outcome.status = "completed" if len(outcome.tokens) == expected else "short"
        if outcome.status == "short":
            outcome.detail = f"{len(outcome.tokens)} tokens of {expected}"
    except asyncio.TimeoutError:
        outcome.status = "timeout"
        outcome.detail = f"no answer within {DEADLINE_SECONDS:.0f} s"
    except aiohttp.ClientError as error:
        outcome.status = "http_error"
        outcome.detail = repr(error)[:500]
    finally:
        progress.in_flight -= 1
    return outcome


def percentile(values: list[float], share: float) -> float | None:
    """Nearest-rank percentile (share in (0, 1]) of values, None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(share * len(ordered))) - 1]


async def run_backend(args, backend: str, workload: Workload, log_path: str) -> dict:
    server = Server(args, backend, log_path)
    print(f"\n== {backend}: starting the server (log {log_path})", flush=True)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:
        sampler = None
        try:
            started = time.monotonic()
            await server.wait_ready(http)
            print(f"{backend}: server up after {time.monotonic() - started:.0f} s", flush=True)
            sampler = asyncio.create_task(server.sample_rss())
            result = await drive(args, backend, workload, server, http)
            # the checks cover the server's life up to here: stopping it logs the engine core's end as errors
            log = server.log_text()
        finally:
            if sampler is not None:
                sampler.cancel()
            server.stop()
    result["backend_log_line"] = "pagedkv attention backend" in log
    result["server_error_lines"] = [line for line in log.splitlines() if ERROR_LINE.search(line)][:50]
    result["rss"] = rss_summary(server.rss_samples, result["load_window"])
    return result


async def drive(args, backend: str, workload: Workload, server: Server, http) -> dict:
    progress = Progress()
    # 1. solo answers, one request at a time
    solo_started = time.monotonic()
    reference = {}
    for prompt in sorted({r.prompt for r in workload.requests}):
        outcome = await stream_completion(http, server.url, workload, Request(-1, prompt, None), progress,
                                          args.logprobs)
        if outcome.status != "completed":
            raise SystemExit(f"{backend}: solo request for prompt {prompt} failed: {outcome.status} {outcome.detail}")
        reference[prompt] = outcome
    solo_seconds = time.monotonic() - solo_started
    print(f"{backend}: {len(reference)} solo answers in {solo_seconds:.0f} s", flush=True)
    before = await metrics(http, server.url)

    # 2. load
    outcomes: list[Outcome] = []
    queue = iter(workload.requests)
    load_started = time.monotonic()
    stop_issuing = load_started + args.duration
    stall: list[str] = []

    async def client():
        while time.monotonic() < stop_issuing and not stall:
            request = next(queue, None)
            if request is None:
                return
            outcomes.append(await stream_completion(http, server.url, workload, request, progress, args.logprobs))

    async def watchdog():
        next_line = load_started + PROGRESS_INTERVAL_SECONDS
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            if progress.in_flight and now - progress.last_token > STALL_SECONDS:
                stall.append(f"no token for {now - progress.last_token:.0f} s with {progress.in_flight} requests in "
                             f"flight, {now - load_started:.0f} s into the load")
                print(f"{backend}: STALL: {stall[-1]}", flush=True)
                return
            if now >= next_line:
                next_line += PROGRESS_INTERVAL_SECONDS
                state = await metrics(http, server.url)
                rss = server.rss_samples[-1] if server.rss_samples else (0, 0, 0)
                done = sum(o.status == "completed" for o in outcomes)
                dropped = sum(o.status == "disconnected" for o in outcomes)
                failed = sum(o.status not in ("completed", "disconnected") for o in outcomes)
                print(f"{backend} {now - load_started:5.0f} s: {done} completed, {dropped} disconnected, {failed} "
                      f"failed, {progress.in_flight} in flight, {progress.tokens} tokens; KV usage "
                      f"{state['vllm:kv_cache_usage_perc']:.2f}, preemptions "
                      f"{state['vllm:num_preemptions_total'] - before['vllm:num_preemptions_total']:.0f}, RSS "
                      f"{(rss[1] + rss[2]) / 2**20:.0f} MiB; load average {os.getloadavg()[0]:.1f}", flush=True)

    progress.tokens = 0
    progress.last_token = time.monotonic()
    load_average = [os.getloadavg()[0]]
    cpu_before = server.cpu_seconds()
    watch = asyncio.create_task(watchdog())
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    load_ended = time.monotonic()
    cpu_after = server.cpu_seconds()
    cpu_seconds = {"api_server": cpu_after[0] - cpu_before[0], "engine": cpu_after[1] - cpu_before[1]}
    watch.cancel()
    load_average.append(os.getloadavg()[0])

    # 3. the engine's state once everything has finished: a one-token probe makes the engine take a step,
    # and the stats of that step (taken after it frees the probe) are what /metrics shows
    probe_tokens = [workload.prompts[0][0]]
    probe = await stream_completion(http, server.url, Workload([probe_tokens], [1], []), Request(-1, 0, None),
                                    progress, 0)
    after = await metrics(http, server.url)
    for _ in range(30):  # the API server records the engine's stats when the step's output arrives
        if after["vllm:request_success_total"] >= before["vllm:request_success_total"] + sum(
                o.status == "completed" for o in outcomes) + 1:
            break
        await asyncio.sleep(1.0)
        after = await metrics(http, server.url)
    return summarize(args, backend, workload, reference, outcomes, stall, probe, before, after,
                     (load_started, load_ended), solo_seconds, load_average, cpu_seconds)


def first_difference(tokens: list[int], expected: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(tokens, expected)):
        if a != b:
            return position
    return None if len(tokens) <= len(expected) else len(expected)


def summarize(args, backend, workload, reference, outcomes, stall, probe, before, after, load_window,
              solo_seconds, load_average, cpu_seconds) -> dict:
    load_seconds = load_window[1] - load_window[0]
    by_status: dict[str, int] = {}
    for outcome in outcomes:
        by_status[outcome.status] = by_status.get(outcome.status, 0) + 1
    mismatches = []
    for outcome in outcomes:
        if outcome.status not in ("completed", "disconnected"):
            continue
        expected = reference[outcome.request.prompt]
        position = first_difference(outcome.tokens, expected.tokens)
        if position is None:
            continue
        # the solo run's top logprobs where they part: how close the two tokens were there
        solo_top = expected.top_logprobs[position] if position < len(expected.top_logprobs) else {}
        ours = outcome.top_logprobs[position] if position < len(outcome.top_logprobs) else {}
        mismatches.append({"request": outcome.request.index, "prompt": outcome.request.prompt,
                           "status": outcome.status, "position": position,
                           "solo_token": expected.tokens[position] if position < len(expected.tokens) else None,
                           "token": outcome.tokens[position], "solo_top_logprobs": solo_top,
                           "top_logprobs": ours})
    completed = [o for o in outcomes if o.status == "completed"]
    first_token_seconds = [o.first_token - o.sent for o in outcomes if o.first_token is not None]
    per_token_seconds = [(o.last_token - o.first_token) / (len(o.tokens) - 1) for o in completed if len(o.tokens) > 1]
    failures = [{"request": o.request.index, "status": o.status, "detail": o.detail} for o in outcomes
                if o.status not in ("completed", "disconnected")]
    output_tokens = sum(len(o.tokens) for o in outcomes)
    return {
        "backend": backend,
        "requests": len(outcomes),
        "by_status": by_status,
        "load_seconds": load_seconds,
        "load_window": load_window,
        "solo_seconds": solo_seconds,
        "load_average_1min": load_average,
        "requests_per_s": len(completed) / load_seconds,
        "output_tokens_per_s": output_tokens / load_seconds,
        "output_tokens": output_tokens,
        # CPU time the server's processes spent during the load: less sensitive than wall time to other jobs
        # on a shared machine (they take cores, not this process's CPU seconds)
        "cpu_seconds": cpu_seconds,
        "engine_cpu_ms_per_output_token": 1e3 * cpu_seconds["engine"] / output_tokens if output_tokens else None,
        "ttft_s": {"p50": percentile(first_token_seconds, 0.5), "p99": percentile(first_token_seconds, 0.99),
                   "count": len(first_token_seconds)},
        "tpot_s": {"p50": percentile(per_token_seconds, 0.5), "p99": percentile(per_token_seconds, 0.99),
                   "count": len(per_token_seconds)},
        "mismatches": mismatches,
        "failures": failures[:50],
        "stall": stall,
        "probe": probe.status,
        "preemptions": after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"],
        "prefix_cache_hits": after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"],
        "prefix_cache_queries": after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"],
        "end_state": {name: after[name] for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                                     "vllm:num_requests_waiting")},
        "solo_answers": {str(prompt): outcome.tokens for prompt, outcome in sorted(reference.items())},
    }


def slope_mib_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_m = statistics.fmean(m for _, m in points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (m - mean_m) for t, m in points) / spread if spread else None


def rss_summary(samples, load_window) -> dict:
    """The servers' resident memory (MiB) over the load: peaks split at warm-up and at the last quarter, and
    the trend after warm-up, for both processes together and for each (API server, engine core)."""
    start, end = load_window
    during = [(t - start, own / 2**20, children / 2**20) for t, own, children in samples if start <= t <= end]
    if not during:
        return {"samples": 0}
    length = end - start
    summary = {"samples": len(during)}
    for part, pick in (("", lambda own, children: own + children), ("api_server_", lambda own, children: own),
                       ("engine_", lambda own, children: children)):
        series = [(t, pick(own, children)) for t, own, children in during]
        middle = [m for t, m in series if WARMUP_SHARE * length <= t < 0.75 * length]
        last = [m for t, m in series if t >= 0.75 * length]
        summary.update({
            f"{part}warmup_peak_mib": max((m for t, m in series if t < WARMUP_SHARE * length), default=None),
            f"{part}middle_peak_mib": max(middle, default=None),
            f"{part}last_quarter_peak_mib": max(last, default=None),
            f"{part}growth_after_warmup_mib": (max(last) - max(middle)) if middle and last else None,
            f"{part}slope_after_warmup_mib_per_min": slope_mib_per_minute(
                [(t, m) for t, m in series if t >= WARMUP_SHARE * length]),
            f"{part}at_start_mib": series[0][1],
            f"{part}at_end_mib": series[-1][1],
        })
    step = max(1, len(during) // 60)
    summary["series_s_api_server_engine_mib"] = [(round(t, 1), round(own, 1), round(children, 1))
                                                 for t, own, children in during[::step]]
    return summary


def problems(result: dict) -> list[str]:
    """What the soak must not see; each a sentence (empty: the backend passed)."""
    found = []
    if result["mismatches"]:
        found.append(f"{len(result['mismatches'])} answers differ from their solo answers")
    if result["failures"]:
        found.append(f"{len(result['failures'])} requests failed: {result['failures'][:3]}")
    if result["stall"]:
        found.append(f"stalled: {result['stall']}")
    if result["server_error_lines"]:
        found.append(f"the server logged errors: {result['server_error_lines'][:3]}")
    if result["probe"] != "completed":
        found.append(f"the closing probe request ended {result['probe']}")
    if any(value != 0 for value in result["end_state"].values()):
        found.append(f"the engine did not return to empty: {result['end_state']}")
    if result["preemptions"] == 0:
        found.append("no request was preempted: the KV pool is not small enough for the load")
    growth = result["rss"].get("growth_after_warmup_mib")
    if growth is not None and growth > RSS_GROWTH_LIMIT_MIB:
        found.append(f"the server's resident memory grew by {growth:.0f} MiB after warm-up")
    if not result["backend_log_line"] == (result["backend"] == "pagedkv"):
        found.append("the server ran the wrong attention backend")
    return found


def fmt(seconds: float | None, unit: float = 1.0) -> str:
    return "n/a" if seconds is None else f"{seconds * unit:.0f}" if seconds * unit >= 100 else f"{seconds * unit:.3g}"


def trend(mib_per_minute: float | None) -> str:
    return "n/a" if mib_per_minute is None else f"{mib_per_minute:+.1f} MiB/min"


def write_results(args, workload, results, started, name) -> str:
    sys.path.insert(0, HERE)
    from bench_vllm import lscpu, machine  # noqa: E402  (stdlib only)

    git = ["git", "-C", ROOT]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no", "--", "python", "benchmarks"],
                           capture_output=True, text=True).stdout.strip()
    commit += " (with uncommitted changes)" if dirty else ""
    lengths = [len(p) for p in workload.prompts]
    workload_text = (f"SmolLM2-135M {args.dtype}, {args.prompts} distinct prompts of {min(lengths)}-{max(lengths)} "
                     f"random tokens with {min(workload.max_tokens)}-{max(workload.max_tokens)} new tokens each "
                     f"(greedy, ignore_eos), {args.concurrency} streaming clients, {args.disconnect_share:.0%} of "
                     f"requests disconnecting mid-answer, {args.duration:.0f} s of load per backend (at most "
                     f"{args.max_requests} requests), seed {args.seed}; KV pool {args.num_blocks} blocks of "
                     f"{args.block_size} tokens ({args.num_blocks * args.block_size} tokens), max_model_len "
                     f"{args.max_model_len}, max_num_batched_tokens {args.max_num_batched_tokens}, max_num_seqs "
                     f"{args.max_num_seqs}, prefix caching on, enforce_eager")
    lines = [f"# vLLM OpenAI server soak, pagedkv vs vLLM's CPU attention ({'quick' if args.quick else 'full'})", "",
             f"{workload_text}.", "",
             f"Run {started}, commit {commit}; {machine()}; backends run back to back in one invocation "
             f"({', '.join(r['backend'] for r in results)}); each server freshly started; solo answers first.", "",
             "| backend (vLLM 0.32.0 CPU) | requests (completed / disconnected / failed) | completed requests/s | "
             "output tokens/s | engine CPU ms per output token | TTFT p50 / p99, ms | TPOT p50 / p99, ms | "
             "preemptions | answers differing from solo "
             "| KV usage, running, waiting at the end | RSS peak after warm-up -> last quarter, MiB (trend after "
             "warm-up) | "
             "load average (start, end) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["by_status"]
        failed = r["requests"] - s.get("completed", 0) - s.get("disconnected", 0)
        end = r["end_state"]
        rss = r["rss"]
        lines.append(
            f"| {r['backend']} | {r['requests']} ({s.get('completed', 0)} / {s.get('disconnected', 0)} / {failed}) | "
            f"{r['requests_per_s']:.3f} | {r['output_tokens_per_s']:.1f} | "
            f"{fmt(r['engine_cpu_ms_per_output_token'])} | "
            f"{fmt(r['ttft_s']['p50'], 1e3)} / "
            f"{fmt(r['ttft_s']['p99'], 1e3)} | {fmt(r['tpot_s']['p50'], 1e3)} / {fmt(r['tpot_s']['p99'], 1e3)} | "
            f"{r['preemptions']:.0f} | {len(r['mismatches'])} | {end['vllm:kv_cache_usage_perc']:g}, "
            f"{end['vllm:num_requests_running']:g}, {end['vllm:num_requests_waiting']:g} | "
            f"{fmt(rss.get('middle_peak_mib'))} -> {fmt(rss.get('last_quarter_peak_mib'))} "
            f"({trend(rss.get('slope_after_warmup_mib_per_min'))}) | "
            f"{r['load_average_1min'][0]:.1f}, {r['load_average_1min'][1]:.1f} |")
    lines.append("")
    if len(results) == 2:
        a, b = results
        same = sum(a["solo_answers"][k] == b["solo_answers"].get(k) for k in a["solo_answers"])
        lines.append(f"Solo answers equal between the backends: {same} of {len(a['solo_answers'])} prompts.")
        cpu_a, cpu_b = a["engine_cpu_ms_per_output_token"], b["engine_cpu_ms_per_output_token"]
        if a["requests_per_s"] and b["requests_per_s"] and cpu_a and cpu_b:
            lines.append(f"{a['backend']} against {b['backend']}: {a['requests_per_s'] / b['requests_per_s']:.2f}x "
                         f"the completed requests/s; {a['backend']}'s time over {b['backend']}'s: TTFT p50 "
                         f"{a['ttft_s']['p50'] / b['ttft_s']['p50']:.2f}x, TPOT p50 "
                         f"{a['tpot_s']['p50'] / b['tpot_s']['p50']:.2f}x, engine CPU per output token "
                         f"{cpu_a / cpu_b:.2f}x.")
    for r in results:
        found = problems(r)
        lines.append(f"{r['backend']}: {'passed every check' if not found else 'FAILED: ' + '; '.join(found)}; "
                     f"prefix-cache hits {r['prefix_cache_hits']:.0f} of {r['prefix_cache_queries']:.0f} queried "
                     f"tokens; solo answers took {r['solo_seconds']:.0f} s.")
        for mismatch in r["mismatches"][:5]:
            lines.append(f"  differs: {json.dumps(mismatch)}")
    text = "\n".join(lines)
    print("\n" + text)
    path = os.path.join(args.results_dir, name)
    os.makedirs(args.results_dir, exist_ok=True)
    with open(path + ".md", "w") as f:
        f.write(text + "\n")
    with open(path + ".json", "w") as f:
        json.dump({"workload": workload_text, "args": vars(args), "started": started, "commit": commit,
                   "machine": machine(), "lscpu": lscpu(), "results": results}, f, indent=1)
    return path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ROOT, ".deps", "smollm2-hf"))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--quick", action="store_true", help="60 s of load per backend")
    parser.add_argument("--duration", type=float, help="seconds of load per backend (new requests stop then)")
    parser.add_argument("--max-requests", type=int)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts in the pool")
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=384)
    parser.add_argument("--min-new", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--disconnect-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    # vLLM's CPU attention takes block sizes that are multiples of 32 only; both backends get the same pool
    parser.add_argument("--block-size", type=int, default=32)
    # 1024 tokens: a quarter of what CONCURRENCY requests of the mean length hold, so the scheduler preempts
    parser.add_argument("--num-blocks", type=int, default=32, help="KV pool size in blocks")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--logprobs", type=int, default=2, help="top logprobs streamed per token (for mismatches)")
    parser.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", help="results file name without extension")
    parser.add_argument("--log-dir", help="where the servers' logs go (default: a new temporary folder)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = make_workload(args)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    name = args.name or (f"vllm_soak_cpu{'_quick' if args.quick else ''}_{time.strftime('%Y-%m-%d', time.gmtime())}_"
                         f"{commit}")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="soak_vllm_server_")
    os.makedirs(log_dir, exist_ok=True)
    results = []
    for backend in args.backends:
        log_path = os.path.join(log_dir, f"{name}_{backend}_server.log")
        results.append(asyncio.run(run_backend(args, backend, workload, log_path)))
    write_results(args, workload, results, started, name)
    return 1 if any(problems(r) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
