"""vLLM offline throughput with pagedkv attention against vLLM's own CPU attention backend.

Runs in the vLLM venv that scripts/test_vllm.sh builds (.deps/vllm-venv; the model folder from
tests/vllm_integration/write_hf_model.py). Workload where attention matters: REQUESTS requests of PROMPT_TOKENS
random prompt tokens each (seeded, the same for both backends), NEW_TOKENS greedy new tokens each
(EOS ignored, so every request runs to the end), float32, block size 128 (vLLM's CPU default), no
prefix caching (distinct prompts), torch.compile off (attention is an opaque op either way).

Method: vLLM picks its attention backend once per process, so every timed run is a fresh process
(``PAGEDKV_VLLM=1`` or not); runs alternate between the backends for ROUNDS rounds. Inside a run,
one short warm-up generate call precedes the timed ``LLM.generate`` of the whole workload
(wall clock, prefill and every decode step, scheduler included). Reported: median seconds per
backend, output tokens/s, the pagedkv/vLLM speed ratio, and whether the two backends produced the
same tokens. Results go to benchmarks/results/vllm_offline_cpu[_quick].{json,md}.

  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py            # 8 x 2048-token prompts, 128 new tokens, 3 rounds
  .deps/vllm-venv/bin/python benchmarks/bench_vllm.py --quick    # 4 x 512-token prompts, 32 new tokens, 1 round
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


def one_run(args) -> None:
    """The child process: one engine, one warm-up, one timed generate; prints a JSON line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    generator = torch.Generator().manual_seed(0)
    vocab = 49152 if args.vocab is None else args.vocab
    prompts = [{"prompt_token_ids": torch.randint(100, vocab, (args.prompt_tokens,), generator=generator).tolist()}
               for _ in range(args.requests)]
    llm = LLM(model=args.model, dtype="float32", block_size=128, max_model_len=args.prompt_tokens + args.new_tokens,
              max_num_seqs=args.requests, enable_prefix_caching=False, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=args.kv_cache_mib << 20, gpu_memory_utilization=0.1)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


def spawn(args, backend: str) -> dict:
    env = dict(os.environ, PAGEDKV_VLLM="1" if backend == "pagedkv" else "0")
    command = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model,
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
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.child:
        one_run(args)
        return

    seconds = {backend: [] for backend in BACKENDS}
    tokens = {}
    for round_index in range(args.rounds):
        for backend in BACKENDS:
            result = spawn(args, backend)
            seconds[backend].append(result["seconds"])
            tokens[backend] = result["tokens"]
            print(f"round {round_index + 1}/{args.rounds} {backend}: {result['seconds']:.2f} s", flush=True)
    output_tokens = args.requests * args.new_tokens
    rows = {backend: {"median_s": statistics.median(s), "runs_s": s,
                      "output_tokens_per_s": output_tokens / statistics.median(s)} for backend, s in seconds.items()}
    ratio = rows["vllm"]["median_s"] / rows["pagedkv"]["median_s"]
    same = tokens["pagedkv"] == tokens["vllm"]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    workload = (f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.new_tokens} new tokens, "
                f"float32, block 128, {args.rounds} round(s)")
    table = [f"# vLLM offline throughput, pagedkv vs vLLM's CPU attention ({'quick' if args.quick else 'full'})", "",
             f"SmolLM2-135M, {workload}; {time.strftime('%Y-%m-%d')}, commit {commit}; same tokens: {same}", "",
             "| backend | median s | output tokens/s | runs (s) |", "|---|---|---|---|"]
    for backend in BACKENDS:
        row = rows[backend]
        table.append(f"| {backend} | {row['median_s']:.2f} | {row['output_tokens_per_s']:.2f} | "
                     + ", ".join(f"{s:.2f}" for s in row["runs_s"]) + " |")
    table += ["", f"pagedkv speed / vLLM CPU attention speed: {ratio:.2f}x"]
    print("\n".join(table))
    name = os.path.join(HERE, "results", "vllm_offline_cpu" + ("_quick" if args.quick else ""))
    with open(name + ".md", "w") as f:
        f.write("\n".join(table) + "\n")
    with open(name + ".json", "w") as f:
        json.dump({"workload": workload, "commit": commit, "rows": rows, "speed_ratio": ratio,
                   "same_tokens": same}, f, indent=1)


if __name__ == "__main__":
    main()
