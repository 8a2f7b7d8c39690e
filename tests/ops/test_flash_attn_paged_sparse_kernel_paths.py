"""flash_attn_paged_sparse on CUDA along its kernel paths, against pagedkv.reference.

The tiled kernel (one CTA per query row and KV head, listed K/V rows staged in shared memory) with
each of its loaders, forced as for flash_attn_paged (`_C.set_cuda_loader`; `_C.cuda_loader_available`
says what the device runs): cp.async (0) and TMA gather4 (2, sm_100a). The kernel option
cuda_sparse_kernel="portable" (`pagedkv.set_kernel_options`) forces the portable fallback kernel, so both
kernels meet on the same arguments.

Grid: bf16/fp16/e4m3/e5m2 caches, GQA 4 (and 1, 3, 16, 20: more than one CTA per row and KV head),
one list per KV head or one shared list, -1 entries, out-of-range entries with checks off (never
read: they count as -1; with checks on they raise), lists that are not a multiple of the 32-row tile
or of 4 (gather4's group), long lists (many tiles: the double buffer's reuse and barrier parity),
MLA (D 576, V the first 512 columns of K), sinks, softcap, page sizes that are not powers of two,
the collection layout, rows that are not 16-byte aligned (plain loads). Every case runs on CUDA only
and skips cleanly without it. Tolerances: conftest.attention_tolerance.
"""

from __future__ import annotations

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)
from test_flash_attn_paged_sparse import fill_pool

pytestmark = [CUDA_ONLY, pytest.mark.usefixtures("cuda_knobs")]

SPARSE_LOADERS = (0, 2)  # cp.async, tma-gather4 (the sparse kernel has no per-page TMA loader)
LOADER_NAMES = {0: "cp.async", 2: "tma-gather4"}
Q16 = (torch.bfloat16, torch.float16)
CACHE_KINDS = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def use_loader(loader):
    """Force `loader` for this test (cuda_knobs puts the default back), or skip where the device
    does not run it."""
    if not _C.cuda_loader_available(torch.cuda.current_device(), loader):
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    _C.set_cuda_loader(loader)


def listed_tokens(gen, num_tokens, lists, listed, pool_tokens, bad_entries=True):
    """[T, lists, K] int32 (on the CPU): tokens in [1, pool), duplicates, -1 holes, and with
    `bad_entries` out-of-range values (>= pool, < -1); the last row lists nothing. Token 0 is never
    listed: the tests poison it, and it is the row gather4 reads for an invalid entry of a loaded group."""
    ix = torch.randint(1, pool_tokens, (num_tokens, lists, listed), generator=gen, dtype=torch.int32)
    ix[:, :, 0] = ix[:, :, 1]
    ix[torch.rand(ix.shape, generator=gen) < 0.15] = -1
    if bad_entries:
        bad = torch.rand(ix.shape, generator=gen) < 0.1
        ix[bad] = torch.where(torch.rand(ix.shape, generator=gen)[bad] < 0.5,
                              torch.full_like(ix[bad], pool_tokens), torch.full_like(ix[bad], -7))
        ix[0, 0, -1] = 2**31 - 1
    ix[-1] = -1
    return ix


def as_listed(ix, pool_tokens):
    """What the kernels must compute with checks off: out-of-range entries count as -1."""
    return torch.where((ix < -1) | (ix >= pool_tokens), torch.full_like(ix, -1), ix)


def poison_token_zero(kv):
    """NaN in token 0 of every K/V row (FP8: the NaN code 0x7f of e4m3fn and e5m2)."""
    for t in (kv.k_cache, kv.v_cache):
        if t is None:
            continue
        if t.dtype in FP8_DTYPES:
            t[0, 0].view(torch.uint8).fill_(0x7F)
        else:
            t[0, 0].fill_(float("nan"))


