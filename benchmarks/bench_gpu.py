"""GPU benchmarks of pagedkv (shared/BENCHMARKS.md grid) against its peers, in one process.

Method: CUDA events around each call; 10 warm-up calls; the median of >= 100 timed calls;
L2 flushed before every timed call by zeroing a 256 MiB buffer (outside the timed region),
so every figure is "cold L2" unless labelled warm. Decode is also timed as a CUDA-graph
replay. Ceilings measured first in the same process: device-to-device copy bandwidth
(1 GiB, bytes read + written) and an 8192^3 bf16 matmul. Page tables are random
permutations of the physical pages.

Top-k sparse decode (flash_attn_paged_sparse, K = 2048 listed of L = 65536 tokens) is timed as a
graph replay per sparse loader (cp.async, TMA gather4 where the device runs it) and with the portable
kernel, next to dense decode over all L.

Peers (same values, same process): SDPA on contiguous K/V (backend reported), gather of
the pages with torch + SDPA, FlexAttention with torch's experimental PagedAttention (when
it runs on this torch; otherwise the reason is recorded).

Writes bench_gpu.json and bench_gpu.md into --out (and prints the table).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import pagedkv  # noqa: E402

ops = torch.ops.pagedkv
DEV = "cuda"


# ----------------------------------------------------------------------------- timing


class Timer:
    def __init__(self, reps=100, warmup=10, flush=True):
        self.reps, self.warmup, self.flush = reps, warmup, flush
        self.l2 = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.flush:
                self.l2.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        times.sort()
        return times[len(times) // 2]

    def graph(self, fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return self(g.replay)


def ceilings(timer):
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    t = timer(lambda: b.copy_(a))
    copy_bw = 2 * n / t
    del a, b
    x = torch.randn((8192, 8192), device=DEV, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    t = Timer(reps=20, warmup=3, flush=False)(lambda: x @ y)
    return {"copy_bytes_per_s": copy_bw, "bf16_matmul_flops": 2 * 8192**3 / t}


# ----------------------------------------------------------------------------- cases


def make_pool(b, lens, hk, d, page, dtype, seed=0):
    """A pool holding `lens[i]` tokens per row, random page placement, and the same K/V contiguous."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages = [math.ceil(x / page) for x in lens]
    n_pages = sum(pages)
    perm = torch.randperm(n_pages, device=DEV, generator=g).to(torch.int32)
    table = torch.zeros((b, max(pages)), dtype=torch.int32, device=DEV)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[at:at + p]
        at += p
    fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k = torch.empty((n_pages, page, hk, d), dtype=dtype, device=DEV)
    v = torch.empty_like(k)
    ks = vs = None
    if fp8:
        ks = torch.empty((n_pages, page, hk, (d + 127) // 128), dtype=torch.float32, device=DEV)  # groups of 128
        vs = torch.empty_like(ks)
    total = sum(lens)
    key = torch.randn((total, hk, d), device=DEV, dtype=torch.bfloat16, generator=g)
    val = torch.randn((total, hk, d), device=DEV, dtype=torch.bfloat16, generator=g)
    offs = torch.zeros(b + 1, dtype=torch.int32, device=DEV)
    offs[1:] = torch.cumsum(torch.tensor(lens, device=DEV, dtype=torch.int32), 0)
    ops.paged_store(key, val, k, v, offs, torch.zeros(b, dtype=torch.int32, device=DEV), table, ks, vs, 128)
    return dict(k=k, v=v, ks=ks, vs=vs, table=table, key=key, val=val, offs=offs, lens=lens, page=page)


def contiguous_kv(pool, b, hk, d):
    """[B, Hk, L, D] bf16 copies of the pool (rows padded to the longest; only used for equal lengths)."""
    L = max(pool["lens"])
    out_k = torch.zeros((b, hk, L, d), dtype=torch.bfloat16, device=DEV)
    out_v = torch.zeros_like(out_k)
    at = 0
    for i, n in enumerate(pool["lens"]):
        out_k[i, :, :n] = pool["key"][at:at + n].transpose(0, 1)
        out_v[i, :, :n] = pool["val"][at:at + n].transpose(0, 1)
        at += n
    return out_k, out_v


def sdpa_backend_name():
    return "auto (flash/efficient chosen by torch)"


@contextlib.contextmanager
def kernel_options(**options):
    """Kernel options (pagedkv.set_kernel_options, read per launch) set for the block, then put back."""
    previous = pagedkv.set_kernel_options(**options)
    try:
        yield
    finally:
        pagedkv.set_kernel_options(**previous)


def options_already_set(options):
    """Whether the run was started with these options (then the default rows already time them)."""
    current = pagedkv.kernel_options()
    return any(current[name] == value for name, value in options.items())


# opt-in decode paths timed beside the default (A/B in one run; csrc/cuda/README.md): name -> kernel
# options; none at present (FP8 K fragments and 128-row prefill tiles became the defaults, 2026-11-28)
OTHER_PATHS = {}
# opt-in paths of prefill-like calls, timed beside the default prefill
PREFILL_PATHS = {
    "wgmma": {"cuda_prefill_wgmma": True},
}
# opt-in paths of paged_store into FP8 caches, timed beside the default store
FP8_STORE_PATHS = {
    "fp8_rows": {"cuda_fp8_store_rows": True},
}
# paths whose tests failed earlier in the same gpu_run.sh call are not timed: a wrong kernel may fault,
# which ends the process and every row after it
for _skipped in os.environ.get("PAGEDKV_BENCH_SKIP_PATHS", "").split():
    for _paths in (OTHER_PATHS, PREFILL_PATHS, FP8_STORE_PATHS):
        if _paths.pop(_skipped, None) is not None:
            print(f"not timed (PAGEDKV_BENCH_SKIP_PATHS): {_skipped}", flush=True)


def bench_decode(timer, cfg, ceil):
    b, L, hq, hk, d, page, dtype = cfg["B"], cfg["L"], cfg["Hq"], cfg["Hk"], cfg["D"], cfg["P"], cfg["dtype"]
    lens = cfg.get("lens") or [L] * b
    # the pool already holds this step's token (contract: store first, then attend)
    pool = make_pool(b, lens, hk, d, page, dtype)
    q = torch.randn((b, hq, d), device=DEV, dtype=torch.bfloat16)
    offs = torch.arange(b + 1, dtype=torch.int32, device=DEV)
    cached = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)

    def run():
        ops.flash_attn_paged.out(q, offs, pool["k"], pool["v"], cached, pool["table"], None, True, pool["ks"],
                                 pool["vs"], 128, -1, 0.0, out=out)

    res = {"op": "decode",
           **{k: (str(v) if k == "dtype" else v) for k, v in cfg.items() if k not in ("lens", "no_flex")}}
    res["lens"] = "skewed" if cfg.get("lens") else "constant"
    t = timer(run)
    tg = timer.graph(run)
    es = 1 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 2
    kv_bytes = 2 * sum(lens) * hk * d * es + (8 * sum(lens) * hk * ((d + 127) // 128) if es == 1 else 0)
    io = kv_bytes + 2 * q.numel() * 2
    res.update(pagedkv_s=t, pagedkv_graph_s=tg, bytes=io, bw_frac_of_copy=io / tg / ceil["copy_bytes_per_s"])
    # opt-in kernel paths, timed beside the default (their options are read per launch, so the graph
    # captured here uses them)
    for name, options in OTHER_PATHS.items():
        if (es == 2 and any("fp8" in k for k in options)) or options_already_set(options):
            continue
        with kernel_options(**options):
            res[f"{name}_graph_s"] = timer.graph(run)
    # peers on bf16 values (same token values)
    if not cfg.get("lens"):
        kc, vc = contiguous_kv(pool, b, hk, d)
        q4 = q.view(b, hq, 1, d)
        res["sdpa_contiguous_s"] = timer(lambda: F.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True))
        res["sdpa_backend"] = sdpa_backend_name()
        if es == 2:
            def gather_sdpa():
                lk = pool["k"][pool["table"].long()].reshape(b, -1, hk, d)[:, :L].transpose(1, 2)
                lv = pool["v"][pool["table"].long()].reshape(b, -1, hk, d)[:, :L].transpose(1, 2)
                return F.scaled_dot_product_attention(q4, lk, lv, enable_gqa=True)
            res["gather_sdpa_s"] = timer(gather_sdpa)
        if not cfg.get("no_flex"):
            res["flex_paged_s"], res["flex_note"] = flex_paged(timer, pool, q4, b, L, hq, hk, d, page, es)
        del kc, vc
    del pool
    torch.cuda.empty_cache()
    return res


_FLEX = {}


def flex_paged(timer, pool, q4, b, L, hq, hk, d, page, es):
    """FlexAttention with torch's experimental PagedAttention at the same page size (best effort)."""
    if es != 2:
        return None, "bf16 only"
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "fn" not in _FLEX:
            _FLEX["fn"] = torch.compile(flex_attention, fullgraph=True)
        n_pages = math.ceil(L / page) * b
        pa = PagedAttention(n_pages, page, b, device=DEV)
        kc = torch.zeros((1, hk, n_pages * page, d), dtype=torch.bfloat16, device=DEV)
        vc = torch.zeros_like(kc)
        idx = torch.arange(b, device=DEV)
        for i in range(b):
            pa.reserve(torch.tensor(i, device=DEV), torch.tensor(L, device=DEV))
        lk = pool["k"][pool["table"].long()].reshape(b, -1, hk, d)[:, :L].transpose(1, 2).contiguous()
        lv = pool["v"][pool["table"].long()].reshape(b, -1, hk, d)[:, :L].transpose(1, 2).contiguous()
        pos = torch.arange(L, device=DEV).expand(b, L)
        pa.assign(idx, pos, lk, lv, kc, vc)
        mask = create_block_mask(lambda bb, h, qi, kv: kv >= 0, b, None, 1, L, device=DEV, BLOCK_SIZE=(128, page))
        pmask = pa.convert_logical_block_mask(mask)
        score_mod = pa.get_score_mod(None)
        fn = _FLEX["fn"]
        return timer(lambda: fn(q4, kc, vc, block_mask=pmask, score_mod=score_mod, enable_gqa=True)), "ok"
    except Exception as e:  # noqa: BLE001  (a peer that does not run is recorded, not fatal)
        return None, f"unavailable: {type(e).__name__}: {str(e)[:120]}"


def bench_prefill(timer, cfg, ceil):
    b, L, hq, hk, d, page = cfg["B"], cfg["L"], cfg["Hq"], cfg["Hk"], cfg["D"], cfg["P"]
    prefix = cfg.get("prefix", 0)
    pool = make_pool(b, [prefix + L] * b, hk, d, page, torch.bfloat16)
    q = torch.randn((b * L, hq, d), device=DEV, dtype=torch.bfloat16)
    offs = torch.arange(0, b * L + 1, L, dtype=torch.int32, device=DEV)
    cached = torch.full((b,), prefix, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)

    def run():
        ops.flash_attn_paged.out(q, offs, pool["k"], pool["v"], cached, pool["table"], out=out)

    t = timer(run)
    visible = b * (L * prefix + L * (L + 1) / 2)
    flops = 4 * hq * d * visible
    res = {"op": "prefill", **cfg, "pagedkv_s": t, "flops": flops, "tflops": flops / t / 1e12,
           "frac_of_matmul": flops / t / ceil["bf16_matmul_flops"]}
    for name, options in PREFILL_PATHS.items():
        if not options_already_set(options):
            with kernel_options(**options):
                res[f"{name}_s"] = timer(run)
    kc, vc = contiguous_kv(pool, b, hk, d)
    q4 = q.view(b, L, hq, d).transpose(1, 2)
    if prefix == 0:  # (SDPA's is_causal aligns a chunk's rows to the first keys, not to its prefix)
        res["sdpa_contiguous_s"], res["sdpa_backend"] = sdpa_flash_causal(timer, q4, kc, vc)
        res["sdpa_cudnn_s"], res["sdpa_cudnn_note"] = sdpa_cudnn_causal(timer, q4, kc, vc)
    del pool, kc, vc
    torch.cuda.empty_cache()
    return res


def sdpa_flash_causal(timer, q4, kc, vc):
    """Causal SDPA on contiguous K/V through the flash backend (GQA as SDPA's enable_gqa, or K/V
    repeated per query head beforehand where this torch's flash backend refuses enable_gqa)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(k, v, gqa):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=gqa)

    try:
        run(kc, vc, True)
        return timer(lambda: run(kc, vc, True)), "flash (enable_gqa)"
    except RuntimeError:
        rep = q4.shape[1] // kc.shape[1]
        kr, vr = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)
        return timer(lambda: run(kr, vr, False)), "flash (K/V repeated per query head)"


def sdpa_cudnn_causal(timer, q4, kc, vc):
    """Causal SDPA through the cuDNN backend on contiguous K/V repeated per query head (best effort: the
    backend exists from torch 2.5 and refuses some shapes)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        rep = q4.shape[1] // kc.shape[1]
        kr, vr = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)

        def run():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q4, kr, vr, is_causal=True)

        run()
        return timer(run), "cudnn (K/V repeated per query head)"
    except (RuntimeError, AttributeError, ImportError) as e:  # a peer that does not run is recorded, not fatal
        return None, f"unavailable: {type(e).__name__}: {str(e)[:120]}"


