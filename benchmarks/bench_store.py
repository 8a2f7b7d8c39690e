"""paged_store on the CPU (prefill append of many tokens) against torch scatter.

Candidates, all in one process (see common.py for the timing method); 8 KV heads, D=128, page 16,
B sequences of T/B new tokens each written after a prefix, random page table:
- pagedkv          : pagedkv.paged_store(key, value, k_cache, v_cache, offsets, lengths, table[, scales])
- torch index_copy_: the same slots computed once (page * P + slot), k_cache.view(N*P, Hk, D).index_copy_
                     (bf16); for FP8 the unfused chain amax -> scale -> x / scale -> clamp -> .to(fp8),
                     then index_copy_ of codes and scales
- torch index_put_ : the same with advanced-index assignment (bf16 only)
Bytes for GB/s: key + value read (bf16) + cache written (+ scales written for FP8).

  python benchmarks/bench_store.py --quick   # 32k tokens, bf16 and fp8
  python benchmarks/bench_store.py           # 4k, 32k, 128k tokens
"""

from __future__ import annotations

import common
import torch
from common import pagedkv


def run_case(T, dtype, gen, args, B=8, Hk=8, D=128, P=16, prefix=64):
    per = T // B
    pages_per_seq = (prefix + per + P - 1) // P
    num_pages = B * pages_per_seq
    table = common.random_table(B, pages_per_seq, num_pages, gen)
    key = torch.randn(T, Hk, D, generator=gen).to(torch.bfloat16)
    value = torch.randn(T, Hk, D, generator=gen).to(torch.bfloat16)
    offsets = torch.arange(0, T + 1, per, dtype=torch.int32)
    lengths = torch.full((B,), prefix, dtype=torch.int32)
    kc = pagedkv.host_alloc.zeros((num_pages, P, Hk, D), dtype=dtype)  # as pagedkv's cache classes allocate
    vc = pagedkv.host_alloc.zeros((num_pages, P, Hk, D), dtype=dtype)
    fp8 = dtype in common.FP8_DTYPES
    ks = torch.zeros(num_pages, P, Hk, 1) if fp8 else None
    vs = torch.zeros_like(ks) if fp8 else None
    pos = prefix + torch.arange(per).repeat(B)
    b = torch.arange(B).repeat_interleave(per)
    slots = (table.long()[b, pos // P] * P + pos % P)

    def paged():
        pagedkv.paged_store(key, value, kc, vc, offsets, lengths, table, ks, vs)

    cands = {"pagedkv": paged}
    if fp8:
        fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0

        def torch_chain():
            for x, c, s in ((key, kc, ks), (value, vc, vs)):
                xf = x.float()
                amax = xf.abs().amax(-1, keepdim=True)
                sc = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
                codes = (xf / sc).clamp(-fmax, fmax).to(dtype)
                # index_copy_ has no float8 kernel on CPU: scatter the codes as bytes
                c.view(torch.uint8).view(-1, Hk, D).index_copy_(0, slots, codes.view(torch.uint8))
                s.view(-1, Hk, 1).index_copy_(0, slots, sc)

        cands["torch_index_copy"] = torch_chain
    else:
        def torch_copy():
            kc.view(-1, Hk, D).index_copy_(0, slots, key)
            vc.view(-1, Hk, D).index_copy_(0, slots, value)

        def torch_put():
            kc.view(-1, Hk, D)[slots] = key
            vc.view(-1, Hk, D)[slots] = value

        cands["torch_index_copy"] = torch_copy
        cands["torch_index_put"] = torch_put
    # exactness: pagedkv and the torch chain write the same bytes
    paged()
    mine = (kc.clone(), vc.clone(), ks.clone() if fp8 else None)
    cands["torch_index_copy"]()
    same = torch.equal(mine[0].view(torch.uint8), kc.view(torch.uint8)) and torch.equal(
        mine[1].view(torch.uint8), vc.view(torch.uint8))
    if fp8:
        same = same and torch.equal(mine[2], ks)
    s = common.time_interleaved(cands, args.reps, args.warmup)
    t = {n: common.median(x) for n, x in s.items()}
    esize = kc.element_size()
    nbytes = 2 * T * Hk * D * 2 + 2 * T * Hk * D * esize + (2 * T * Hk * 4 if fp8 else 0)
    row = dict(case=f"store {T // 1024}k tokens {str(dtype).replace('torch.', '')}", tokens=T,
               dtype=str(dtype).replace("torch.", ""), pagedkv_ms=t["pagedkv"] * 1e3,
               torch_index_copy_ms=t["torch_index_copy"] * 1e3, pagedkv_gbps=nbytes / t["pagedkv"] / 1e9,
               vs_torch=t["torch_index_copy"] / t["pagedkv"], bytes_equal_to_torch=same, samples=s)
    if "torch_index_put" in t:
        row["torch_index_put_ms"] = t["torch_index_put"] * 1e3
    return row


def main():
    args = common.base_parser(__doc__).parse_args()
    gen, env, ceiling = common.start(args)
    print(f"copy ceiling {ceiling['gbps']:.2f} GB/s, threads {torch.get_num_threads()}, ISA {env['pagedkv_cpu_isa']}")
    sizes = [32 * 1024] if args.quick else [4 * 1024, 32 * 1024, 128 * 1024]
    rows = [run_case(T, dt, gen, args) for T in sizes for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    ceiling = common.finish_ceiling(ceiling, args)
    for r in rows:
        r["pct_copy"] = 100 * r["pagedkv_gbps"] / ceiling["gbps"]
    cols = ["case", "pagedkv_ms", "torch_index_copy_ms", "torch_index_put_ms", "pagedkv_gbps", "pct_copy", "vs_torch",
            "bytes_equal_to_torch"]
    print(f"\ncopy ceiling {ceiling['gbps']:.2f} GB/s")
    common.print_table(rows, cols)
    main_row = next(r for r in rows if r["tokens"] == 32 * 1024 and r["dtype"] == "bfloat16")
    targets = [dict(target="store bf16 at 32k tokens >= 70% of copy bandwidth", measured=main_row["pct_copy"],
                    met=main_row["pct_copy"] >= 70)]
    common.print_targets(targets)
    if args.no_write:
        return

    common.write_results(args.out or common.result_stem("store", args.quick, args.cold), "pagedkv CPU paged_store",
                         common.method(__doc__), env, ceiling, rows, cols, targets,
                         common.bandwidth_plot(rows, ceiling, env, "paged_store"))


if __name__ == "__main__":
    main()
