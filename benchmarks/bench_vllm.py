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
mixes in everything else the model does, this is where the backends differ.

--fp8 compares FP8 KV caches (vLLM's kv_cache_dtype="fp8", e4m3 with per-tensor scales) in three runs:
pagedkv with an FP8 cache, pagedkv with a 16-bit cache of the model's dtype, vLLM's CPU attention with an FP8
cache; the model's dtype defaults to bfloat16 there (FP8 caches serve 16-bit models). Results go to
benchmarks/results/vllm_offline_cpu[_fp8][_quick][_DTYPE].{json,md} (no dtype suffix for float32).

  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py            # 8 x 2048-token prompts, 128 new tokens, 3 rounds
  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py --quick    # 4 x 512-token prompts, 32 new tokens, 1 round
  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py --dtype bfloat16 --rounds 1
  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py --fp8 --rounds 1   # bfloat16 model, FP8 caches
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


def run_configs(args) -> list[tuple[str, str, str]]:
    """(row label, backend, kv_cache_dtype) of each run of a round, in the order they alternate."""
    if not args.fp8:
        return [(backend, backend, "auto") for backend in BACKENDS]
    return [("pagedkv, fp8 cache", "pagedkv", "fp8"), (f"pagedkv, {args.dtype} cache", "pagedkv", "auto"),
            ("vllm, fp8 cache", "vllm", "fp8")]


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
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=128,
              max_model_len=args.prompt_tokens + args.new_tokens,
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


def spawn(args, backend: str, kv_cache_dtype: str) -> dict:
    env = dict(os.environ, PAGEDKV_VLLM="1" if backend == "pagedkv" else "0")
    command = [sys.executable, os.path.abspath(__file__), "--child", "--backend", backend, "--dtype", args.dtype,
               "--kv-cache-dtype", kv_cache_dtype, "--model", args.model,
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
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="the model's dtype: float32 (bfloat16 with --fp8) unless given")
    parser.add_argument("--fp8", action="store_true", help="FP8 KV caches: pagedkv fp8, pagedkv 16-bit, vLLM fp8")
    parser.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.fp8 else "float32"
    if args.child:
        one_run(args)
        return

    configs = run_configs(args)
    runs = {label: [] for label, _, _ in configs}
    tokens = {}
    load = [os.getloadavg()[0]]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for round_index in range(args.rounds):
        for label, backend, kv_cache_dtype in configs:
            result = spawn(args, backend, kv_cache_dtype)
            load.append(os.getloadavg()[0])
            runs[label].append({"seconds": result["seconds"], "attention_s": result["attention_s"]})
            tokens[label] = result["tokens"]
            attention = result["attention_s"]
            print(f"round {round_index + 1}/{args.rounds} {label}: {result['seconds']:.2f} s (attention: prefill "
                  f"{attention['prefill']:.2f} s, decode {attention['decode']:.2f} s; load {load[-1]:.2f})", flush=True)
    write_results(args, configs, runs, tokens, started, load)


def median_of(backend_runs, pick) -> float:
    return statistics.median(pick(run) for run in backend_runs)


def machine() -> str:
    """The CPU as lscpu names it, with the vector extensions that pick vLLM's and pagedkv's CPU paths."""
    fields = lscpu()
    flags = fields.get("Flags", "").split()
    if "amx_tile" in flags:
        vector = "AMX"
    elif "avx512f" in flags:
        vector = "AVX-512" + (" with BF16" if "avx512_bf16" in flags else "") + ", no AMX"
    else:
        vector = "AVX2" if "avx2" in flags else "no AVX2"
    return (f"{fields.get('Model name', 'unknown CPU')} (family {fields.get('CPU family', '?')}, model "
            f"{fields.get('Model', '?')}), {fields.get('CPU(s)', '?')} CPUs, L2 {fields.get('L2 cache', '?')}, "
            f"L3 {fields.get('L3 cache', '?')}, {vector} (lscpu)")


def same_requests(tokens_a, tokens_b) -> int:
    """How many requests two runs completed with the same tokens."""
    return sum(a == b for a, b in zip(tokens_a, tokens_b, strict=True))


def write_results(args, configs, runs, tokens, started, load) -> None:
    output_tokens = args.requests * args.new_tokens
    phases = ("prefill", "decode")
    rows = {}
    for label, backend_runs in runs.items():
        median_s = median_of(backend_runs, lambda run: run["seconds"])
        rows[label] = {"median_s": median_s, "output_tokens_per_s": output_tokens / median_s, "runs": backend_runs}
        for phase in phases:
            rows[label][f"median_attention_{phase}_s"] = median_of(backend_runs, lambda run: run["attention_s"][phase])

    def ratios(ours: str, theirs: str) -> tuple[float, dict]:
        """(end-to-end speed ratio, attention speed ratio per phase) of row `ours` over row `theirs`."""
        return (rows[theirs]["median_s"] / rows[ours]["median_s"],
                {phase: rows[theirs][f"median_attention_{phase}_s"] / rows[ours][f"median_attention_{phase}_s"]
                 for phase in phases})

    labels = [label for label, _, _ in configs]
    # pagedkv's first row against vLLM's (the last), and with --fp8 the FP8 row against the 16-bit one
    comparisons = [(labels[0], labels[-1])] + ([(labels[0], labels[1])] if args.fp8 else [])
    git = ["git", "-C", ROOT]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    commit += " (with uncommitted changes)" if dirty else ""
    workload = (f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, "
                f"{args.dtype} model, block 128, {args.rounds} round(s), runs alternating {', '.join(labels)}")
    kind = "quick" if args.quick else "full"
    title = "FP8 KV caches, " if args.fp8 else ""
    same = {f"{a} / {b}": same_requests(tokens[a], tokens[b]) for a, b in comparisons}
    table = [f"# vLLM offline throughput, pagedkv vs vLLM's CPU attention ({title}{kind}, {args.dtype})", "",
             f"SmolLM2-135M, {workload}.", "",
             f"Run {started}, commit {commit}; {machine()}; 1-minute load average before the first run and after "
             f"each: {', '.join(f'{x:.2f}' for x in load)} (a machine shared with other jobs: end-to-end times "
             f"vary run to run). Requests with the same tokens (of {args.requests}): "
             f"{'; '.join(f'{pair}: {count}' for pair, count in same.items())}.", "",
             "| run | median s | output tokens/s | attention in prefill steps, median s | attention in decode "
             "steps, median s | runs: total s (prefill, decode attention s) |", "|---|---|---|---|---|---|"]
    for label in labels:
        row = rows[label]
        each = ", ".join(f"{run['seconds']:.1f} ({run['attention_s']['prefill']:.1f}, {run['attention_s']['decode']:.2f})"
                         for run in row["runs"])
        table.append(f"| {label} | {row['median_s']:.2f} | {row['output_tokens_per_s']:.2f} | "
                     f"{row['median_attention_prefill_s']:.2f} | {row['median_attention_decode_s']:.2f} | {each} |")
    table.append("")
    summary = {}
    for ours, theirs in comparisons:
        ratio, attention_ratio = ratios(ours, theirs)
        summary[f"{ours} / {theirs}"] = {"speed_ratio": ratio, "attention_speed_ratio": attention_ratio}
        table.append(f"{ours} against {theirs}: {ratio:.2f}x the speed end to end; attention alone ({theirs}'s "
                     f"time / {ours}'s): prefill steps {attention_ratio['prefill']:.2f}x, decode steps "
                     f"{attention_ratio['decode']:.2f}x.")
    print("\n".join(table))
    suffix = ("_fp8" if args.fp8 else "") + ("_quick" if args.quick else "") + (
        "" if args.dtype == "float32" else f"_{args.dtype}")
    name = os.path.join(HERE, "results", "vllm_offline_cpu" + suffix)
    with open(name + ".md", "w") as f:
        f.write("\n".join(table) + "\n")
    with open(name + ".json", "w") as f:
        json.dump({"workload": workload, "started": started, "commit": commit, "machine": machine(),
                   "lscpu": lscpu(), "load_average_1min": load, "rows": rows, "comparisons": summary,
                   "same_requests": same}, f, indent=1)


def lscpu() -> dict:
    """lscpu's model name, cores, caches and flags (AVX-512 decides vLLM's CPU FP8 path), as far as present."""
    run = subprocess.run(["lscpu"], capture_output=True, text=True)
    keep = ("Model name", "CPU family", "Model", "CPU(s)", "Thread(s) per core", "L1d cache", "L2 cache", "L3 cache",
            "Flags")
    fields = dict(line.split(":", 1) for line in run.stdout.splitlines() if ":" in line)
    return {key: fields[key].strip() for key in keep if key in fields}


if __name__ == "__main__":
    main()
