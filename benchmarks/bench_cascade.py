"""Shared-prefix decode on the CPU: pagedkv.cascade_attention against plain flash_attn_paged.

Workload (issue 20): B requests decode one token each; they share a prefix of S tokens (one copy of
its pages, mapped into every row of the lookup table, as the page manager's prefix sharing stores a
common system prompt) and each has U tokens of its own. Hq/Hk 32/8, D 128, page 16, bf16 cache.
Candidates, in one process on the same cache (see common.py for the timing method):
- flash_attn_paged : every request attends its S + U keys (the prefix pages are read B times)
- cascade          : pagedkv.cascade_attention (the prefix once for all B queries, then each
                     request's own U keys, merged by their log-sum-exps)
Both outputs are compared with pagedkv.reference (float64) before timing.

  python benchmarks/bench_cascade.py --quick     # B=32, S=4096, U=256 only
  python benchmarks/bench_cascade.py             # + B=8/S=4096 and B=32/S=1024, + an FP8 e4m3 row
"""

from __future__ import annotations

import common
import torch
from common import pagedkv

from pagedkv import reference as ref

Hq, Hk, D, P = 32, 8, 128, 16


def make_case(B, S, U, gen, fp8=False):
    shared, own = S // P, (U + P - 1) // P
    num_pages = shared + B * own
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.empty((B, shared + own), dtype=torch.int32)
    table[:, :shared] = perm[:shared]
    table[:, shared:] = perm[shared:].view(B, own)
    k = torch.randn(num_pages, P, Hk, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_pages, P, Hk, D, generator=gen).to(torch.bfloat16)
    scales = dict(k_scales=None, v_scales=None)
    if fp8:
        k, scales["k_scales"] = common.quantize_fp8(k)
        v, scales["v_scales"] = common.quantize_fp8(v)
    q = torch.randn(B, Hq, D, generator=gen).to(torch.bfloat16)
    offsets = torch.arange(B + 1, dtype=torch.int32)
    lengths = torch.full((B,), S + U - 1, dtype=torch.int32)  # the new token is already stored
    return dict(B=B, S=S, U=U, fp8=fp8, q=q, k=k, v=v, table=table, offsets=offsets, lengths=lengths,
                shared=shared, **scales)


def run_case(c, args):
    q, k, v, table, offsets, lengths = c["q"], c["k"], c["v"], c["table"], c["offsets"], c["lengths"]
    sc = dict(k_scales=c["k_scales"], v_scales=c["v_scales"])
    cands = {
        "flash_attn_paged": lambda: pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table, **sc),
        "cascade": lambda: pagedkv.cascade_attention(q, offsets, k, v, lengths, table, c["shared"], **sc),
    }
    expected = ref.flash_attn_paged(q.double(), offsets, k, v, lengths, table, **sc, compute_dtype=torch.float64)
    errors = {}
    for name, fn in cands.items():
        out = fn().double()
        errors[name] = ((out - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1)).max().item()
        assert errors[name] < 2e-2, f"{name}: relative error {errors[name]:.3e} against the reference"
    samples = common.time_interleaved(cands, args.reps, args.warmup)
    plain, cascade = common.median(samples["flash_attn_paged"]), common.median(samples["cascade"])
    elem = 1 if c["fp8"] else 2
    plain_bytes = c["B"] * (c["S"] + c["U"]) * Hk * D * 2 * elem
    cascade_bytes = (c["S"] + c["B"] * c["U"]) * Hk * D * 2 * elem
    row = dict(case=f"B={c['B']} S={c['S']} U={c['U']} {'fp8' if c['fp8'] else 'bf16'}", plain_ms=plain * 1e3,
               cascade_ms=cascade * 1e3, speedup=plain / cascade, kv_read_ratio=plain_bytes / cascade_bytes,
               plain_rel_err=errors["flash_attn_paged"], cascade_rel_err=errors["cascade"], samples=samples)
    print(f"{row['case']}: flash_attn_paged {row['plain_ms']:.2f} ms, cascade {row['cascade_ms']:.2f} ms, "
          f"{row['speedup']:.2f}x (KV bytes read {row['kv_read_ratio']:.1f}x fewer)")
    return row


def main():
    p = common.base_parser(__doc__)
    args = p.parse_args()
    gen, env, ceiling = common.start(args)
    rows = [run_case(make_case(32, 4096, 256, gen), args)]
    if not args.quick:
        rows.append(run_case(make_case(32, 4096, 256, gen, fp8=True), args))
        rows.append(run_case(make_case(8, 4096, 256, gen), args))
        rows.append(run_case(make_case(32, 1024, 256, gen), args))
    ceiling = common.finish_ceiling(ceiling, args)
    cols = ["case", "plain_ms", "cascade_ms", "speedup", "kv_read_ratio", "plain_rel_err", "cascade_rel_err"]
    print()
    common.print_table(rows, cols)
    targets = [dict(target="cascade >= 4x flash_attn_paged (B=32 S=4096 U=256 bf16)", measured=rows[0]["speedup"],
                    met=rows[0]["speedup"] >= 4)]
    common.print_targets(targets)
    if args.no_write:
        return
    stem = args.out or common.result_stem("cascade", args.quick, args.cold)
    common.write_results(stem, "pagedkv CPU shared-prefix decode (cascade)", common.method(__doc__), env, ceiling,
                         rows, cols, targets)


if __name__ == "__main__":
    main()
