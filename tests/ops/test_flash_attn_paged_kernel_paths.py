"""flash_attn_paged on every device against pagedkv.reference along the kernels' tile and split
paths: decode, prefill and chunked prefill, window and softcap, layouts, FP8 groups, long split-KV
decode; then what only CUDA has: each K/V loader (cp.async, TMA pages, TMA gather4), one split over
many key tiles, CUDA graph replay, the shared-memory tile image, the host checks.

Tolerances (conftest.attention_tolerance) and the CUDA skips (conftest.supported_or_skip) are those
of test_flash_attn_paged.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

pytestmark = pytest.mark.usefixtures("cuda_knobs")

# ---------------------------------------------------------------------------------------------
# decode, prefill and option grids of the CUDA kernels' tile/split paths, on every device


def attend(device, rows, *, page_size=16, num_kv_heads=2, head_dim=128, cache_dtype=torch.bfloat16,
           q_heads=4, q_dtype=torch.bfloat16, layout="separate", quant_group=128, padding=0,
           q_scale=1.0, seed=(), **options):
    """Fill a cache for `rows` through the reference store, attend with random queries on
    `device` and compare with the reference. Returns the output."""
    gen = generator(seed_from("attend", *seed))
    kv, batch = make_setup(gen, rows, layout=layout, page_size=page_size, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, dtype=cache_dtype, quant_group=quant_group,
                           padding=padding, device=device)
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, q_heads, head_dim), q_dtype, device, scale=q_scale)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=quant_group, **options)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, **kwargs)
    expected = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert_attention_close(out, expected, q_dtype, f"rows {rows} {options}", q16_on_cuda=True)
    return out


Q16_DTYPES = (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("q_dtype", Q16_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("kv_kind", ["same", "e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 5])
def test_flash_attn_paged_decode_grid(device, head_dim, q_dtype, kv_kind, page_size):
    """One new token per row over 0 .. 300 cached keys, two padding rows."""
    cache_dtype = {"same": q_dtype, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kv_kind]
    out = attend(device, [(0, 1), (37, 1), (300, 1), (129, 1)], page_size=page_size,
                 head_dim=head_dim, cache_dtype=cache_dtype, q_heads=8, q_dtype=q_dtype,
                 quant_group=128 if head_dim != 96 else 32, padding=2,
                 seed=("decode", head_dim, str(q_dtype), kv_kind, page_size))
    assert bool((out[-2:] == 0).all()), "padding rows must be zeros"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("q_dtype", Q16_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("q_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_paged_prefill_and_chunked_prefill(device, head_dim, q_dtype, q_heads, num_kv_heads,
                                                      causal):
    """Row 0: fresh prefill, row 1: chunk appended to a prefix, row 2: empty, row 3: long chunk."""
    attend(device, [(0, 70), (100, 33), (7, 0), (30, 150)], num_kv_heads=num_kv_heads,
           head_dim=head_dim, cache_dtype=q_dtype, q_heads=q_heads, q_dtype=q_dtype, padding=3,
           causal=causal, seed=("prefill", head_dim, str(q_dtype), q_heads, num_kv_heads, causal))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window_left", [0, 5, 64])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_flash_attn_paged_window_and_softcap(device, window_left, softcap):
    attend(device, [(10, 40), (200, 1)], q_scale=4.0, window_left=window_left, softcap=softcap,
           seed=("window", window_left, softcap))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["separate", "collection", "continuous"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_flash_attn_paged_layouts_mixed_rows(device, layout, cache_dtype):
    attend(device, [(20, 3), (64, 1), (0, 17)], layout=layout, cache_dtype=cache_dtype,
           seed=("layouts", layout, str(cache_dtype)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant_group", [16, 32, 100, 128, 1000])
def test_flash_attn_paged_fp8_groups(device, quant_group):
    attend(device, [(50, 2), (3, 9)], num_kv_heads=1, cache_dtype=torch.float8_e4m3fn, q_heads=2,
           q_dtype=torch.float16, quant_group=quant_group, seed=("groups", quant_group))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=dtype_name)
def test_flash_attn_paged_nan_in_unused_slots_never_reaches_output(device, cache_dtype):
    """Unwritten slots (tails of last pages, spare pages) hold NaN; outputs stay finite."""
    out = attend(device, [(13, 1), (1, 1), (0, 5)], cache_dtype=cache_dtype,
                 seed=("nan-unused", str(cache_dtype)))
    assert bool(torch.isfinite(out.float()).all())


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_long_decode_split_kv(device):
    """B = 1 with a long row: split-KV plus the log-sum-exp merge (on CUDA) must match."""
    attend(device, [(20_000, 1)], num_kv_heads=1, q_heads=8, seed=("long-decode",))


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_out_variant_strided_q(device):
    """q sliced out of a wider tensor (rows not 16-byte aligned), written into a given `out`."""
    gen = generator(seed_from("out-strided-q"))
    kv, batch = make_setup(gen, [(9, 4), (40, 2)], layout="separate", page_size=16, num_kv_heads=2,
                           head_dim=64, dtype=torch.float16, device=device)
    fill_history(gen, kv, batch)
    base = randn(gen, (batch.num_tokens, 8, 96), torch.float16, device)
    q = base[:, :, 16:80]
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
    out = torch.full((batch.num_tokens, 8, 64), 9.0, dtype=torch.float16, device=device)
    supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, out=out)
    assert_attention_close(out, ref.flash_attn_paged(q.double(), *args), torch.float16, "out, strided q")


# ---------------------------------------------------------------------------------------------
# CUDA only: the K/V loaders, CUDA graphs, the shared-memory tile image, host checks

LOADERS = (0, 1, 2)  # cp.async, tma-pages, tma-gather4
LOADER_NAMES = {0: "cp.async", 1: "tma-pages", 2: "tma-gather4"}


def available_loaders(device=0):
    return [loader for loader in LOADERS if _C.cuda_loader_available(device, loader)]


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("page_size", [16, 64, 128, 3])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_flash_attn_paged_cuda_each_loader_matches(loader, page_size, cache_dtype):
    if loader not in available_loaders():
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    _C.set_cuda_loader(loader)
    try:
        attend("cuda", [(0, 40), (77, 1), (130, 2)], page_size=page_size, cache_dtype=cache_dtype,
               q_heads=8, seed=("loader", loader, page_size, str(cache_dtype)))
    except RuntimeError as e:  # this page size does not fit the TMA loader
        assert "does not fit" in str(e)


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_flash_attn_paged_cuda_one_split_many_tiles(loader, page_size, head_dim, cache_dtype):
    """cuda_splits=1 (PAGEDKV_CUDA_SPLITS=1): every CTA runs all its keys, >= 4 key tiles here (decode over
    1000+ keys, a causal prefill chunk of 70 rows after 300 keys), so the pipeline's buffer reuse, FP8 conversion
    buffers and barrier parity flips run, with every loader that fits."""
    if loader not in available_loaders():
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    pagedkv.set_kernel_options(cuda_splits=1)
    _C.set_cuda_loader(loader)
    try:
        attend("cuda", [(1100, 1), (300, 70), (777, 1)], page_size=page_size, head_dim=head_dim,
               cache_dtype=cache_dtype, q_heads=8, seed=("one split", loader, page_size, head_dim, str(cache_dtype)))
    except RuntimeError as e:  # this page size does not fit the TMA loader
        assert "does not fit" in str(e)


@CUDA_ONLY
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("q_dtype", Q16_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
def test_flash_attn_paged_cuda_fp8_row_scales(page_size, head_dim, q_dtype, cache_dtype):
    """FP8 tiles with one scale per row convert through the statically shaped, hardware-cvt path (scales
    staged a tile ahead): decode rows (the key split), a prefill chunk and rows of many tiles against the
    reference; the same rows with scale groups of 32 (the generic conversion) as well."""
    rows = [(1100, 1), (300, 70), (0, 1), (37, 1)]
    for group in (head_dim, 32):
        attend("cuda", rows, page_size=page_size, head_dim=head_dim, cache_dtype=cache_dtype, q_dtype=q_dtype,
               q_heads=8, quant_group=group, seed=("fp8 row scales", page_size, head_dim, group, str(q_dtype),
                                                    str(cache_dtype)))


def attend_splits_windows(rows, splits_windows, **case):
    """Attend on CUDA against the reference for each (splits, window) of splits_windows (splits 0: the
    plan's own count). Skips where the forced loader does not fit the page size."""
    for splits, window in splits_windows:
        pagedkv.set_kernel_options(cuda_splits=splits)
        seed = (splits, window, *(f"{k}={v}" for k, v in sorted(case.items())))
        try:
            attend("cuda", rows, window_left=window, seed=seed, **case)
        except RuntimeError as e:  # this page size does not fit the TMA loader
            assert "does not fit" in str(e)
            pytest.skip("the forced loader does not fit this page size")


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("q_dtype", Q16_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
def test_flash_attn_paged_cuda_fp8_decode_k_fragments(loader, page_size, head_dim, q_dtype, cache_dtype):
    """FP8 decode with one scale per row (a key split: each warp builds its K operands from the raw FP8
    tile, unscaled, and multiplies each key's scores by its scale; only V is converted): decode rows with
    page tails, a window that hides the head of a tile, split-KV and one split, sharp softmaxes (queries
    x 3), against the reference."""
    if loader not in available_loaders():
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    _C.set_cuda_loader(loader)
    attend_splits_windows([(1100, 1), (0, 1), (37, 1), (300, 1)], ((0, -1), (1, -1), (1, 23)),
                          page_size=page_size, head_dim=head_dim, cache_dtype=cache_dtype, q_dtype=q_dtype,
                          q_heads=8, quant_group=head_dim, q_scale=3.0)


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim, dtype", [(64, torch.bfloat16), (96, torch.float16), (128, torch.bfloat16),
                                             (128, torch.float16), (256, torch.bfloat16)],
                         ids=lambda x: dtype_name(x) if isinstance(x, torch.dtype) else str(x))
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_paged_cuda_prefill_128_row_tiles(loader, page_size, head_dim, dtype, causal):
    """Prefill-like batches (>= 128 packed rows per batch row) on 16-bit caches run 128-row query tiles
    (two 16-row m-blocks per warp sharing each K/V fragment, a tile's keys in two softmax steps; head size
    256 keeps the 64-row tiles), with a decode row and a short chunk among them (warp 0 alone, rows past
    the tile's end), page tails, one split, split-KV and windows: against the reference."""
    if loader not in available_loaders():
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    _C.set_cuda_loader(loader)
    rows = [(300, 70), (0, 200), (777, 1), (5, 130), (64, 3)]  # 404 x 4 packed rows >= 128 per batch row
    attend_splits_windows(rows, ((0, -1), (1, -1), (3, -1), (1, 23), (3, 100)), page_size=page_size,
                          head_dim=head_dim, cache_dtype=dtype, q_dtype=dtype, q_heads=8, causal=causal)


