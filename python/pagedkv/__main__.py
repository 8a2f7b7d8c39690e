"""`python -m pagedkv`: an environment report to paste into a bug, with a one-line self-test of each op.

Prints pagedkv.build_info() (what the extension was built against, what runs it, which CPU kernels)
and runs paged_store, paged_load and flash_attn_paged once on every device the build supports,
checking each against pagedkv.reference. Exit status 1 when a self-test fails.
`python -m pagedkv --json` prints the report as JSON (self-test results included).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import pagedkv
from pagedkv import reference

# One small ragged step: 2 rows (3 cached + 2 new tokens, 0 cached + 4 new), GQA 4/2, pages of 4
# tokens scattered over the pool so the page table is really used.
HEAD_DIM, Q_HEADS, KV_HEADS, PAGE, PAGES = 64, 4, 2, 4, 8
CACHED, NEW = (3, 0), (2, 4)
TABLE = ((5, 2, 7), (1, 6, 0))
# The self-test's dtype per device: float32 on the CPU; bf16 on CUDA, whose kernels attend with 16-bit
# queries and caches. Attention against the float64 reference within the op tests' bound for that
# dtype: a few float32 roundings per key, or bf16 inputs and probabilities.
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}
ATTENTION_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _step(device):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def rand_dtype(*shape):
        return rand(*shape).to(DTYPES[device])

    offsets = torch.tensor([0, NEW[0], NEW[0] + NEW[1]], dtype=torch.int32, device=device)
    lengths = torch.tensor(CACHED, dtype=torch.int32, device=device)
    table = torch.tensor(TABLE, dtype=torch.int32, device=device)
    k_cache, v_cache = rand_dtype(PAGES, PAGE, KV_HEADS, HEAD_DIM), rand_dtype(PAGES, PAGE, KV_HEADS, HEAD_DIM)
    tokens = sum(NEW)
    return dict(
        key=rand(tokens, KV_HEADS, HEAD_DIM), value=rand(tokens, KV_HEADS, HEAD_DIM), q=rand_dtype(tokens, Q_HEADS, HEAD_DIM),
        k_cache=k_cache, v_cache=v_cache, offsets=offsets, lengths=lengths, table=table,
    )  # fmt: skip


def self_test(device: str) -> list[tuple[str, bool, str]]:
    """(op, passed, detail) for each op on device, each compared with pagedkv.reference."""
    s = _step(device)
    results = []

    def run(name, fn):
        try:
            ok, detail = fn()
        except Exception as error:  # a broken install is what this reports, whatever the error
            ok, detail = False, f"{type(error).__name__}: {error}"
        results.append((name, ok, detail))

    ref_k, ref_v = s["k_cache"].clone(), s["v_cache"].clone()

    def store():
        reference.paged_store(s["key"], s["value"], ref_k, ref_v, s["offsets"], s["lengths"], s["table"])
        pagedkv.paged_store(s["key"], s["value"], s["k_cache"], s["v_cache"], s["offsets"], s["lengths"], s["table"])
        same = torch.equal(s["k_cache"], ref_k) and torch.equal(s["v_cache"], ref_v)
        return same, "caches equal the reference's" if same else "caches differ from the reference's"

    def load():
        seq_lens = s["lengths"] + torch.tensor(NEW, dtype=torch.int32, device=device)
        got = pagedkv.paged_load(ref_k, s["table"], seq_lens)
        want = torch.cat(reference.gather_rows(ref_k, None, s["table"], seq_lens, out_dtype=ref_k.dtype))
        same = torch.equal(got, want)
        return same, f"{got.shape[0]} tokens equal the reference's" if same else "tokens differ from the reference's"

    def attend():
        got = pagedkv.flash_attn_paged(s["q"], s["offsets"], ref_k, ref_v, s["lengths"], s["table"])
        want = reference.flash_attn_paged(s["q"].double(), s["offsets"], ref_k, ref_v, s["lengths"], s["table"])
        error = ((got.double() - want).norm() / want.norm()).item()
        bound = ATTENTION_RTOL[s["q"].dtype]
        return error <= bound, f"relative error {error:.1e} vs the float64 reference (bound {bound})"

    run("paged_store", store)
    run("paged_load", load)
    run("flash_attn_paged", attend)
    return results


def devices(info: dict) -> list[str]:
    return ["cpu"] + (["cuda"] if info["with_cuda"] and info["cuda_devices"] else [])


def report_lines(info: dict) -> list[str]:
    built = info["torch_built_against"] or "unknown (an extension built without a build record)"
    cuda = (
        f"kernels for {', '.join(info['cuda_archs'])} (toolkit {info['cuda_toolkit']})"
        if info["with_cuda"]
        else "none compiled"
    )
    kernels = ", ".join(info["cpu_kernels_available"])
    request = f", PAGEDKV_CPU_ISA={info['PAGEDKV_CPU_ISA']}" if info["PAGEDKV_CPU_ISA"] else ""
    dot = ", bf16 dot products" if info["cpu_bf16_dot_products"] else ""
    dot += " (FP8 rows through VBMI byte lookups)" if dot and info["cpu_fp8_byte_lookups"] else ""
    return [
        f"pagedkv {info['pagedkv']} at {info['package_dir']}",
        f"python {info['python']} on {info['platform']}",
        f"torch {info['torch']} (CUDA {info['torch_cuda'] or 'none'}); extension built against torch {built}",
        f"build: mode {info['build_mode']}: {info['build_reason']}" if info["build_mode"] else "build: unrecorded",
        f"CUDA: {cuda}; devices: {', '.join(info['cuda_devices']) or 'none'}",
        f"CPU kernels: available {kernels}; in use {info['cpu_kernel_in_use']}{dot}{request}",
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="the report as JSON, self-test results included")
    args = parser.parse_args(argv)  # an unknown argument is a usage error, not ignored
    info = pagedkv.build_info()
    tests = {device: self_test(device) for device in devices(info)}
    passed = all(ok for results in tests.values() for _, ok, _ in results)
    if args.json:
        info["self_test"] = {d: [{"op": n, "ok": ok, "detail": t} for n, ok, t in r] for d, r in tests.items()}
        print(json.dumps(info, indent=2))
        return 0 if passed else 1
    for line in report_lines(info):
        print(line)
    for device, results in tests.items():
        for name, ok, detail in results:
            print(f"self-test {device} {name}: {'ok' if ok else 'FAILED'} ({detail})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
