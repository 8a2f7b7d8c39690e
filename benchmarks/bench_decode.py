"""Decode attention (one new token per sequence) on the CPU: pagedkv.flash_attn_paged against peers.

Candidates, all in one process on the same values (see common.py for the timing method):
- pagedkv bf16   : flash_attn_paged on a bf16 paged cache (random page table unless --identity)
- pagedkv fp8    : the same keys/values quantized to float8_e4m3fn, one scale per (token, head)
- sdpa contiguous: torch SDPA on contiguous [B, Hk, L, D] K/V holding the same bf16 values,
                   backend pinned to FLASH_ATTENTION (enable_gqa=True); the aten kernel that ran is recorded
- gather + sdpa  : index_select of the pages of k_cache/v_cache, reshape, then the same SDPA
                   (what a user writes without pagedkv)
Bytes for GB/s: all K and V read once (+ FP8 scales, q and out). The KV of the CPU row is 64 MiB
(bf16), above this machine's L2, so the row measures memory streaming, not L2 hits.

Rows: the CPU grid row of BENCHMARKS.md (B=4, L=4096, Hq/Hk 32/8, D=128, page 16) and, with
--pages (default in full mode), a page-size sweep {1, 8, 16, 32, 64, 128} at the same shape plus an
identity-table point. Ratios: speedup over gather+SDPA and over SDPA, percent of the copy ceiling,
fp8 speedup over bf16, time at page P relative to page 16.

  python benchmarks/bench_decode.py --quick        # CPU row only (< 1 min)
  python benchmarks/bench_decode.py                # CPU row + page sweep + more batch sizes
  python benchmarks/bench_decode.py --issue26      # issue 26 shapes against the native read ceiling

--issue26 (results stem decode_issue26_cpu): Hq/Hk 32/8, D 128, page 16, random page order, B x L in
{4, 16} x {4096, 16384} plus B=1 L=4096 and B=16 L=512. Candidates per shape, interleaved round by
round: pagedkv bf16, FP8 e4m3 and e5m2 (one scale per (token, head): group 128 = D; --quant-group G: a
scale per G channels, results stem + _gG), and the native
read ceiling (benchmarks/probes/read_ceiling.c through ctypes: vector loads summed over a buffer of the
same byte size as the K/V, bf16 and FP8 + scales, on torch's own OpenMP threads). % of ceiling = decode
GB/s over that ceiling's GB/s. ggml's ggml_flash_attn_ext (f16 and q8_0 K/V, same threads, values of
the same distribution: standard normal) runs as a subprocess right after each shape's rounds when
benchmarks/ggml/build.sh has built it (else the ggml columns stay empty, with a message).
--baseline-path packed|fma (--packed: packed) adds another decode path of the same build for bf16 and
e4m3 (kernel option cpu_decode="packed": the packed tiles; "fma": the float32 direct decode where the default takes
the AVX512_BF16 dot products): before/after ratios.
--head-major: the same values in head-major pages (storage [N, Hk, P, D], as vLLM's CPU cache; the
ops get its [N, P, Hk, D] view), results stem decode_issue26_cpu_head_major.
Arithmetic bounds (--issue26): before the first shape and after each shape's rounds, bf16, e4m3 and
e5m2 decode a cache-resident case (B=2 L=1024: 8.4 MB of bf16 K/V, in this machine's L3) and the same
call with one page per row (B=2 L=16: its fixed cost, taken off), interleaved for 101 rounds; the
fastest time of each, per dtype in ns per key and KV head per thread (warm_<dtype>_ns), is what that
decode's arithmetic costs per key when no byte waits for DRAM, at the machine's best in those rounds.
The fastest of the run bounds every row: bf16_arith_pct, the % of the row's read ceiling that bf16
decode would read if its reading hid wholly under its arithmetic (no decode of this build beats it);
e4m3_arith_vs_bf16, the row's bf16 time over e4m3 at its warm speed (the most e4m3 / bf16 the row
could show, FP8 being bound by its arithmetic); both_max_ceiling_gbps, the highest read ceiling at
which bf16 at 85% of it and e4m3 at its warm speed still give 1.6x (issue 26's two DRAM targets at
once need a ceiling at or below it: 512 bf16 bytes per key and KV head, times the threads, over
0.85 x 1.6 x e4m3's warm time).
"""

