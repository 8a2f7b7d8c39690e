"""Causal prefill attention on the CPU: pagedkv.flash_attn_paged against SDPA.

Candidates, all in one process on the same values (see common.py for the timing method):
- pagedkv        : flash_attn_paged, q [L, Hq, D] bf16, K/V already stored in a bf16 paged cache
                   (random page table), cache_lengths = 0, causal
- sdpa contiguous: torch SDPA, is_causal=True, on contiguous [1, Hk, L, D] K/V with the same values,
                   backend pinned to FLASH_ATTENTION with enable_gqa=True; the aten kernel is recorded
- gather + sdpa  : index_select of the pages, reshape, then the same SDPA
FLOPs: 4 * Hq * D * (visible keys summed over queries) = 4 * Hq * D * L (L + 1) / 2.

  python benchmarks/bench_prefill.py --quick   # CPU row: L=2048, 32/8, D=128, bf16, page 16
  python benchmarks/bench_prefill.py           # also L=1024 and MHA 32/32
"""

from __future__ import annotations

import common
import torch
from common import pagedkv
from torch.nn.attention import SDPBackend, sdpa_kernel

F = torch.nn.functional


def run_case(L, Hq, Hk, D, P, gen, args):
    pages = (L + P - 1) // P
    table = common.random_table(1, pages, pages, gen)
    k = common.cache_tensor(torch.randn(pages, P, Hk, D, generator=gen).to(torch.bfloat16))
    v = common.cache_tensor(torch.randn(pages, P, Hk, D, generator=gen).to(torch.bfloat16))
    q = torch.randn(L, Hq, D, generator=gen).to(torch.bfloat16)
    offsets = torch.tensor([0, L], dtype=torch.int32)
    lengths = torch.zeros(1, dtype=torch.int32)
    flat = table.reshape(-1).long()
    kc = k.index_select(0, flat).view(1, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()
    vc = v.index_select(0, flat).view(1, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()
    q4 = q.view(1, L, Hq, D).transpose(1, 2)

    def paged():
        return pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table)

    def sdpa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, kc, vc, is_causal=True, enable_gqa=True)

    def gather_sdpa():
        kg = k.index_select(0, flat).view(1, -1, Hk, D)[:, :L].transpose(1, 2)
        vg = v.index_select(0, flat).view(1, -1, Hk, D)[:, :L].transpose(1, 2)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, kg, vg, is_causal=True, enable_gqa=True)

    err = (paged().float() - sdpa()[0].transpose(0, 1).float()).abs().max().item()
    assert err < 5e-2, f"pagedkv and SDPA disagree by {err}"
    backend = common.sdpa_backend_name(sdpa)
    s = common.time_interleaved({"pagedkv": paged, "sdpa": sdpa, "gather_sdpa": gather_sdpa}, args.reps, args.warmup)
    t = {n: common.median(x) for n, x in s.items()}
    flops = 4 * Hq * D * L * (L + 1) / 2
    return dict(case=f"L={L} {Hq}/{Hk} D={D} P={P} causal", L=L, Hq=Hq, Hk=Hk, D=D, P=P, pagedkv_ms=t["pagedkv"] * 1e3,
                sdpa_ms=t["sdpa"] * 1e3, gather_sdpa_ms=t["gather_sdpa"] * 1e3,
                pagedkv_gflops=flops / t["pagedkv"] / 1e9, sdpa_gflops=flops / t["sdpa"] / 1e9,
                vs_sdpa=t["sdpa"] / t["pagedkv"], vs_gather_sdpa=t["gather_sdpa"] / t["pagedkv"], sdpa_backend=backend,
                max_abs_diff_vs_sdpa=err, samples=s)


def main():
    args = common.base_parser(__doc__).parse_args()
    gen, env, ceiling = common.start(args)
    print(f"copy ceiling {ceiling['gbps']:.2f} GB/s, threads {torch.get_num_threads()}, ISA {env['pagedkv_cpu_isa']}")
    rows = [run_case(2048, 32, 8, 128, 16, gen, args)]
    if not args.quick:
        rows.append(run_case(1024, 32, 8, 128, 16, gen, args))
        rows.append(run_case(1024, 32, 32, 128, 16, gen, args))
    ceiling = common.finish_ceiling(ceiling, args)
    cols = ["case", "pagedkv_ms", "sdpa_ms", "gather_sdpa_ms", "pagedkv_gflops", "sdpa_gflops", "vs_sdpa",
            "vs_gather_sdpa"]
    print()
    common.print_table(rows, cols)
    print(f"SDPA backend: {rows[0]['sdpa_backend']}")
    targets = [dict(target="causal prefill >= 1.0x SDPA (contiguous K/V)", measured=rows[0]["vs_sdpa"],
                    met=rows[0]["vs_sdpa"] >= 1.0)]
    common.print_targets(targets)
    if args.no_write:
        return

    def plot(path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        x = range(len(rows))
        w = 0.27
        ax.bar([i - w for i in x], [r["pagedkv_gflops"] for r in rows], w, label="pagedkv (paged)")
        ax.bar(list(x), [r["sdpa_gflops"] for r in rows], w, label="SDPA contiguous")
        ax.bar([i + w for i in x], [4 * r["Hq"] * r["D"] * r["L"] * (r["L"] + 1) / 2 / r["gather_sdpa_ms"] / 1e6
                                    for r in rows], w, label="gather + SDPA")
        ax.set_xticks(list(x), [r["case"] for r in rows], fontsize=8)
        ax.set_ylabel("GFLOP/s")
        ax.legend(fontsize=8)
        ax.set_title(f"causal prefill, {env['device']}, {env['threads']} threads", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    common.write_results(args.out or common.result_stem("prefill", args.quick, args.cold), "pagedkv CPU causal prefill",
                         common.method(__doc__), env, ceiling, rows, cols, targets, plot)


if __name__ == "__main__":
    main()