def run_sparse(kv, q, ix, pool_tokens, *, v_cache=None, v_scales=None, scale=None, quant_group=32, softcap=0.0,
               sinks=None, what=""):
    """The op on CUDA against the reference over the same lists with bad entries as -1."""
    v_cache = kv.v_cache if v_cache is None else v_cache
    v_scales = kv.v_scales if v_scales is None else v_scales
    args = (kv.k_cache, v_cache, ix.cuda(), scale, kv.k_scales, v_scales, quant_group, softcap, sinks)
    out = pagedkv.flash_attn_paged_sparse(q, *args)
    clean = (args[0], args[1], as_listed(ix, pool_tokens).cuda(), *args[3:])
    expected = ref.flash_attn_paged_sparse(q.double(), *clean)
    assert_attention_close(out, expected, q.dtype, what)
    return out


def pool(gen, *, layout="separate", num_pages=40, page_size=16, num_kv_heads=2, head_dim=128,
         dtype=torch.bfloat16, quant_group=32, k_only=False, noncontig=False):
    kv = make_paged_kv(layout, num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, dtype=dtype, quant_group=quant_group, k_only=k_only,
                       noncontig=noncontig, device="cuda")
    fill_pool(gen, kv)
    poison_token_zero(kv)
    return kv


# ---------------------------------------------------------------------------------------------
# each loader: dtypes, GQA 4, shared or per-head lists, -1 and out-of-range entries, sinks, softcap


@pytest.mark.parametrize("loader", SPARSE_LOADERS, ids=LOADER_NAMES.get)
@pytest.mark.parametrize("cache_dtype", CACHE_KINDS, ids=dtype_name)
@pytest.mark.parametrize("shared", [False, True], ids=["per-head", "shared"])
@pytest.mark.parametrize("options", [{}, {"softcap": 5.0, "sinks": True}], ids=["plain", "softcap-sinks"])
@pytest.mark.parametrize("page_size", [16, 5])
def test_sparse_cuda_each_loader_matches(loader, cache_dtype, shared, options, page_size):
    use_loader(loader)
    gen = generator(seed_from("sparse-loader", loader, str(cache_dtype), shared, str(options), page_size))
    hk, gqa, d, pages = 2, 4, 128, 40
    kv = pool(gen, page_size=page_size, num_kv_heads=hk, head_dim=d, dtype=cache_dtype, num_pages=pages)
    q_dtype = torch.float16 if cache_dtype == torch.float16 else torch.bfloat16
    q = randn(gen, (6, hk * gqa, d), q_dtype, "cuda", scale=2.0)
    ix = listed_tokens(gen, 6, 1 if shared else hk, 70, pages * page_size)  # 70: 2 tiles + 6, not 4k
    sinks = randn(gen, (hk * gqa,), torch.float32, "cuda", scale=2.0) if options.get("sinks") else None
    out = run_sparse(kv, q, ix, pages * page_size, softcap=options.get("softcap", 0.0), sinks=sinks,
                     what=f"{LOADER_NAMES[loader]} {dtype_name(cache_dtype)}")
    assert bool((out[-1] == 0).all()), "a row that lists no token outputs zeros"


@pytest.mark.parametrize("loader", SPARSE_LOADERS, ids=LOADER_NAMES.get)
@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("gqa", [1, 3, 16, 20])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_sparse_cuda_head_sizes_and_groups(loader, head_dim, gqa, cache_dtype):
    """GQA 1 (P V rows split over idle head lanes), 3, 16 (one full CTA), 20 (16 + 4: two CTAs per
    row and KV head); every tiled head size. gather4 needs whole 128-byte rows: FP8 D 64 / 96 and
    bf16 D 96 do not fit it."""
    use_loader(loader)
    gen = generator(seed_from("sparse-dims", loader, head_dim, gqa, str(cache_dtype)))
    hk, pages, p = 2, 12, 8
    kv = pool(gen, page_size=p, num_kv_heads=hk, head_dim=head_dim, dtype=cache_dtype, num_pages=pages)
    q = randn(gen, (3, hk * gqa, head_dim), torch.bfloat16, "cuda")
    ix = listed_tokens(gen, 3, hk, 37, pages * p)
    try:
        run_sparse(kv, q, ix, pages * p, what=f"D {head_dim} GQA {gqa}")
    except RuntimeError as e:
        row_bytes = head_dim * cache_dtype.itemsize
        assert loader == 2 and row_bytes % 128 != 0 and "does not fit" in str(e), str(e)