from __future__ import annotations

import json
import os
import subprocess

import common
import torch
from common import pagedkv
from torch.nn.attention import SDPBackend, sdpa_kernel

F = torch.nn.functional


def make_case(B, L, Hq, Hk, D, P, gen, identity=False):
    pages_per_seq = (L + P - 1) // P
    num_pages = B * pages_per_seq
    table = common.random_table(B, pages_per_seq, num_pages, gen, identity)
    k = common.cache_tensor(torch.randn(num_pages, P, Hk, D, generator=gen).to(torch.bfloat16))
    v = common.cache_tensor(torch.randn(num_pages, P, Hk, D, generator=gen).to(torch.bfloat16))
    q = torch.randn(B, Hq, D, generator=gen).to(torch.bfloat16)
    offsets = torch.arange(B + 1, dtype=torch.int32)
    cache_lengths = torch.full((B,), L - 1, dtype=torch.int32)  # the new token is already stored
    return dict(B=B, L=L, Hq=Hq, Hk=Hk, D=D, P=P, table=table, k=k, v=v, q=q, offsets=offsets, lengths=cache_lengths)


def run_case(c, args, with_peers=True, with_fp8=True, label=""):
    B, L, Hq, Hk, D, P = (c[x] for x in ("B", "L", "Hq", "Hk", "D", "P"))
    q, k, v, table, offsets, lengths = c["q"], c["k"], c["v"], c["table"], c["offsets"], c["lengths"]
    cands = {"pagedkv_bf16": lambda: pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table)}
    out_bf16 = cands["pagedkv_bf16"]()
    if with_fp8:
        k8, ks = common.quantize_fp8(k)
        v8, vs = common.quantize_fp8(v)
        cands["pagedkv_fp8"] = lambda: pagedkv.flash_attn_paged(q, offsets, k8, v8, lengths, table, k_scales=ks,
                                                                v_scales=vs)
    backend = ""
    if with_peers:
        flat = table.reshape(-1).long()
        kc = k.index_select(0, flat).view(B, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()
        vc = v.index_select(0, flat).view(B, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()
        q4 = q.view(B, Hq, 1, D)

        def sdpa():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)

        def gather_sdpa():
            kg = k.index_select(0, flat).view(B, -1, Hk, D)[:, :L].transpose(1, 2)
            vg = v.index_select(0, flat).view(B, -1, Hk, D)[:, :L].transpose(1, 2)
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q4, kg, vg, enable_gqa=True)

        cands["sdpa_contiguous"] = sdpa
        cands["gather_sdpa"] = gather_sdpa
        ref = sdpa().view(B, Hq, D).float()
        err = (out_bf16.float() - ref).abs().max().item()
        assert err < 3e-2, f"pagedkv and SDPA disagree by {err}"
        backend = common.sdpa_backend_name(sdpa)
    s = common.time_interleaved(cands, args.reps, args.warmup)
    t = {n: common.median(x) for n, x in s.items()}
    kv_bytes = 2 * B * L * Hk * D * 2
    io_bytes = 2 * B * Hq * D * 2
    llc = common.last_level_cache_bytes()
    row = dict(case=label or f"B={B} L={L} {Hq}/{Hk} D={D} P={P}", B=B, L=L, P=P, Hq=Hq, Hk=Hk, D=D,
               kv_MiB=kv_bytes / 2**20, kv_fits_llc=llc is not None and kv_bytes <= llc,
               bf16_ms=t["pagedkv_bf16"] * 1e3, bf16_gbps=(kv_bytes + io_bytes) / t["pagedkv_bf16"] / 1e9,
               samples={n: x for n, x in s.items()})
    if with_fp8:
        fp8_bytes = kv_bytes // 2 + 2 * B * L * Hk * 4 + io_bytes
        row.update(fp8_ms=t["pagedkv_fp8"] * 1e3, fp8_gbps=fp8_bytes / t["pagedkv_fp8"] / 1e9,
                   fp8_speedup=t["pagedkv_bf16"] / t["pagedkv_fp8"])
    if with_peers:
        row.update(sdpa_ms=t["sdpa_contiguous"] * 1e3, gather_sdpa_ms=t["gather_sdpa"] * 1e3,
                   vs_gather_sdpa=t["gather_sdpa"] / t["pagedkv_bf16"], vs_sdpa=t["sdpa_contiguous"] / t["pagedkv_bf16"],
                   sdpa_backend=backend)
    return row