def bench_store_load(timer, cfg, ceil):
    tokens, hk, d, dtype = cfg["T"], 8, 128, cfg["dtype"]
    page = 16
    pool = make_pool(1, [tokens], hk, d, page, dtype)
    key, val = pool["key"], pool["val"]
    offs = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    zero = torch.zeros(1, dtype=torch.int32, device=DEV)
    es = 1 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 2
    t_store = timer(lambda: ops.paged_store(key, val, pool["k"], pool["v"], offs, zero, pool["table"], pool["ks"],
                                            pool["vs"], 128))
    store_bytes = 2 * tokens * hk * d * (2 + es)
    others = {}
    for name, options in FP8_STORE_PATHS.items():
        if es == 1 and not options_already_set(options):
            with kernel_options(**options):
                others[f"store_{name}_s"] = t = timer(lambda: ops.paged_store(
                    key, val, pool["k"], pool["v"], offs, zero, pool["table"], pool["ks"], pool["vs"], 128))
                others[f"store_{name}_bw_frac"] = store_bytes / t / ceil["copy_bytes_per_s"]
    out = torch.empty((tokens, hk, d), dtype=torch.bfloat16, device=DEV)
    lens = torch.tensor([tokens], dtype=torch.int32, device=DEV)
    t_load = timer(lambda: ops.paged_load(pool["k"], pool["ks"], pool["table"], lens, offs, out, 128))
    load_bytes = tokens * hk * d * (2 + es)
    t_torch = timer(lambda: pool["k"][pool["table"][0].long()].reshape(-1, hk, d)[:tokens].contiguous()) \
        if es == 2 else None
    return {"op": "store/load", "T": tokens, "dtype": str(dtype), "store_s": t_store, "load_s": t_load,
            "store_bw_frac": store_bytes / t_store / ceil["copy_bytes_per_s"],
            "load_bw_frac": load_bytes / t_load / ceil["copy_bytes_per_s"], "torch_index_select_s": t_torch, **others}