@CUDA_ONLY
@pytest.mark.parametrize("step", [1.0, 4.0, 100.0, 300.0])
def test_flash_attn_paged_cuda_prefill_128_row_tiles_rising_scores(step):
    """128-row query tiles keep each row's running maximum until a half tile's maximum passes it by more
    than 8 (log2 units) and rescale O only when a row of the warp moved it: scores rising by `step` per
    64 keys (conftest.rising_scores, a 300-token chunk and a decode token over 300 cached keys) move it by
    less than that (1, 4) or by far more (100, 300: every rescale factor below 2^-126), bf16 queries,
    against the float64 reference."""
    args = rising_scores(torch.bfloat16, step, "cuda", new=(300, 1))
    out = pagedkv.flash_attn_paged(*args)
    cpu_args = [t.cpu() for t in args]
    expected = ref.flash_attn_paged(cpu_args[0].double(), *cpu_args[1:])
    assert_attention_close(out, expected, torch.bfloat16, f"128-row tiles, scores rising {step} per tile")


@CUDA_ONLY
@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("splits", [0, 1])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_flash_attn_paged_cuda_nan_before_every_window(loader, page_size, splits, cache_dtype):
    """Sliding window, with NaN keys, values and scales in every slot that no query of its row can see
    (a recycled page), whole pages and the head of a page: the kernels mask keys before a tile's first
    window key like keys past the end (zeroed, never scored), so no 0 * NaN reaches P V, and a TMA box
    that starts on such a key still loads the visible keys after it. Each loader, with and without
    split-KV; finite output equal to the reference."""
    if loader not in available_loaders():
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    pagedkv.set_kernel_options(cuda_splits=splits)
    _C.set_cuda_loader(loader)
    rows, window = [(300, 1), (100, 30), (1100, 1), (20, 2)], 23
    gen = generator(seed_from("nan before window", loader, page_size, splits, str(cache_dtype)))
    kv, batch = make_setup(gen, rows, layout="separate", page_size=page_size, num_kv_heads=2, head_dim=128,
                           dtype=cache_dtype, device="cuda")
    fill_history(gen, kv, batch)
    for b, (cached, _) in enumerate(rows):  # row b's first query sits at `cached` and sees keys >= cached - window
        keys = torch.arange(max(cached - window, 0), device="cuda")
        pages, slots = batch.lookup_table[b, keys // page_size].long(), keys % page_size
        for t in (kv.k_cache, kv.v_cache, kv.k_scales, kv.v_scales):
            if t is not None:
                t[pages, slots] = float("nan")
    q = randn(gen, (batch.num_tokens, 8, 128), torch.bfloat16, "cuda")
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, window_left=window)
    try:
        out = pagedkv.flash_attn_paged(q, *args, **kwargs)
    except RuntimeError as e:  # this page size does not fit the TMA loader
        assert "does not fit" in str(e)
        pytest.skip("the forced loader does not fit this page size")
    expected = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert torch.isfinite(expected).all()
    assert_attention_close(out, expected, torch.bfloat16, f"NaN before the window, {LOADER_NAMES[loader]}")


