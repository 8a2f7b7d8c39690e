"""paged_load on the CPU (gather pages into contiguous rows) against torch index_select.

Candidates, all in one process (see common.py for the timing method); 8 KV heads, D=128, B
sequences of T/B tokens, random page table (plus an identity-table point):
- pagedkv            : torch.ops.pagedkv.paged_load(cache, scales, table, seq_lens, offsets, out) into a
                       preallocated out (bf16 -> bf16 copy; fp8 -> bf16 dequantized)
- torch index_select : cache.index_select(0, table.flatten(), out=buf) then the [T, Hk, D] view
                       (bf16), or for FP8 the same gather then .float() * scales -> bf16
Bytes for GB/s: cache read (+ scales) + out written.

  python benchmarks/bench_load.py --quick    # 32k tokens, page 16, bf16 and fp8
  python benchmarks/bench_load.py            # 32k and 128k tokens, page 16 and 128, identity table
"""

from __future__ import annotations

import common
import torch


def run_case(T, P, dtype, gen, args, identity=False, B=8, Hk=8, D=128):
    per = T // B
    pages_per_seq = (per + P - 1) // P
    num_pages = B * pages_per_seq
    table = common.random_table(B, pages_per_seq, num_pages, gen, identity)
    fp8 = dtype in common.FP8_DTYPES
    src = torch.randn(num_pages, P, Hk, D, generator=gen)
    if fp8:
        cache, scales = common.quantize_fp8(src, dtype)
    else:
        cache, scales = common.cache_tensor(src.to(dtype)), None
    seq_lens = torch.full((B,), per, dtype=torch.int32)
    offsets = torch.arange(0, T + 1, per, dtype=torch.int32)
    out = torch.empty(T, Hk, D, dtype=torch.bfloat16)
    flat = table.reshape(-1).long()
    gathered = torch.empty(flat.numel(), P, Hk, D, dtype=dtype)

    def paged():
        torch.ops.pagedkv.paged_load(cache, scales, table, seq_lens, offsets, out, 128)

    if fp8:
        gathered_s = torch.empty(flat.numel(), P, Hk, 1)

        def torch_gather():
            torch.index_select(cache, 0, flat, out=gathered)
            torch.index_select(scales, 0, flat, out=gathered_s)
            return (gathered.float() * gathered_s).to(torch.bfloat16).view(-1, Hk, D)
    else:
        def torch_gather():
            torch.index_select(cache, 0, flat, out=gathered)
            return gathered.view(-1, Hk, D)

    paged()
    same = torch.equal(out.view(torch.int16), torch_gather().reshape(B, -1, Hk, D)[:, :per].reshape(-1, Hk, D)
                       .view(torch.int16))
    s = common.time_interleaved({"pagedkv": paged, "torch_index_select": torch_gather}, args.reps, args.warmup)
    t = {n: common.median(x) for n, x in s.items()}
    nbytes = T * Hk * D * (cache.element_size() + 2) + (T * Hk * 4 if fp8 else 0)
    name = str(dtype).replace("torch.", "")
    return dict(case=f"load {T // 1024}k tokens {name} P={P}" + (" identity" if identity else ""), tokens=T, P=P,
                dtype=name, identity=identity, pagedkv_ms=t["pagedkv"] * 1e3,
                torch_index_select_ms=t["torch_index_select"] * 1e3, pagedkv_gbps=nbytes / t["pagedkv"] / 1e9,
                vs_torch=t["torch_index_select"] / t["pagedkv"], bytes_equal_to_torch=same, samples=s)


def main():
    args = common.base_parser(__doc__).parse_args()
    gen, env, ceiling = common.start(args)
    print(f"copy ceiling {ceiling['gbps']:.2f} GB/s, threads {torch.get_num_threads()}, ISA {env['pagedkv_cpu_isa']}")
    rows = [run_case(32 * 1024, 16, dt, gen, args) for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    if not args.quick:
        rows.append(run_case(32 * 1024, 16, torch.bfloat16, gen, args, identity=True))
        rows.append(run_case(32 * 1024, 128, torch.bfloat16, gen, args))
        rows.append(run_case(128 * 1024, 16, torch.bfloat16, gen, args))
    ceiling = common.finish_ceiling(ceiling, args)
    for r in rows:
        r["pct_copy"] = 100 * r["pagedkv_gbps"] / ceiling["gbps"]
    cols = ["case", "pagedkv_ms", "torch_index_select_ms", "pagedkv_gbps", "pct_copy", "vs_torch", "bytes_equal_to_torch"]
    print(f"\ncopy ceiling {ceiling['gbps']:.2f} GB/s")
    common.print_table(rows, cols)
    targets = [dict(target="load bf16 at 32k tokens >= 70% of copy bandwidth", measured=rows[0]["pct_copy"],
                    met=rows[0]["pct_copy"] >= 70)]
    common.print_targets(targets)
    if args.no_write:
        return

    common.write_results(args.out or common.result_stem("load", args.quick, args.cold), "pagedkv CPU paged_load",
                         common.method(__doc__), env, ceiling, rows, cols, targets,
                         common.bandwidth_plot(rows, ceiling, env, "paged_load"))


if __name__ == "__main__":
    main()
