"""vLLM offline throughput with pagedkv attention against vLLM's own CPU attention backend.

Runs in the vLLM venv that scripts/test_vllm.sh builds (.deps/vllm-venv; the model folder from
tests/vllm_integration/write_hf_model.py). Workload where attention matters: REQUESTS requests of PROMPT_TOKENS
random prompt tokens each (seeded, the same for both backends), NEW_TOKENS greedy new tokens each
(EOS ignored, so every request runs to the end), float32 (or --dtype), block size 128 (vLLM's CPU default), no
prefix caching (distinct prompts), torch.compile off (attention is an opaque op either way).

Method: vLLM picks its attention backend once per process, so every timed run is a fresh process
(``PAGEDKV_VLLM=1`` or not); runs alternate between the backends for ROUNDS rounds. Inside a run,
one short warm-up generate call precedes the timed ``LLM.generate`` of the whole workload
(wall clock, prefill and every decode step, scheduler included). Reported: median seconds per
backend, output tokens/s, the pagedkv/vLLM speed ratio, and whether the two backends produced the
same tokens. Each run also sums the wall time of the backend's attention calls (pagedkv: forward,
which stores K/V too; vLLM: forward plus its separate KV-cache update), split into prefill steps (any
request with more than one new token) and decode-only steps: on a shared machine the end-to-end time
mixes in everything else the model does, this is where the backends differ. Results go to
benchmarks/results/vllm_offline_cpu[_quick][_DTYPE].{json,md} (no dtype suffix for float32).

  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py            # 8 x 2048-token prompts, 128 new tokens, 3 rounds
  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py --quick    # 4 x 512-token prompts, 32 new tokens, 1 round
  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py --dtype bfloat16 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FULL = dict(requests=8, prompt_tokens=2048, new_tokens=128, rounds=3)
QUICK = dict(requests=4, prompt_tokens=512, new_tokens=32, rounds=1)
BACKENDS = ("pagedkv", "vllm")


def time_attention(backend: str, max_decode_rows: int) -> dict:
    """Wrap the backend's attention entry points to sum their wall time per step kind (in place)."""
    if backend == "pagedkv":
        from pagedkv.vllm_backend import PagedKVAttentionImpl as impl

        methods = ("forward",)
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl

        methods = ("forward", "do_kv_cache_update")
    seconds = {"prefill": 0.0, "decode": 0.0}

    def timed(original):
        def call(self, layer, query, *rest, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, layer, query, *rest, **kwargs)
            finally:
                # a decode-only step has one new token per request, and this workload runs at most
                # `requests` requests at once, so more rows than that is a step with a prefill chunk
                kind = "decode" if query.shape[0] <= max_decode_rows else "prefill"
                seconds[kind] += time.perf_counter() - start

        return call

    for name in methods:
        setattr(impl, name, timed(getattr(impl, name)))
    return seconds


