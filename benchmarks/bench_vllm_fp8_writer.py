"""The vLLM backend's FP8 store on the CPU: the codes vLLM's CPU writer makes (rounded toward zero), by
torch.ops.pagedkv._vllm_cpu_fp8_values then paged_store with a scale of one, against the same rule in
torch operations (the oracle of tests/ops/test_vllm_cpu_fp8_values.py, which the backend ran before) and
against paged_store's own FP8 quantization with the per-tensor scale (rounded to nearest even).

One layer's K and V of a prefill step of SmolLM2-135M's shape: T tokens x 3 KV heads x 64, bf16, page 16,
e4m3; medians of interleaved rounds (common.time_interleaved).

  python benchmarks/bench_vllm_fp8_writer.py --threads 1 --reps 15
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import common
from common import pagedkv

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests"),
                os.path.join(os.path.dirname(__file__), "..", "tests", "ops")]
from test_vllm_cpu_fp8_values import vllm_cpu_fp8_reference  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    T, H, D, P, fp8 = args.tokens, 3, 64, 16, torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(T, H, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    pages = T // P + 1
    kc, vc = (torch.zeros(pages, P, H, D, dtype=fp8) for _ in range(2))
    rows = (torch.tensor([0, T], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.arange(pages, dtype=torch.int32)[None])
    scale, one = torch.tensor(0.05), torch.ones(())
    codes = torch.ops.pagedkv._vllm_cpu_fp8_values
    candidates = {
        "backend (C writer)": lambda: pagedkv.paged_store(codes(key, scale, fp8), codes(value, scale, fp8), kc, vc,
                                                          *rows, one, one),
        "torch rule": lambda: pagedkv.paged_store(vllm_cpu_fp8_reference(key, scale, fp8),
                                                  vllm_cpu_fp8_reference(value, scale, fp8), kc, vc, *rows, one, one),
        "paged_store, RNE": lambda: pagedkv.paged_store(key, value, kc, vc, *rows, scale, scale),
    }
    t = {n: common.median(s) for n, s in common.time_interleaved(candidates, args.reps, 2).items()}
    env = common.environment()
    print(f"{T} tokens x {H} heads x {D}, e4m3, {args.threads} thread(s); {env['device']}, "
          f"{env['pagedkv_cpu_isa']}, {env['date']}, {env['commit'][:7]}, load average {env['load_average'][0]:.1f}")
    base = t["backend (C writer)"]
    for n, s in t.items():
        print(f"  {n:20s} {s * 1e3:8.2f} ms  ({s / base:.2f}x the backend's)")


if __name__ == "__main__":
    main()