@CUDA_ONLY
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=dtype_name)
def test_flash_attn_paged_cuda_float32_queries_run_as_16_bit(cache_dtype):
    """Float32 queries on CUDA attend through a 16-bit copy (the cache's dtype, bf16 for FP8): the
    output is float32 and equals, bit for bit, the 16-bit queries' output widened, for the functional,
    .out and _lse variants."""
    gen = generator(seed_from("f32 queries", str(cache_dtype)))
    kv, batch = make_setup(gen, [(0, 5), (300, 1), (40, 3)], layout="separate", page_size=16, num_kv_heads=2,
                           head_dim=128, dtype=cache_dtype, device="cuda")
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 8, 128), torch.float32, "cuda")
    q16 = q.to(torch.float16 if cache_dtype == torch.float16 else torch.bfloat16)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales)
    out = pagedkv.flash_attn_paged(q, *args, **kwargs)
    assert out.dtype == torch.float32
    assert torch.equal(out, pagedkv.flash_attn_paged(q16, *args, **kwargs).float())
    out2 = torch.full_like(out, 7.0)
    pagedkv.flash_attn_paged(q, *args, out=out2, **kwargs)
    assert torch.equal(out2, out)
    out_lse, lse = pagedkv.flash_attn_paged_lse(q, *args, **kwargs)
    out16_lse, lse16 = pagedkv.flash_attn_paged_lse(q16, *args, **kwargs)
    assert torch.equal(out_lse, out16_lse.float()) and torch.equal(lse, lse16)
    assert_attention_close(out, ref.flash_attn_paged(q.double(), *args, **kwargs), torch.float32, "float32 q",
                           q16_on_cuda=True)