@pytest.mark.parametrize("loader", SPARSE_LOADERS, ids=LOADER_NAMES.get)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2], ids=dtype_name)
@pytest.mark.parametrize("num_q_heads", [16, 20])
def test_sparse_cuda_mla(loader, cache_dtype, num_q_heads):
    """K-only MLA: D 576, V = the first 512 columns of K (a view): only the K rows are staged. FP8's
    576-byte rows are not whole 128-byte chunks: gather4 does not fit them (cp.async does)."""
    use_loader(loader)
    gen = generator(seed_from("sparse-mla", loader, str(cache_dtype), num_q_heads))
    pages, p = 10, 16
    kv = pool(gen, page_size=p, num_kv_heads=1, head_dim=576, dtype=cache_dtype, quant_group=128,
              num_pages=pages, k_only=True)
    v_cache = kv.k_cache[..., :512]
    v_scales = None if kv.k_scales is None else kv.k_scales[..., :4]
    q = randn(gen, (3, num_q_heads, 576), torch.bfloat16, "cuda")
    ix = listed_tokens(gen, 3, 1, 45, pages * p)
    try:
        out = run_sparse(kv, q, ix, pages * p, v_cache=v_cache, v_scales=v_scales, scale=0.05, quant_group=128,
                         what="MLA")
    except RuntimeError as e:
        assert loader == 2 and cache_dtype != torch.bfloat16 and "does not fit" in str(e), str(e)
        return
    assert out.shape == (3, num_q_heads, 512)


@pytest.mark.parametrize("loader", SPARSE_LOADERS, ids=LOADER_NAMES.get)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=dtype_name)
def test_sparse_cuda_long_lists_collection_layout(loader, cache_dtype):
    """1000 listed tokens (32 tiles: both stages and both barrier parities many times) in the
    collection layout (page stride = 2 * L pages: gather4's rows per page), page size 7."""
    use_loader(loader)
    gen = generator(seed_from("sparse-long", loader, str(cache_dtype)))
    pages, p = 200, 7
    kv = pool(gen, layout="collection", page_size=p, num_kv_heads=2, head_dim=128, dtype=cache_dtype,
              num_pages=pages)
    q = randn(gen, (4, 8, 128), torch.bfloat16, "cuda")
    ix = listed_tokens(gen, 4, 2, 1000, pages * p)
    run_sparse(kv, q, ix, pages * p, what="long list")


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_sparse_cuda_unaligned_rows_plain_loads(cache_dtype):
    """Rows that are not 16-byte aligned (K/V interleaved with an 8-channel pad: FP8 rows of 136
    bytes; bf16 from a base one element in): cp.async's plain-load path; gather4 does not fit."""
    gen = generator(seed_from("sparse-unaligned", str(cache_dtype)))
    pages, p = 10, 16
    kv = pool(gen, page_size=p, num_kv_heads=2, head_dim=128, dtype=cache_dtype, num_pages=pages, noncontig=True)
    k, v, ks, vs = kv.views
    if cache_dtype == torch.bfloat16:  # shift the base by one element: 2-byte aligned rows
        wide = torch.full((pages, p, 2, 129), float("nan"), dtype=cache_dtype, device="cuda")
        wide[..., 1:].copy_(k)
        k = wide[..., 1:]
    q = randn(gen, (3, 8, 128), torch.bfloat16, "cuda")
    ix = listed_tokens(gen, 3, 2, 50, pages * p).cuda()
    for loader in SPARSE_LOADERS:
        if not _C.cuda_loader_available(torch.cuda.current_device(), loader):
            continue
        _C.set_cuda_loader(loader)
        args = (k, v, ix, None, ks, vs, 32)
        try:
            out = pagedkv.flash_attn_paged_sparse(q, *args)
        except RuntimeError as e:
            assert loader == 2 and "does not fit" in str(e), str(e)
            continue
        expected = ref.flash_attn_paged_sparse(q.double(), k, v, as_listed(ix.cpu(), pages * p).cuda(), *args[3:])
        assert_attention_close(out, expected, torch.bfloat16, LOADER_NAMES[loader])