SPARSE_LOADERS = {"cp.async": 0, "tma-gather4": 2}


def bench_sparse(timer, cfg, ceil):
    """Top-k decode: each of B rows attends over K listed tokens (random, per KV head) of its
    L-token row, per sparse loader and with the portable kernel; dense decode over all L alongside.
    MLA (D 576): K-only pool, V = the first 512 columns of K."""
    b, L, k, hq, hk, d, page, dtype = (cfg[x] for x in ("B", "L", "K", "Hq", "Hk", "D", "P", "dtype"))
    mla = d == 576
    pool = make_pool(b, [L] * b, hk, d, page, dtype)
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn((b, hq, d), device=DEV, dtype=torch.bfloat16, generator=g)
    # K distinct positions per (row, KV head), encoded through the row's pages as page * P + slot
    pos = torch.argsort(torch.rand((b, hk, L), device=DEV, generator=g), dim=-1)[..., :k]
    phys = torch.gather(pool["table"].long().unsqueeze(1).expand(b, hk, -1), 2, pos // page)
    indices = (phys * page + pos % page).to(torch.int32)
    kc = pool["k"]
    vc = kc[..., :512] if mla else pool["v"]
    vs = pool["ks"] if mla else pool["vs"]
    out = torch.empty((b, hq, vc.shape[-1]), device=DEV, dtype=torch.bfloat16)

    def sparse():
        out.copy_(ops.flash_attn_paged_sparse(q, kc, vc, indices, None, pool["ks"], vs, 128))

    es = 1 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 2
    kv_bytes = b * hk * k * (d if mla else 2 * d) * es + (b * hk * k * 8 if es == 1 else 0)
    res = {"op": "sparse", **{x: (str(v) if x == "dtype" else v) for x, v in cfg.items()}, "bytes": kv_bytes}
    for name, loader in SPARSE_LOADERS.items():
        key = f"sparse_{name}_s"
        if not pagedkv._C.cuda_loader_available(0, loader):
            res[key] = None
            continue
        pagedkv._C.set_cuda_loader(loader)
        try:
            res[key] = timer.graph(sparse)
        except RuntimeError as e:  # this loader does not fit the view (e.g. gather4 on 576-byte FP8 rows)
            res[key], res[f"{key}_note"] = None, str(e)[:120]
        finally:
            pagedkv._C.set_cuda_loader(-1)
    with kernel_options(cuda_sparse_kernel="portable"):
        res["sparse_portable_s"] = timer.graph(sparse)
    best = min((v for key, v in res.items() if key.startswith("sparse_") and key.endswith("_s") and v), default=None)
    res["best_bw_frac_of_copy"] = kv_bytes / best / ceil["copy_bytes_per_s"] if best else None
    if not mla:  # dense decode over all L keys (the CUDA dense kernel has no D 576)
        offs = torch.arange(b + 1, dtype=torch.int32, device=DEV)
        cached = torch.full((b,), L - 1, dtype=torch.int32, device=DEV)
        res["dense_s"] = timer.graph(lambda: ops.flash_attn_paged.out(
            q, offs, kc, pool["v"], cached, pool["table"], None, True, pool["ks"], pool["vs"], 128, -1, 0.0, out=out))
    del pool
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------- grid


def bench_mla(timer, cfg, ceil):
    """MLA decode (one latent KV head, D 576 / Dv 512, page P) over a bf16 K-only cache (V a view of K's
    first 512 channels) and the same keys as packed fp8_ds_mla rows (656 bytes per token): times and
    the bytes read as a share of the copy ceiling (FlashMLA publishes ~3000 GB/s on an H800)."""
    b, L, hq, page = cfg["B"], cfg["L"], cfg["Hq"], cfg["P"]
    g = torch.Generator(device=DEV).manual_seed(0)
    pages = L // page
    table = torch.randperm(b * pages, device=DEV, generator=g).to(torch.int32).view(b, pages)
    keys = (torch.randn((b * pages * page, 1, 576), device=DEV, generator=g) * 0.5).to(torch.bfloat16)
    k_bf16 = keys.view(b * pages, page, 1, 576)
    k_ds = torch.zeros((b * pages, page, 1, 656), dtype=torch.uint8, device=DEV)
    every = torch.arange(b * pages, dtype=torch.int32, device=DEV).view(1, -1)
    ops.paged_store(keys, None, k_ds, None, torch.tensor([0, b * pages * page], dtype=torch.int32, device=DEV),
                    torch.zeros(1, dtype=torch.int32, device=DEV), every, kv_format="fp8_ds_mla")
    q = torch.randn((b, hq, 576), device=DEV, dtype=torch.bfloat16)
    offs = torch.arange(b + 1, dtype=torch.int32, device=DEV)
    cached = torch.full((b,), L - 1, dtype=torch.int32, device=DEV)
    out = torch.empty((b, hq, 512), device=DEV, dtype=torch.bfloat16)
    res = {"op": "mla", **{k: v for k, v in cfg.items()}}
    for name, k, v, fmt_name, row_bytes in (("bf16", k_bf16, k_bf16[..., :512], None, 1152),
                                            ("fp8_ds_mla", k_ds, None, "fp8_ds_mla", 656)):
        def run():
            ops.flash_attn_paged.out(q, offs, k, v, cached, table, None, True, None, None, 128, -1, 0.0, None,
                                     fmt_name, out=out)
        try:
            t = timer.graph(run)
        except RuntimeError as error:  # a kernel refusal is reported, not fatal
            res[f"{name}_error"] = str(error).splitlines()[0]
            continue
        io = b * L * row_bytes + 2 * q.numel() * 2
        res.update({f"{name}_graph_s": t, f"{name}_bytes": io, f"{name}_bw_frac_of_copy": io / t / ceil["copy_bytes_per_s"]})
    del k_bf16, k_ds, keys
    torch.cuda.empty_cache()
    return res


def grid_issue22():
    """Issue 22's shapes: decode B=32 L=8k Hq/Hk 32/8 D 128 (bf16 and FP8, page 16, with every peer;
    bf16 at pages 1, 64, 256), issue 45's GQA 1 and 8, head sizes 64 and 256 (bf16 and e4m3) and ragged
    lengths, prefill B=8 L=4k causal against SDPA's flash backend; and MLA decode B=32 L=4k (Hq 16 and
    128) over bf16 K-only and fp8_ds_mla caches."""
    main = dict(B=32, L=8192, Hq=32, Hk=8, D=128, P=16, id="I22-dec")
    dec = [dict(main, dtype=dt) for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)]
    dec += [dict(main, P=p, dtype=torch.bfloat16, id="I22-page", no_flex=True) for p in (1, 64, 256)]
    # issue 45's other shapes: GQA 1 and 8, head sizes 64 and 256, one 32k row among 63 of 1k (page 16)
    dec += [dict(main, Hk=hk, dtype=torch.bfloat16, id=f"I45-gqa{32 // hk}", no_flex=True) for hk in (32, 4)]
    dec += [dict(main, D=d, dtype=dt, id=f"I45-d{d}", no_flex=True) for d in (64, 256)
            for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    dec += [dict(main, B=64, L=32768, lens=[32768] + [1024] * 63, dtype=torch.bfloat16, id="I45-ragged",
                 no_flex=True)]
    pre = [dict(B=8, L=4096, Hq=32, Hk=8, D=128, P=16, id="I22-pre")]
    # issue 46: pages 1 and 64 beside 16, head size 64, chunked prefill (512 new tokens onto 8192 cached)
    pre += [dict(B=8, L=4096, Hq=32, Hk=8, D=128, P=p, id="I46-page") for p in (1, 64)]
    pre += [dict(B=8, L=4096, Hq=32, Hk=8, D=64, P=16, id="I46-d64"),
            dict(B=8, L=512, Hq=32, Hk=8, D=128, P=16, prefix=8192, id="I46-chunk")]
    sl = [dict(T=131072, dtype=dt, id="S/L") for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    mla = [dict(B=32, L=4096, Hq=hq, P=64, id="MLA-dec") for hq in (16, 128)]  # issue 47's MLA decode
    return dec, pre, sl, [], mla


def grid(quick):
    dec = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for b in (1, 8, 32, 128):
            for L in (512, 2048, 8192, 16384):
                dec.append(dict(B=b, L=L, Hq=32, Hk=8, D=128, P=16, dtype=dtype, id="D-main"))
        dec.append(dict(B=1, L=65536, Hq=32, Hk=8, D=128, P=16, dtype=dtype, id="D-main"))
    dec += [dict(B=16, L=4096, Hq=32, Hk=32, D=128, P=16, dtype=torch.bfloat16, id="D-mha"),
            dict(B=1, L=65536, Hq=32, Hk=32, D=128, P=16, dtype=torch.bfloat16, id="D-mha")]
    dec += [dict(B=32, L=8192, Hq=32, Hk=8, D=128, P=p, dtype=torch.bfloat16, id="D-page") for p in (1, 8, 16, 32, 64,
                                                                                                    128)]
    g = torch.Generator().manual_seed(0)
    dec += [dict(B=64, L=4096, Hq=32, Hk=8, D=128, P=16, dtype=torch.bfloat16, id="D-skew",
                 lens=torch.randint(1, 8192, (64,), generator=g).tolist()),
            dict(B=64, L=4096, Hq=32, Hk=8, D=128, P=16, dtype=torch.bfloat16, id="D-skew", lens=[32768] + [1024] * 63)]
    pre = [dict(B=b, L=L, Hq=32, Hk=hk, D=128, P=16, id="P-main") for hk in (8, 32) for b, L in
           ((1, 16384), (8, 4096), (64, 1024))]
    pre += [dict(B=1, L=q, Hq=32, Hk=8, D=128, P=16, prefix=pf, id="P-append") for q in (128, 2048) for pf in
            (4096, 16384)]
    sl = [dict(T=t, dtype=dt, id="S/L") for t in (4096, 131072) for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    # top-k sparse decode: K = 2048 listed of L = 65536 cached tokens
    sp = [dict(B=b, L=65536, K=2048, Hq=32, Hk=8, D=128, P=16, dtype=dt, id="SP-topk") for b in (1, 8)
          for dt in (torch.bfloat16, torch.float8_e4m3fn)]
    sp += [dict(B=8, L=65536, K=2048, Hq=16, Hk=1, D=576, P=64, dtype=torch.bfloat16, id="SP-mla")]
    # MLA decode, one latent head (issue 47): Hq 16 and 128, page 64
    mla = [dict(B=b, L=L, Hq=hq, P=64, id="MLA-dec") for hq in (16, 128) for b, L in ((32, 4096), (8, 16384))]
    if quick:
        dec, pre, sl, sp, mla = dec[:3] + dec[-2:], pre[:2], sl[:2], sp[:1], mla[:1]
    return dec, pre, sl, sp, mla


def git_commit():
    # gpu_run.sh sets this from the prebuilt extension's record: a device machine's copy of the tree
    # may carry a stale .git
    if os.environ.get("PAGEDKV_BENCH_COMMIT"):
        return os.environ["PAGEDKV_BENCH_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def fmt(x, scale=1e6, unit="us"):
    return "-" if x is None else f"{x * scale:.1f}{unit}"


def write_results(out, meta, ceil, rows):
    """Rewritten after every row, so a run stopped early (a time limit) still leaves what it measured."""
    with open(os.path.join(out, "bench_gpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out, "bench_gpu.md"), "w") as f:
        f.write(f"# pagedkv GPU benchmarks\n\n{meta['device']}, {meta['date']}, commit {meta['commit']}, torch "
                f"{meta['torch']} (CUDA {meta['cuda']}), loaders {meta['loaders']}\n\n")
        f.write(f"Ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                f"{ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s. {meta['method']}\n\n")
        f.write("| id | op | shape | pagedkv | graph | % copy BW / TFLOP/s | SDPA contiguous | gather+SDPA | Flex paged |\n")
        f.write("|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            if r["op"] == "decode":
                f.write(f"| {r['id']} | decode {r['dtype'].replace('torch.', '')} | B={r['B']} L={r['L']} P={r['P']} "
                        f"{r['Hq']}/{r['Hk']} {r['lens']} | {fmt(r['pagedkv_s'])} | {fmt(r['pagedkv_graph_s'])} | "
                        f"{100 * r['bw_frac_of_copy']:.0f}% | {fmt(r.get('sdpa_contiguous_s'))} | "
                        f"{fmt(r.get('gather_sdpa_s'))} | {fmt(r.get('flex_paged_s'))} |\n")
            elif r["op"] == "prefill":
                f.write(f"| {r['id']} | prefill | B={r['B']} L={r['L']} {r['Hq']}/{r['Hk']} prefix={r.get('prefix', 0)} "
                        f"| {fmt(r['pagedkv_s'], 1e3, 'ms')}"
                        + "".join(f" ({n} {fmt(r[n + '_s'], 1e3, 'ms')})" for n in PREFILL_PATHS if r.get(n + "_s"))
                        + f" | - | {r['tflops']:.0f} TFLOP/s | "
                        f"{fmt(r.get('sdpa_contiguous_s'), 1e3, 'ms')} (cuDNN {fmt(r.get('sdpa_cudnn_s'), 1e3, 'ms')}) "
                        f"| - | - |\n")
            elif r["op"] == "mla":
                cells = [f"{n} {fmt(r.get(n + '_graph_s'))} ({100 * r[n + '_bw_frac_of_copy']:.0f}%)"
                         if n + "_graph_s" in r else f"{n}: refused" for n in ("bf16", "fp8_ds_mla")]
                f.write(f"| {r['id']} | MLA decode | B={r['B']} L={r['L']} Hq={r['Hq']} P={r['P']} | "
                        f"{', '.join(cells)} | graph | % of copy in the cells | - | - | - |\n")
            elif r["op"] == "sparse":
                bw = "-" if r["best_bw_frac_of_copy"] is None else f"{100 * r['best_bw_frac_of_copy']:.0f}%"
                f.write(f"| {r['id']} | sparse {r['dtype'].replace('torch.', '')} | B={r['B']} K={r['K']} of "
                        f"L={r['L']} D={r['D']} {r['Hq']}/{r['Hk']} | cp.async {fmt(r['sparse_cp.async_s'])}, "
                        f"gather4 {fmt(r['sparse_tma-gather4_s'])}, portable {fmt(r['sparse_portable_s'])} | graph | "
                        f"{bw} | - | - | dense over L: {fmt(r.get('dense_s'))} |\n")
            else:
                f.write(f"| S/L | store/load {r['dtype'].replace('torch.', '')} | T={r['T']} | store "
                        f"{fmt(r['store_s'])}, load {fmt(r['load_s'])} | - | {100 * r['store_bw_frac']:.0f}% / "
                        f"{100 * r['load_bw_frac']:.0f}% | - | torch gather {fmt(r['torch_index_select_s'])} | - |\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--quick", action="store_true", help="a few points of each table")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--issue22", action="store_true", help="only issue 22's shapes (decode B=32 L=8k, pages, prefill)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    timer = Timer(reps=args.reps)
    ceil = ceilings(timer)
    meta = {"device": torch.cuda.get_device_name(0), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit(), "torch": torch.__version__, "cuda": torch.version.cuda, **ceil,
            "loaders": [n for i, n in enumerate(pagedkv._C.cuda_loader_names)
                        if pagedkv._C.cuda_loader_available(0, i)], "method": __doc__.strip().split("\n\n")[1]}
    print(json.dumps(meta, indent=1))
    dec, pre, sl, sp, mla = grid_issue22() if args.issue22 else grid(args.quick)
    rows = []
    for cfg in dec:
        r = bench_decode(timer, cfg, ceil)
        rows.append(r)
        write_results(args.out, meta, ceil, rows)
        print(f"{r['id']:7s} decode {r['dtype']:20s} B={r['B']:4d} L={r['L']:6d} P={r['P']:3d} {r['lens']:8s} "
              f"{fmt(r['pagedkv_s'])} graph {fmt(r['pagedkv_graph_s'])} = {100 * r['bw_frac_of_copy']:.0f}% of copy | "
              f"sdpa {fmt(r.get('sdpa_contiguous_s'))} gather+sdpa {fmt(r.get('gather_sdpa_s'))} "
              f"flex {fmt(r.get('flex_paged_s'))}"
              + "".join(f" | {n} {fmt(r[n + '_graph_s'])}" for n in OTHER_PATHS if r.get(n + "_graph_s")),
              flush=True)
    for cfg in pre:
        r = bench_prefill(timer, cfg, ceil)
        rows.append(r)
        write_results(args.out, meta, ceil, rows)
        print(f"{r['id']:8s} prefill B={r['B']} L={r['L']} Hk={r['Hk']} prefix={r.get('prefix', 0)} "
              f"{fmt(r['pagedkv_s'], 1e3, 'ms')} {r['tflops']:.0f} TFLOP/s | sdpa {fmt(r.get('sdpa_contiguous_s'), 1e3, 'ms')}"
              f" cudnn {fmt(r.get('sdpa_cudnn_s'), 1e3, 'ms')}"
              + "".join(f" | {n} {fmt(r[n + '_s'], 1e3, 'ms')}" for n in PREFILL_PATHS if r.get(n + "_s")),
              flush=True)
    for cfg in sl:
        r = bench_store_load(timer, cfg, ceil)
        rows.append(r)
        write_results(args.out, meta, ceil, rows)
        print(f"S/L T={r['T']} {r['dtype']} store {fmt(r['store_s'])} ({100 * r['store_bw_frac']:.0f}% copy) "
              f"load {fmt(r['load_s'])} ({100 * r['load_bw_frac']:.0f}% copy) torch {fmt(r['torch_index_select_s'])}"
              + "".join(f" | store {n} {fmt(r['store_' + n + '_s'])} ({100 * r['store_' + n + '_bw_frac']:.0f}% copy)"
                        for n in FP8_STORE_PATHS if r.get(f"store_{n}_s")),
              flush=True)
    for cfg in sp:
        r = bench_sparse(timer, cfg, ceil)
        rows.append(r)
        write_results(args.out, meta, ceil, rows)
        bw = "-" if r["best_bw_frac_of_copy"] is None else f"{100 * r['best_bw_frac_of_copy']:.0f}%"
        print(f"{r['id']:8s} sparse {r['dtype']:20s} B={r['B']} K={r['K']} of L={r['L']} D={r['D']} graph: "
              f"cp.async {fmt(r['sparse_cp.async_s'])} gather4 {fmt(r['sparse_tma-gather4_s'])} "
              f"portable {fmt(r['sparse_portable_s'])} (best {bw} of copy) | dense {fmt(r.get('dense_s'))}",
              flush=True)
    for cfg in mla:
        r = bench_mla(timer, cfg, ceil)
        rows.append(r)
        write_results(args.out, meta, ceil, rows)
        print(f"{r['id']:8s} mla B={r['B']} L={r['L']} Hq={r['Hq']} P={r['P']} graph: "
              + " | ".join(f"{n} {fmt(r.get(n + '_graph_s'))} ({100 * r[n + '_bw_frac_of_copy']:.0f}% of copy)"
                           if n + "_graph_s" in r else f"{n}: {r.get(n + '_error')}" for n in ("bf16", "fp8_ds_mla")),
              flush=True)
    print(f"wrote {args.out}/bench_gpu.json and bench_gpu.md")


if __name__ == "__main__":
    main()