@CUDA_ONLY
def test_flash_attn_paged_cuda_unsupported_raises():
    """What the CUDA kernels do not take raises a message naming it (float32 queries over a float32
    cache name the cache: float32 queries run elsewhere; head sizes outside the tiled kernels' list run
    on the portable kernel up to 576)."""
    gen = generator(seed_from("unsupported"))
    for head_dim, q_dtype, cache_dtype, message in [
            (128, torch.float32, torch.float32, "float32 caches are not supported on CUDA"),
            (128, torch.bfloat16, torch.float32, "float32 caches are not supported on CUDA"),
            (640, torch.bfloat16, torch.bfloat16, "head sizes D = 640, Dv = 640 are not supported on CUDA")]:
        kv, batch = make_setup(gen, [(4, 1)], layout="separate", page_size=16, num_kv_heads=1,
                               head_dim=head_dim, dtype=cache_dtype, device="cuda")
        fill_history(gen, kv, batch)
        q = randn(gen, (1, 1, head_dim), q_dtype, "cuda")
        with pytest.raises(RuntimeError, match=message):
            pagedkv.flash_attn_paged(q, batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                     batch.cache_lengths, batch.lookup_table)


@CUDA_ONLY
def test_flash_attn_paged_cuda_graph_decode_replay_with_new_lengths():
    d, hq, hk, b, p = 128, 8, 2, 4, 16
    gen = generator(seed_from("cuda-graph"))
    replays = ([100, 5, 60, 250], [1, 31, 0, 17], [255, 200, 128, 2])
    # history written up to each row's longest replay: a replay must not see unwritten (NaN-poisoned)
    # slots, whose NaN outputs would never compare equal
    longest = [max(lengths[i] for lengths in replays) for i in range(b)]
    kv, batch = make_setup(gen, [(n, 1) for n in longest], layout="separate", page_size=p,
                           num_kv_heads=hk, head_dim=d, dtype=torch.bfloat16, device="cuda")
    fill_history(gen, kv, batch)
    ops = torch.ops.pagedkv
    k, v, offsets, table = kv.k_cache, kv.v_cache, batch.input_row_offsets, batch.lookup_table
    q = torch.randn((b, hq, d), device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    lengths = torch.tensor(replays[0], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture
            ops.flash_attn_paged.out(q, offsets, k, v, lengths, table, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.flash_attn_paged.out(q, offsets, k, v, lengths, table, out=out)
    for new_lengths in replays:
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(torch.randn((b, hq, d)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.flash_attn_paged(q, offsets, k, v, lengths, table)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


def expected_tile_image(cache, table, seq_len, b, head, first_key, rows):
    """The layout of tile.cuh: [row_bytes / 128 chunks][rows][128 B], unit j of row r at j ^ (r & 7)."""
    es = cache.element_size()
    d = cache.shape[-1]
    row_bytes = math.ceil(d * es / 128) * 128
    img = torch.zeros((row_bytes // 128, rows, 8, 16), dtype=torch.uint8)
    n_pages, p = cache.shape[0], cache.shape[1]
    for r in range(rows):
        key = first_key + r
        if key >= seq_len:
            continue
        page = int(table[b, key // p])
        if page < 0 or page >= n_pages:
            continue
        raw = cache[page, key % p, head].contiguous().view(torch.uint8)
        for j in range(d * es // 16):
            img[j // 8, r, (j % 8) ^ (r % 8)] = raw[16 * j: 16 * j + 16]
    # flatten to the kernel's [rows, row_bytes] view of the same bytes
    return img.reshape(-1).reshape(rows, row_bytes)


@CUDA_ONLY
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_flash_attn_paged_cuda_tile_image_same_for_every_loader(cache_dtype, page_size, d):
    gen = generator(seed_from("tile-image", str(cache_dtype), page_size, d))
    kv, batch = make_setup(gen, [(150, 0), (70, 0)], layout="separate", page_size=page_size,
                           num_kv_heads=2, head_dim=d, dtype=cache_dtype)
    fill_history(gen, kv, batch)  # unwritten slots keep their NaN
    table = batch.lookup_table.clone()
    table[0, 1] = 10_000  # an out-of-range page id inside the row: masked rows read as zeros
    rows = 64 if d <= 128 else 32
    cache_gpu, table_gpu, lens_gpu = kv.k_cache.cuda(), table.cuda(), batch.cache_lengths.cuda()
    for first_key in (0, rows, 128):
        want = expected_tile_image(kv.k_cache, table, int(batch.cache_lengths[0]), 0, 1, first_key, rows)
        for loader in available_loaders():
            try:
                got = torch.ops.pagedkv.debug_load_tile(cache_gpu, table_gpu, lens_gpu, 0, 1, first_key, loader)
            except RuntimeError as e:
                assert "not supported" in str(e) or "does not fit" in str(e)
                continue
            assert torch.equal(got.cpu().reshape(-1), want.reshape(-1)), LOADER_NAMES[loader]


@CUDA_ONLY
def test_flash_attn_paged_cuda_checks_raise():
    """PAGEDKV_CHECK=1 on CUDA: a page id past the pool raises on the host."""
    pagedkv.set_checks(True)
    k = torch.zeros((4, 8, 1, 64), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([0], dtype=torch.int32, device="cuda")
    bad_table = torch.tensor([[7]], dtype=torch.int32, device="cuda")
    q = torch.randn((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="lookup_table"):
        torch.ops.pagedkv.flash_attn_paged(q, offsets, k, k, lengths, bad_table)