def one_run(args) -> None:
    """The child process: one engine, one warm-up, one timed generate; prints a JSON line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    attention = time_attention(args.backend, args.requests)

    generator = torch.Generator().manual_seed(0)
    vocab = 49152 if args.vocab is None else args.vocab
    prompts = [{"prompt_token_ids": torch.randint(100, vocab, (args.prompt_tokens,), generator=generator).tolist()}
               for _ in range(args.requests)]
    llm = LLM(model=args.model, dtype=args.dtype, block_size=128, max_model_len=args.prompt_tokens + args.new_tokens,
              max_num_seqs=args.requests, enable_prefix_caching=False, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=args.kv_cache_mib << 20, gpu_memory_utilization=0.1)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    attention.update(prefill=0.0, decode=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"seconds": seconds, "attention_s": attention, "tokens": tokens}), flush=True)


def spawn(args, backend: str) -> dict:
    env = dict(os.environ, PAGEDKV_VLLM="1" if backend == "pagedkv" else "0")
    command = [sys.executable, os.path.abspath(__file__), "--child", "--backend", backend, "--dtype", args.dtype,
               "--model", args.model,
               "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
               "--new-tokens", str(args.new_tokens), "--kv-cache-mib", str(args.kv_cache_mib)]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        raise SystemExit(f"{backend} run failed:\n{(run.stdout + run.stderr)[-4000:]}")
    used_pagedkv = "pagedkv attention backend" in run.stdout + run.stderr
    if used_pagedkv != (backend == "pagedkv"):
        raise SystemExit(f"{backend} run used the wrong attention backend")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ROOT, ".deps", "smollm2-hf"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.child:
        one_run(args)
        return

    runs = {backend: [] for backend in BACKENDS}
    tokens = {}
    load = [os.getloadavg()[0]]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for round_index in range(args.rounds):
        for backend in BACKENDS:
            result = spawn(args, backend)
            load.append(os.getloadavg()[0])
            runs[backend].append({"seconds": result["seconds"], "attention_s": result["attention_s"]})
            tokens[backend] = result["tokens"]
            attention = result["attention_s"]
            print(f"round {round_index + 1}/{args.rounds} {backend}: {result['seconds']:.2f} s (attention: prefill "
                  f"{attention['prefill']:.2f} s, decode {attention['decode']:.2f} s; load {load[-1]:.2f})", flush=True)
    write_results(args, runs, tokens["pagedkv"] == tokens["vllm"], started, load)


def median_of(backend_runs, pick) -> float:
    return statistics.median(pick(run) for run in backend_runs)


def machine() -> str:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    return f"{model}, {os.cpu_count()} logical CPUs"


def write_results(args, runs, same, started, load) -> None:
    output_tokens = args.requests * args.new_tokens
    phases = ("prefill", "decode")
    rows = {}
    for backend, backend_runs in runs.items():
        median_s = median_of(backend_runs, lambda run: run["seconds"])
        rows[backend] = {"median_s": median_s, "output_tokens_per_s": output_tokens / median_s, "runs": backend_runs}
        for phase in phases:
            rows[backend][f"median_attention_{phase}_s"] = median_of(backend_runs, lambda run: run["attention_s"][phase])
    ratio = rows["vllm"]["median_s"] / rows["pagedkv"]["median_s"]
    attention_ratio = {phase: rows["vllm"][f"median_attention_{phase}_s"] / rows["pagedkv"][f"median_attention_{phase}_s"]
                       for phase in phases}
    git = ["git", "-C", ROOT]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    commit += " (with uncommitted changes)" if dirty else ""
    workload = (f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, "
                f"{args.dtype}, block 128, {args.rounds} round(s), backends alternating pagedkv, vllm")
    kind = "quick" if args.quick else "full"
    table = [f"# vLLM offline throughput, pagedkv vs vLLM's CPU attention ({kind}, {args.dtype})", "",
             f"SmolLM2-135M, {workload}.", "",
             f"Run {started}, commit {commit}; {machine()}; 1-minute load average before the first run and after "
             f"each: {', '.join(f'{x:.2f}' for x in load)} (a machine shared with other jobs: end-to-end times "
             f"vary run to run). Same tokens from both backends: {same}.", "",
             "| backend | median s | output tokens/s | attention in prefill steps, median s | attention in decode "
             "steps, median s | runs: total s (prefill, decode attention s) |", "|---|---|---|---|---|---|"]
    for backend in BACKENDS:
        row = rows[backend]
        each = ", ".join(f"{run['seconds']:.1f} ({run['attention_s']['prefill']:.1f}, {run['attention_s']['decode']:.2f})"
                         for run in row["runs"])
        table.append(f"| {backend} | {row['median_s']:.2f} | {row['output_tokens_per_s']:.2f} | "
                     f"{row['median_attention_prefill_s']:.2f} | {row['median_attention_decode_s']:.2f} | {each} |")
    table += ["", f"End to end, pagedkv speed / vLLM CPU attention speed: {ratio:.2f}x. Attention alone (vLLM's "
              f"time / pagedkv's): prefill steps {attention_ratio['prefill']:.2f}x, decode steps "
              f"{attention_ratio['decode']:.2f}x."]
    print("\n".join(table))
    suffix = ("_quick" if args.quick else "") + ("" if args.dtype == "float32" else f"_{args.dtype}")
    name = os.path.join(HERE, "results", "vllm_offline_cpu" + suffix)
    with open(name + ".md", "w") as f:
        f.write("\n".join(table) + "\n")
    with open(name + ".json", "w") as f:
        json.dump({"workload": workload, "started": started, "commit": commit, "machine": machine(),
                   "load_average_1min": load, "rows": rows, "speed_ratio": ratio,
                   "attention_speed_ratio": attention_ratio, "same_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
