"""Sparse top-k decode on the CPU: flash_attn_paged_sparse over K listed tokens vs dense decode over all L.

Workload (issue 20, DeepSeek-V3.2-style indexer output): B sequences of L cached tokens decode one token
each; an indexer picked K of the L tokens per KV head (random here, in random page order). Hq/Hk 32/8,
D 128, page 16, bf16 cache. Candidates, in one process on the same cache (see common.py for the method):
- dense  : flash_attn_paged over all L keys of each sequence
- sparse : flash_attn_paged_sparse over the K listed tokens
The sparse output is compared with pagedkv.reference before timing. The ideal ratio is about L / K (the
KV bytes read); the sparse kernel gathers single rows instead of streaming whole pages. Each case runs
twice: the pool as torch allocates it (4 KiB pages here: every gathered row is a TLB miss and a page
walk) and the same pool copied into memory madvised for transparent huge pages (2 MiB pages).

  python benchmarks/bench_sparse.py --quick     # B=1, L=65536, K=2048
  python benchmarks/bench_sparse.py             # + B=4 and K=512
"""

from __future__ import annotations

import ctypes
import sys

import common
import torch
from common import pagedkv

from pagedkv import reference as ref

Hq, Hk, D, P = 32, 8, 128, 16


def make_case(B, L, K, gen):
    pages = (L + P - 1) // P
    num_pages = B * pages
    table = common.random_table(B, pages, num_pages, gen)
    k = torch.randn(num_pages, P, Hk, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_pages, P, Hk, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(B, Hq, D, generator=gen).to(torch.bfloat16)
    # K distinct logical positions per (sequence, KV head), encoded through the page table
    pos = torch.stack([torch.stack([torch.randperm(L, generator=gen)[:K] for _ in range(Hk)]) for _ in range(B)])
    pages_of = torch.gather(table.long(), 1, (pos // P).view(B, -1)).view(B, Hk, K)
    indices = (pages_of * P + pos % P).to(torch.int32)
    return dict(B=B, L=L, K=K, q=q, k=k, v=v, table=table, indices=indices,
                offsets=torch.arange(B + 1, dtype=torch.int32), lengths=torch.full((B,), L - 1, dtype=torch.int32))


MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def huge_page_copy(t):
    """A copy of t in fresh memory madvised for transparent huge pages before its first touch (Linux;
    elsewhere, or when the kernel refuses, an ordinary copy: the row's `pages` column then says so)."""
    out = torch.empty_like(t)
    ptr, size = out.data_ptr(), out.numel() * out.element_size()
    start, end = (ptr + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, (ptr + size) // HUGE_PAGE * HUGE_PAGE
    ok = False
    if sys.platform.startswith("linux") and end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0
    out.copy_(t)
    return out, ok


def anon_huge_mib():
    """This process's anonymous memory in transparent huge pages, MiB (None off Linux)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def with_huge_pages(c):
    k, ok_k = huge_page_copy(c["k"])
    v, ok_v = huge_page_copy(c["v"])
    return dict(c, k=k, v=v, pages="2 MiB (THP)" if ok_k and ok_v else "madvise refused")


def run_case(c, args):
    q, k, v, ix = c["q"], c["k"], c["v"], c["indices"]
    cands = {
        "dense": lambda: pagedkv.flash_attn_paged(q, c["offsets"], k, v, c["lengths"], c["table"]),
        "sparse": lambda: pagedkv.flash_attn_paged_sparse(q, k, v, ix),
    }
    expected = ref.flash_attn_paged_sparse(q[:1].double(), k, v, ix[:1])
    got = cands["sparse"]()[:1].double()
    err = ((got - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1)).max().item()
    assert err < 2e-2, f"sparse: relative error {err:.3e} against the reference"
    samples = common.time_interleaved(cands, args.reps, args.warmup)
    dense, sparse = common.median(samples["dense"]), common.median(samples["sparse"])
    row = dict(case=f"B={c['B']} L={c['L']} K={c['K']}", pages=c.get("pages", "4 KiB"), dense_ms=dense * 1e3, sparse_ms=sparse * 1e3,
               speedup=dense / sparse, ideal=c["L"] / c["K"], sparse_rel_err=err, samples=samples)
    print(f"{row['case']} ({row['pages']} pages): dense {row['dense_ms']:.2f} ms, sparse {row['sparse_ms']:.2f} ms, "
          f"{row['speedup']:.1f}x (L/K = {row['ideal']:.0f})")
    return row


def main():
    p = common.base_parser(__doc__)
    args = p.parse_args()
    gen, env, ceiling = common.start(args)
    cases = [make_case(1, 65536, 2048, gen)]
    if not args.quick:
        cases += [make_case(4, 65536, 2048, gen), make_case(1, 65536, 512, gen)]
    rows = []
    for c in cases:
        rows.append(run_case(c, args))
        huge = with_huge_pages(c)
        # while both pools are alive: the huge-page copy should account for about its K + V bytes
        env["anon_huge_pages_MiB"] = anon_huge_mib()
        rows.append(run_case(huge, args))
    ceiling = common.finish_ceiling(ceiling, args)
    cols = ["case", "pages", "dense_ms", "sparse_ms", "speedup", "ideal", "sparse_rel_err"]
    print()
    common.print_table(rows, cols)
    if args.no_write:
        return
    stem = args.out or common.result_stem("sparse", args.quick, args.cold)
    common.write_results(stem, "pagedkv CPU sparse top-k decode", common.method(__doc__), env, ceiling, rows, cols)


if __name__ == "__main__":
    main()
