"""The kernels Nsight Compute profiles in gpu_run.sh's `profile` stage: one flash_attn_paged decode
each for bf16 and e4m3 (issue 22's decode: B=32, L=8192, Hq/Hk 32/8, D 128, page 16) and one causal
prefill (B=8, L=4096), then the same prefill on the warpgroup-MMA kernels (kernel option
cuda_prefill_wgmma, where the device runs them), in that order, on the same pools as
benchmarks/bench_gpu.py. ncu replays each launch for its metrics, so one launch of each is all this runs."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu  # noqa: E402  (its pools and the pagedkv import)

ops = torch.ops.pagedkv


def decode(dtype, b=32, length=8192, hq=32, hk=8, d=128, page=16):
    pool = bench_gpu.make_pool(b, [length] * b, hk, d, page, dtype)
    q = torch.randn((b, hq, d), device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    cached = torch.full((b,), length - 1, dtype=torch.int32, device="cuda")
    ops.flash_attn_paged(q, offsets, pool["k"], pool["v"], cached, pool["table"], None, True, pool["ks"], pool["vs"],
                         128)


def prefill(b=8, length=4096, hq=32, hk=8, d=128, page=16):
    pool = bench_gpu.make_pool(b, [length] * b, hk, d, page, torch.bfloat16)
    q = torch.randn((b * length, hq, d), device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(0, b * length + 1, length, dtype=torch.int32, device="cuda")
    cached = torch.zeros((b,), dtype=torch.int32, device="cuda")
    ops.flash_attn_paged(q, offsets, pool["k"], pool["v"], cached, pool["table"])


if __name__ == "__main__":
    decode(torch.bfloat16)
    decode(torch.float8_e4m3fn)
    prefill()
    done = "decode bf16, decode e4m3, prefill bf16"
    if bench_gpu.pagedkv._C.cuda_wgmma_available(0):
        previous = bench_gpu.pagedkv.set_kernel_options(cuda_prefill_wgmma=True)
        prefill()
        bench_gpu.pagedkv.set_kernel_options(**previous)
        done += ", prefill bf16 on warpgroup MMA"
    torch.cuda.synchronize()
    print("profiled:", done)