# ---------------------------------------------------------------- --issue26

ISSUE26_SHAPES = ((4, 4096), (16, 4096), (4, 16384), (16, 16384), (1, 4096), (16, 512))  # (B, L)
ISSUE26_DRAM_BYTES = 256 * 10**6  # the issue's "cache in DRAM" threshold (K/V >= 256 MB)
GGML_HARNESS = os.path.join(common.ROOT, ".deps", "ggml", "flash_attn_harness")
ISSUE26_CEILING_LINE = ("- read ceiling: per row (ceiling_gbps: bf16 K/V bytes; FP8 rows divide by the ceiling of the FP8 "
                        "+ scale bytes), vector loads summed, same threads, interleaved with the decode rounds")


def quantize_pages(x, dtype, group=128, chunk=4096):
    """common.quantize_fp8 over chunks of pages (the float32 temporaries of a 1 GB cache would not fit beside
    the other candidates)."""
    parts = [common.quantize_fp8(x[i:i + chunk], dtype, group) for i in range(0, x.shape[0], chunk)]
    return common.cache_tensor(torch.cat([q for q, _ in parts])), torch.cat([sc for _, sc in parts])


def ggml_times(B, L, Hq, Hk, D, threads, reps):
    """{"f16": ms, "q8_0": ms} medians from the ggml harness, or None when it is not built or fails."""
    if not os.path.exists(GGML_HARNESS):
        return None
    cmd = [GGML_HARNESS, str(B), str(L), str(Hq), str(Hk), str(D), str(threads), str(reps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"ggml harness failed ({' '.join(cmd)}): {done.stderr.strip()[-400:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def with_decode_path(path, fn):
    """fn run with the kernel option cpu_decode=path ("auto": the default choice), read once per call."""

    def run():
        pagedkv.set_kernel_options(cpu_decode=path)
        return fn()

    return run


def head_major(x):
    """x [N, P, Hk, D] as a view of head-major storage [N, Hk, P, D] holding the same values."""
    return common.cache_tensor(x.permute(0, 2, 1, 3).contiguous()).permute(0, 2, 1, 3)


def issue26_case(B, L, gen, lib, args):
    Hq, Hk, D, P = 32, 8, 128, 16
    threads = torch.get_num_threads()
    c = make_case(B, L, Hq, Hk, D, P, gen)
    q, k, v, table, offsets, lengths = c["q"], c["k"], c["v"], c["table"], c["offsets"], c["lengths"]
    pages = head_major if args.head_major else (lambda x: x)
    k, v = pages(k), pages(v)
    cands = {"bf16": lambda: pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table)}
    out = cands["bf16"]()
    kv_bytes = k.numel() * 2 + v.numel() * 2
    fp8_bytes = 0
    G = args.quant_group
    for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        (k8, ks), (v8, vs) = (map(pages, quantize_pages(x, dt, G)) for x in (k, v))
        fp8_bytes = k8.numel() + v8.numel() + 4 * (ks.numel() + vs.numel())
        cands[name] = (lambda k8, ks, v8, vs: lambda: pagedkv.flash_attn_paged(
            q, offsets, k8, v8, lengths, table, k_scales=ks, v_scales=vs, quant_group=G))(k8, ks, v8, vs)
        err = (cands[name]().float() - out.float()).abs().max().item()
        assert err < 0.25, f"{name} decode differs from bf16 by {err}"  # a sanity check, not a test
    base = args.baseline_path
    if base:  # another decode path of the same build (cpu_decode="packed"|"fma"), for before/after ratios
        for name in ("bf16", "e4m3"):
            cands[f"{name}_{base}"] = with_decode_path(base, cands[name])
        for name in ("bf16", "e4m3", "e5m2"):
            cands[name] = with_decode_path("auto", cands[name])
    cands["ceiling_bf16"] = common.read_ceiling_call(lib, kv_bytes, threads)
    cands["ceiling_fp8"] = common.read_ceiling_call(lib, fp8_bytes, threads)
    s = common.time_interleaved(cands, args.reps, args.warmup)
    t = {n: common.median(x) for n, x in s.items()}
    warm = warm_rates(args)  # after each shape's rounds: the run's fastest of them bounds every row
    ggml = ggml_times(B, L, Hq, Hk, D, threads, args.reps)
    llc = common.last_level_cache_bytes()
    ceil_bf16, ceil_fp8 = kv_bytes / t["ceiling_bf16"] / 1e9, fp8_bytes / t["ceiling_fp8"] / 1e9
    row = dict(case=f"B={B} L={L}", B=B, L=L, kv_MB=kv_bytes / 1e6, llc_MiB=llc / 2**20 if llc else None,
               in_dram=kv_bytes >= ISSUE26_DRAM_BYTES and not (llc and kv_bytes <= llc),
               bf16_ms=t["bf16"] * 1e3, bf16_gbps=kv_bytes / t["bf16"] / 1e9, ceiling_gbps=ceil_bf16,
               bf16_pct=100 * kv_bytes / t["bf16"] / 1e9 / ceil_bf16, fp8_ceiling_gbps=ceil_fp8)
    for name in ("e4m3", "e5m2"):
        row[f"{name}_ms"] = t[name] * 1e3
        row[f"{name}_pct"] = 100 * fp8_bytes / t[name] / 1e9 / ceil_fp8
        row[f"{name}_vs_bf16"] = t["bf16"] / t[name]
    if base:
        for name in ("bf16", "e4m3"):
            row[f"{name}_{base}_ms"] = t[f"{name}_{base}"] * 1e3
            row[f"{name}_vs_{base}"] = t[f"{name}_{base}"] / t[name]
    if ggml:
        row.update(ggml=ggml, ggml_f16_ms=ggml["f16"], ggml_q8_0_ms=ggml["q8_0"], bf16_vs_ggml_f16=ggml["f16"] / (t["bf16"] * 1e3),
                   e4m3_vs_ggml_q8_0=ggml["q8_0"] / (t["e4m3"] * 1e3))
    row.update({f"warm_{n}_ns": x * 1e9 for n, x in warm.items()})
    row["samples"] = s
    return row


WARM_CASE = (2, 1024)  # (B, L): 8.4 MB of bf16 K/V, 4.2 MB per FP8 dtype
CALL_CASE = (2, 16)  # the same call with one page per row: its fixed cost, taken off WARM_CASE's time
WARM_ROUNDS = 101  # ~0.3 s of calls


def decode_calls(B, L, args):
    """{dtype: a decode call on the default path} for bf16, e4m3 and e5m2 caches of one case (the rows'
    page layout)."""
    c = make_case(B, L, 32, 8, 128, 16, torch.Generator().manual_seed(args.seed + 1))
    q, k, v, table, offsets, lengths = c["q"], c["k"], c["v"], c["table"], c["offsets"], c["lengths"]
    if args.head_major:
        k, v = head_major(k), head_major(v)
    calls = {"bf16": lambda: pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table)}
    for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        (k8, ks), (v8, vs) = (quantize_pages(x, dt, args.quant_group) for x in (k, v))
        calls[name] = (lambda k8, ks, v8, vs: lambda: pagedkv.flash_attn_paged(
            q, offsets, k8, v8, lengths, table, k_scales=ks, v_scales=vs, quant_group=args.quant_group))(k8, ks, v8, vs)
    # the default path even where the shape's rounds ended on a --baseline-path call (which sets the switch)
    return {name: with_decode_path("auto", call) for name, call in calls.items()}