@pytest.mark.parametrize("cache_dtype", CACHE_KINDS, ids=dtype_name)
def test_sparse_cuda_float32_queries_keep_float32_accuracy(cache_dtype):
    """The tiled kernel computes in fp32 from the staged bytes (FP8 decoded and scaled exactly), so
    float32 queries meet float32's tolerance."""
    gen = generator(seed_from("sparse-f32", str(cache_dtype)))
    pages, p = 12, 16
    kv = pool(gen, page_size=p, num_kv_heads=2, head_dim=64, dtype=cache_dtype, num_pages=pages)
    q = randn(gen, (4, 8, 64), torch.float32, "cuda")
    ix = listed_tokens(gen, 4, 2, 40, pages * p)
    run_sparse(kv, q, ix, pages * p, what="float32 q")


@pytest.mark.parametrize("cache_dtype", CACHE_KINDS, ids=dtype_name)
def test_sparse_cuda_tiled_and_portable_kernels_agree(cache_dtype):
    gen = generator(seed_from("sparse-kernels", str(cache_dtype)))
    pages, p = 20, 16
    kv = pool(gen, page_size=p, num_kv_heads=2, head_dim=128, dtype=cache_dtype, num_pages=pages)
    q = randn(gen, (5, 8, 128), torch.bfloat16, "cuda")
    ix = listed_tokens(gen, 5, 2, 90, pages * p).cuda()
    args = (q, kv.k_cache, kv.v_cache, ix, None, kv.k_scales, kv.v_scales, 32, 3.0)
    tiled = pagedkv.flash_attn_paged_sparse(*args)
    pagedkv.set_kernel_options(cuda_sparse_kernel="portable")
    portable = pagedkv.flash_attn_paged_sparse(*args)
    assert_attention_close(tiled, portable.double(), torch.bfloat16, "tiled vs portable")


def test_sparse_cuda_forced_loader_that_does_not_apply_raises():
    """tma-pages loads whole page chunks: no sparse loader; a float32 cache has no tiled kernel."""
    gen = generator(seed_from("sparse-forced"))
    kv = pool(gen, page_size=16, num_kv_heads=1, head_dim=64, dtype=torch.float32, num_pages=4)
    q = randn(gen, (2, 2, 64), torch.float32, "cuda")
    ix = torch.tensor([[[1, 2, -1]], [[3, -1, -1]]], dtype=torch.int32, device="cuda")
    _C.set_cuda_loader(1)
    with pytest.raises(RuntimeError, match="does not fit"):
        pagedkv.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, ix)
    _C.set_cuda_loader(0)
    with pytest.raises(RuntimeError, match="does not fit"):
        pagedkv.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, ix)
    _C.set_cuda_loader(-1)  # auto: the portable kernel serves float32
    out = pagedkv.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, ix)
    assert_attention_close(out, ref.flash_attn_paged_sparse(q.double(), kv.k_cache, kv.v_cache, ix), torch.float32)


def test_sparse_cuda_checks_on_reject_out_of_range_entries():
    """CONTRACT: out-of-range entries are index errors on CUDA with checks on (checks off: skipped)."""
    pagedkv.set_checks(True)
    gen = generator(seed_from("sparse-checks"))
    kv = pool(gen, page_size=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, num_pages=4)
    q = randn(gen, (2, 4, 64), torch.bfloat16, "cuda")
    for bad in (16, -2):
        ix = torch.tensor([[[1, 2], [3, -1]], [[5, bad], [0, 1]]], dtype=torch.int32, device="cuda")
        with pytest.raises(RuntimeError, match=r"indices\[1, 0, 1\]"):
            pagedkv.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, ix)


def test_sparse_cuda_graph_replay_with_new_lists():
    """Captured once, replayed with other lists: no host sync, the same result as eager."""
    gen = generator(seed_from("sparse-graph"))
    pages, p = 20, 16
    kv = pool(gen, page_size=p, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, num_pages=pages)
    q = randn(gen, (4, 8, 128), torch.bfloat16, "cuda")
    ix = listed_tokens(gen, 4, 2, 64, pages * p, bad_entries=False).cuda()
    ops = torch.ops.pagedkv
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            ops.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, ix)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, ix)
    for seed in range(3):
        ix.copy_(listed_tokens(generator(seed), 4, 2, 64, pages * p, bad_entries=False))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ops.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, ix), atol=0, rtol=0)