def warm_rates(args):
    """{dtype: seconds per key and KV head per thread} of a cache-resident decode: WARM_CASE's fastest
    time less CALL_CASE's (the call's fixed cost) over the key-heads between them, the six calls
    interleaved for WARM_ROUNDS rounds. What each decode's arithmetic costs per key when its bytes come
    from the caches, at the machine's best in those rounds: on the 2-core Zen 4 EPYC the medians of
    such rounds moved 22 -> 39 ns from one second to the next (a shared machine), the
    fastest 21 -> 31."""
    cands = {}
    for case in (WARM_CASE, CALL_CASE):
        cands.update({(name, case): call for name, call in decode_calls(*case, args).items()})
    s = common.time_interleaved(cands, WARM_ROUNDS, WARM_ROUNDS // 10)
    t = {n: min(x) for n, x in s.items()}
    (B, L), (b, l) = WARM_CASE, CALL_CASE
    per_thread = (B * L - b * l) * 8 / torch.get_num_threads()
    return {name: (t[(name, WARM_CASE)] - t[(name, CALL_CASE)]) / per_thread for name in ("bf16", "e4m3", "e5m2")}


def add_arith_bounds(row, warm, threads):
    """The row's bounds from the run's fastest warm rates (module docstring, "Arithmetic bounds")."""
    per_thread = row["B"] * row["L"] * 8 / threads
    bf16_s, e4m3_s = warm["bf16"] * per_thread, warm["e4m3"] * per_thread
    kv = row["kv_MB"] * 1e6
    row["bf16_arith_pct"] = 100 * kv / bf16_s / 1e9 / row["ceiling_gbps"]
    row["e4m3_arith_vs_bf16"] = row["bf16_ms"] / 1e3 / e4m3_s
    row["both_max_ceiling_gbps"] = kv / (0.85 * 1.6 * e4m3_s) / 1e9


def issue26_main(args):
    lib = common.read_ceiling_library()
    if lib is None:
        raise SystemExit("--issue26 needs the native read ceiling (a C compiler: cc)")
    gen = torch.Generator().manual_seed(args.seed)
    env = common.environment()
    env["read_ceiling_loads"] = lib.pkv_read_ceiling_isa().decode()
    env["cache_pages"] = "head-major [N, Hk, P, D]" if args.head_major else "token-major [N, P, Hk, D]"
    env["fp8_quant_group"] = args.quant_group
    if not os.path.exists(GGML_HARNESS):
        print(f"ggml harness not built ({GGML_HARNESS}): run bash benchmarks/ggml/build.sh; ggml columns left empty")
    print(f"threads {torch.get_num_threads()}, pagedkv ISA {env['pagedkv_cpu_isa']}, read ceiling loads "
          f"{env['read_ceiling_loads']}, LLC {env['last_level_cache_MiB']} MiB, load average {env['load_average']}")
    shapes = ISSUE26_SHAPES[:1] + ISSUE26_SHAPES[-2:] if args.quick else ISSUE26_SHAPES
    warm_start = warm_rates(args)  # and after every shape (issue26_case): the run's fastest bounds every row
    rows = []
    for B, L in shapes:
        rows.append(issue26_case(B, L, gen, lib, args))
        common.print_table(rows[-1:], ["case", "kv_MB", "bf16_ms", "bf16_pct", "e4m3_vs_bf16", "e5m2_vs_bf16", "warm_bf16_ns",
                                       "warm_e4m3_ns"])
    threads = torch.get_num_threads()
    warm = {n: min([warm_start[n]] + [r[f"warm_{n}_ns"] * 1e-9 for r in rows]) for n in warm_start}
    env["warm_ns_per_kh_at_start"] = {n: x * 1e9 for n, x in warm_start.items()}
    env["warm_ns_per_kh_fastest"] = {n: x * 1e9 for n, x in warm.items()}
    for r in rows:
        add_arith_bounds(r, warm, threads)
    print("fastest warm arithmetic of the run, ns per key and KV head per thread: " +
          ", ".join(f"{n} {x * 1e9:.1f}" for n, x in warm.items()))
    cols = ["case", "kv_MB", "llc_MiB", "bf16_ms", "bf16_gbps", "ceiling_gbps", "bf16_pct", "e4m3_ms", "e4m3_pct",
            "e4m3_vs_bf16", "e5m2_ms", "e5m2_vs_bf16", "ggml_f16_ms", "ggml_q8_0_ms", "bf16_vs_ggml_f16",
            "e4m3_vs_ggml_q8_0", "warm_bf16_ns", "warm_e4m3_ns", "bf16_arith_pct", "e4m3_arith_vs_bf16",
            "both_max_ceiling_gbps"] + (
                [f"bf16_vs_{args.baseline_path}", f"e4m3_vs_{args.baseline_path}"] if args.baseline_path else [])
    print()
    common.print_table(rows, cols)
    env["load_average_after"] = list(os.getloadavg())
    targets = []
    big = [r for r in rows if r["B"] * r["L"] >= 4 * 4096]
    for r in big:
        need = 85 if r["in_dram"] else 65
        targets.append(dict(target=f"{r['case']}: bf16 >= {need}% of the read ceiling", measured=r["bf16_pct"],
                            met=r["bf16_pct"] >= need))
        if r["in_dram"]:
            for name in ("e4m3", "e5m2"):
                targets.append(dict(target=f"{r['case']}: {name} >= 1.6x bf16", measured=r[f"{name}_vs_bf16"],
                                    met=r[f"{name}_vs_bf16"] >= 1.6))
        if "bf16_vs_ggml_f16" in r:
            targets.append(dict(target=f"{r['case']}: bf16 >= 2x ggml f16", measured=r["bf16_vs_ggml_f16"],
                                met=r["bf16_vs_ggml_f16"] >= 2))
            targets.append(dict(target=f"{r['case']}: e4m3 >= 6x ggml q8_0", measured=r["e4m3_vs_ggml_q8_0"],
                                met=r["e4m3_vs_ggml_q8_0"] >= 6))
    for r in rows:
        if r not in big and "bf16_vs_ggml_f16" in r:
            targets.append(dict(target=f"{r['case']}: bf16 not slower than ggml f16", measured=r["bf16_vs_ggml_f16"],
                                met=r["bf16_vs_ggml_f16"] >= 1))
    common.print_targets(targets)
    if args.no_write:
        return
    layout = ("_head_major" if args.head_major else "") + (f"_g{args.quant_group}" if args.quant_group != 128 else "")
    stem = args.out or "decode_issue26_cpu" + layout + ("_quick" if args.quick else "")
    ceiling = {"gbps": rows[0]["ceiling_gbps"], "mib": rows[0]["kv_MB"] * 1e6 / 2**20,
               "note": "native read ceiling of the first row; every row has its own (ceiling_gbps)"}
    issue_method = "--issue26 (" + __doc__.split("--issue26 (", 1)[1].split("\n\n")[0]
    common.write_results(stem, "pagedkv CPU decode at the memory limit (issue 26)",
                         common.method(__doc__, issue_method), env, ceiling, rows, cols, targets,
                         ceiling_line=ISSUE26_CEILING_LINE)


def main():
    p = common.base_parser(__doc__)
    p.add_argument("--pages", action="store_true", help="page-size sweep (default in full mode)")
    p.add_argument("--issue26", action="store_true", help="issue 26 shapes against the native read ceiling and ggml")
    p.add_argument("--baseline-path", choices=["packed", "fma"], default=None,
                   help="with --issue26: also time this decode path of the same build for bf16 and e4m3 "
                        "(cpu_decode=\"packed\": the packed tiles; \"fma\": the direct decode on float32 FMAs "
                        "where the default takes the bf16 dot products)")
    p.add_argument("--packed", action="store_const", const="packed", dest="baseline_path",
                   help="the same as --baseline-path packed")
    p.add_argument("--quant-group", type=int, default=128,
                   help="with --issue26: channels per FP8 scale (default 128 = D: one scale per token and head; "
                        "32 is ggml q8_0's block)")
    p.add_argument("--head-major", action="store_true",
                   help="with --issue26: the caches in head-major pages (storage [N, Hk, P, D]) instead of token-major")
    args = p.parse_args()
    if args.issue26:
        common.setup(args)
        return issue26_main(args)
    gen, env, ceiling = common.start(args)
    print(f"copy ceiling {ceiling['gbps']:.2f} GB/s, threads {torch.get_num_threads()}, ISA {env['pagedkv_cpu_isa']}")

    rows = [run_case(make_case(4, 4096, 32, 8, 128, 16, gen), args, label="CPU row: B=4 L=4k 32/8 D=128 P=16")]
    sweep = []
    if args.pages or not args.quick:
        for P in (1, 8, 16, 32, 64, 128):
            sweep.append(run_case(make_case(4, 4096, 32, 8, 128, P, gen), args, with_peers=(P == 16),
                                  label=f"page sweep P={P}"))
        sweep.append(run_case(make_case(4, 4096, 32, 8, 128, 16, gen, identity=True), args, with_peers=False,
                              label="identity table P=16"))
        ref16 = next(r for r in sweep if r["P"] == 16 and r["case"].startswith("page"))
        for r in sweep:
            r["vs_page16"] = r["bf16_ms"] / ref16["bf16_ms"]
    if not args.quick:
        for B, L in ((1, 16384), (16, 2048)):
            rows.append(run_case(make_case(B, L, 32, 8, 128, 16, gen), args))
    ceiling = common.finish_ceiling(ceiling, args)
    for r in rows + sweep:
        r["bf16_pct_copy"] = 100 * r["bf16_gbps"] / ceiling["gbps"]
        if "fp8_gbps" in r:
            r["fp8_pct_copy"] = 100 * r["fp8_gbps"] / ceiling["gbps"]

    cols = ["case", "bf16_ms", "fp8_ms", "sdpa_ms", "gather_sdpa_ms", "bf16_gbps", "bf16_pct_copy", "vs_gather_sdpa",
            "vs_sdpa", "fp8_speedup"]
    print(f"\ncopy ceiling {ceiling['gbps']:.2f} GB/s (before {ceiling['before_gbps']:.2f}, after {ceiling['after_gbps']:.2f})")
    common.print_table(rows, cols)
    scols = ["case", "kv_MiB", "kv_fits_llc", "bf16_ms", "fp8_ms", "bf16_gbps", "bf16_pct_copy", "fp8_speedup", "vs_page16"]
    if sweep:
        print()
        common.print_table(sweep, scols)
    main_row = rows[0]
    print(f"SDPA backend: {main_row.get('sdpa_backend')}")
    targets = [
        dict(target="decode >= 3x gather+SDPA", measured=main_row["vs_gather_sdpa"], met=main_row["vs_gather_sdpa"] >= 3),
        dict(target="decode >= 70% of copy bandwidth", measured=main_row["bf16_pct_copy"],
             met=main_row["bf16_pct_copy"] >= 70),
        dict(target="fp8 decode faster than bf16", measured=main_row["fp8_speedup"], met=main_row["fp8_speedup"] > 1),
    ]
    if sweep:
        p1 = next(r for r in sweep if r["P"] == 1)
        targets.append(dict(target="page 1 within 25% of page 16", measured=p1["vs_page16"], met=p1["vs_page16"] <= 1.25))
    common.print_targets(targets)
    if args.no_write:
        return
    stem = args.out or common.result_stem("decode", args.quick, args.cold)

    def plot(path):
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(11 if sweep else 6, 4), squeeze=False)
        ax = axes[0][0]
        r = main_row
        names = ["pagedkv bf16", "pagedkv fp8", "SDPA contiguous", "gather + SDPA"]
        vals = [r["bf16_ms"], r["fp8_ms"], r["sdpa_ms"], r["gather_sdpa_ms"]]
        ax.bar(names, vals, color=["C0", "C1", "C2", "C3"])
        ax.set_ylabel("ms (median)")
        ax.set_title(r["case"], fontsize=9)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        if sweep:
            ax = axes[0][1]
            sw = [x for x in sweep if x["case"].startswith("page")]
            ax.plot([x["P"] for x in sw], [x["bf16_gbps"] for x in sw], "o-", label="pagedkv bf16")
            ax.plot([x["P"] for x in sw], [x["fp8_gbps"] for x in sw], "s-", label="pagedkv fp8 (fp8 bytes)")
            ax.axhline(ceiling["gbps"], color="k", ls="--", label="copy ceiling")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("page size (tokens)")
            ax.set_ylabel("GB/s")
            ax.set_title("decode page-size sweep, B=4 L=4k 32/8 D=128", fontsize=9)
            ax.legend(fontsize=8)
        fig.suptitle(f"{env['device']}, {env['threads']} threads, {env['caches']} caches, {env['date'][:10]}",
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    common.write_results(stem, "pagedkv CPU decode", common.method(__doc__), env, ceiling, rows + sweep,
                         cols + ["vs_page16"], targets, plot)


if __name__ == "__main__":
    main()
