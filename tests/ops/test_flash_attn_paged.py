"""flash_attn_paged (and its .out variant) on every device against pagedkv.reference: the grid,
its error cases, opcheck, CUDA-only behaviour (loaders, graphs, tile image, host checks), and the
seeded fuzz chunks.

Attention is compared with the float64 reference within conftest.attention_tolerance: 1e-5
(float32 queries) or 2e-2 (float16/bfloat16 queries) per-row relative L2 error; rows the reference
zeroes (no visible key, padding) must be exactly zero. The CUDA kernels run the same grids at the
same tolerance (16-bit queries only: float32 queries and head sizes outside 64/96/128/256 are not
implemented there and skip, see conftest.supported_or_skip). Caches start as NaN, so a read of an
unused slot, page or neighbouring layer shows up as a non-finite output.
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedkv
from conftest import (
    CACHE_DTYPES,
    CUDA_ONLY,
    DEVICES,
    FLOAT_DTYPES,
    LAYOUTS,
    assert_attention_close,
    dtype_name,
    fill_history,
    generator,
    make_setup,
    ragged_inputs,
    randn,
    seed_from,
    strided_index_tensors,
    supported_or_skip,
)
from error_cases import D, G, HK, P, expect_error, ids, index_errors, set_, setup_call, strided_last, _with
from fuzz_cases import CHUNKS
from fuzz_op_cases import cases_for, chunks, run_chunk
from grid_cases import (
    GQA_RATIOS,
    HEAD_DIMS,
    NUM_KV_HEADS,
    OPCHECK_DTYPES,
    PAGE_SIZES,
    QUANT_GROUPS,
    RANDOM_SAMPLES,
    build_cases,
    case_id,
    normalize,
    opcheck,
    params,
    rows_for,
    small_setup,
)
from pagedkv import _C
from pagedkv import reference as ref

pytestmark = pytest.mark.usefixtures("cuda_knobs")

# ---------------------------------------------------------------------------------------------
# grid

ATTN_AXES = {
    "q_dtype": FLOAT_DTYPES,
    "cache_dtype": CACHE_DTYPES,
    "head_dim": HEAD_DIMS,
    "page_size": PAGE_SIZES,
    "gqa": GQA_RATIOS,
    "layout": LAYOUTS,
    "noncontig": (False, True),
    "quant_group": QUANT_GROUPS,
    "causal": (True, False),
    "window_left": (-1, 0, 5),
    "softcap": (0.0, 1.5),
    "scale": (None, 0.3),
}
ATTN_BASE = dict(
    q_dtype=torch.float32, cache_dtype=torch.bfloat16, head_dim=128, page_size=16, gqa=4,
    layout="collection", noncontig=False, quant_group=128, causal=True, window_left=-1,
    softcap=0.0, scale=None,
)
ATTN_CASES = build_cases(
    ATTN_BASE,
    ATTN_AXES,
    crosses=[
        ("q_dtype", "cache_dtype"),
        ("cache_dtype", "head_dim", "quant_group"),
        ("layout", "page_size", "noncontig"),
        ("causal", "window_left", "softcap", "scale"),
        ("gqa", "head_dim"),
    ],
    samples=RANDOM_SAMPLES,
    seed=3,
)


def run_attention(case, device, unused="random", rows=None, padding=3, use_out=False):
    gen = generator(seed_from("attn", case_id(case)))
    rows = rows_for(case["page_size"]) if rows is None else rows
    kv, batch = make_setup(
        gen, rows, layout=case["layout"], page_size=case["page_size"], num_kv_heads=NUM_KV_HEADS,
        head_dim=case["head_dim"], dtype=case["cache_dtype"], quant_group=case["quant_group"],
        noncontig=case["noncontig"], padding=padding, unused=unused, device=device,
    )
    kv.poison_("nan")
    fill_history(gen, kv, batch, case["q_dtype"])
    q = ragged_inputs(gen, batch.num_tokens, NUM_KV_HEADS * case["gqa"], case["head_dim"],
                      case["q_dtype"], device, case["noncontig"])
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table, case["scale"], case["causal"], kv.k_scales, kv.v_scales,
            case["quant_group"], case["window_left"], case["softcap"])
    if use_out:
        out = torch.full((q.shape[0], q.shape[1], case["head_dim"] + 8), float("nan"),
                         dtype=q.dtype, device=device)[..., : case["head_dim"]]
        result = supported_or_skip(device, pagedkv.flash_attn_paged, *args, out=out)
        assert result.data_ptr() == out.data_ptr()
    else:
        out = supported_or_skip(device, pagedkv.flash_attn_paged, *args)
    expected = ref.flash_attn_paged(q.to(torch.float64), *args[1:])
    assert_attention_close(out, expected, case["q_dtype"], f"flash_attn_paged {case_id(case)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(ATTN_CASES))
def test_flash_attn_paged(device, case):
    run_attention(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_attn_paged_ignores_unused_table_entries(device, layout):
    run_attention(normalize({**ATTN_BASE, "layout": layout}), device, unused="garbage")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", FLOAT_DTYPES, ids=dtype_name)
def test_flash_attn_paged_out_variant(device, q_dtype):
    case = {**ATTN_BASE, "q_dtype": q_dtype, "cache_dtype": torch.float8_e4m3fn, "head_dim": 64,
            "quant_group": 32}
    run_attention(case, device, use_out=True)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_edge_batches(device):
    case = {**ATTN_BASE, "head_dim": 64, "gqa": 1}
    run_attention(case, device, rows=[], padding=3)  # B = 0: all padding -> zeros
    run_attention(case, device, rows=[(0, 0), (7, 0)], padding=0)  # T = 0
    run_attention(case, device, rows=[(5, 0), (0, 1), (0, 0)], padding=2)
    # Window 0: every query sees exactly its own key.
    run_attention({**case, "window_left": 0, "causal": False}, device, rows=[(30, 4), (0, 1)])


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_long_sequence(device):
    """A few thousand keys over many small pages (split/merge paths on GPU)."""
    case = {**ATTN_BASE, "q_dtype": torch.bfloat16, "head_dim": 64, "page_size": 2}
    run_attention(case, device, rows=[(3000, 1), (1500, 3), (0, 1)], padding=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=dtype_name)
def test_flash_attn_paged_ignores_nan_outside_window(device, cache_dtype):
    """Sliding window: keys that no query of the row can see (evicted pages) hold NaN, scales
    too; they must not leak into the output. Not spelled out in CONTRACT.md, but a model with a
    sliding window may recycle those pages."""
    gen = generator(seed_from("nan-window", str(cache_dtype)))
    rows, window = [(40, 2), (9, 1)], 3
    kv, batch = make_setup(gen, rows, layout="separate", page_size=4, num_kv_heads=2,
                           head_dim=64, dtype=cache_dtype, quant_group=32, device=device)
    fill_history(gen, kv, batch)
    # Row 0 queries sit at 40 and 41 and see keys >= 37: poison positions 0..35 (pages 0..8).
    evicted = batch.lookup_table[0, :9].long()
    for t in (kv.k_cache, kv.v_cache, kv.k_scales, kv.v_scales):
        if t is not None:
            t[evicted] = float("nan")
    q = randn(gen, (batch.num_tokens, 8, 64), torch.float32, device)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=32,
                  window_left=window)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, **kwargs)
    expected = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert torch.isfinite(expected).all()
    assert_attention_close(out, expected, torch.float32, "NaN outside the window")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_flash_attn_paged_large_logits(device, q_dtype, softcap):
    """Scores in the hundreds: the softmax must subtract the running maximum."""
    gen = generator(seed_from("large-logits", str(q_dtype), softcap))
    kv, batch = make_setup(gen, [(50, 3), (0, 7), (130, 1)], layout="collection", page_size=16,
                           num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device)
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 4, 64), q_dtype, device, scale=300.0)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, softcap=softcap)
    expected = ref.flash_attn_paged(q.double(), *args, softcap=softcap)
    assert_attention_close(out, expected, q_dtype, "large logits")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_many_rows_random_lengths(device):
    """48 rows of random history and 0-3 new tokens, FP8 e5m2 with groups, window, fp16 q."""
    gen = generator(seed_from("many-rows"))
    rows = [(int(torch.randint(0, 300, (1,), generator=gen)),
             int(torch.randint(0, 4, (1,), generator=gen))) for _ in range(48)]
    kv, batch = make_setup(gen, rows, layout="fa3", page_size=8, num_kv_heads=4, head_dim=96,
                           dtype=torch.float8_e5m2, quant_group=32, padding=5, device=device)
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 16, 96), torch.float16, device)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=32, window_left=37)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, **kwargs)
    expected = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert_attention_close(out, expected, torch.float16, "many rows")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_rows_filling_the_table_exactly(device):
    """cache_length + new == max_pages * P: the last slot of the last page, no spare column."""
    gen = generator(seed_from("exact-capacity"))
    rows = [(13, 3), (15, 1), (0, 16)]
    kv, batch = make_setup(gen, rows, layout="collection", page_size=4, num_kv_heads=2,
                           head_dim=64, dtype=torch.float8_e4m3fn, quant_group=32,
                           extra_columns=0, device=device)
    assert batch.lookup_table.shape[1] * 4 == 16
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 4, 64), torch.float32, device)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=32)
    assert_attention_close(supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, **kwargs),
                           ref.flash_attn_paged(q.double(), *args, **kwargs), torch.float32,
                           "exact capacity attention")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_strided_index_tensors(device):
    """A column slice of a preallocated table and lengths/offsets taken from wider metadata."""
    gen = generator(seed_from("strided-index"))
    kv, batch = make_setup(gen, [(5, 3), (0, 4), (9, 1)], layout="separate", page_size=4,
                           num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=device)
    fill_history(gen, kv, batch)
    table, offsets, lengths = strided_index_tensors(batch, device)
    q = randn(gen, (batch.num_tokens, 4, 64), torch.float32, device)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, offsets, kv.k_cache, kv.v_cache,
                            lengths, table)
    expected = ref.flash_attn_paged(q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                    batch.cache_lengths, batch.lookup_table)
    assert_attention_close(out, expected, torch.float32, "strided index tensors")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
def test_flash_attn_paged_nan_value_scale_does_not_leak_into_later_key_tiles(device, q_dtype):
    """A NaN FP8 value scale (what storing a NaN gives) at key 40, sliding window 20, 100 keys: the
    kernels read keys in 64-key tiles (0..63, 64..99). Rows 84..99 see only keys of the second tile and
    must equal the reference computed with that scale made finite; rows that see key 40 are NaN.
    Regression: the short second tile kept key 40's scale in its unused lane 40, and the lane's zero
    probability times NaN poisoned every row of that tile on the AMX path. (Rows sharing a tile with
    the bad key without seeing it may be NaN, as in the reference's 0 * NaN: not asserted.)"""
    torch.manual_seed(3)
    n_new, page, dim, window = 100, 16, 64, 20
    n_pages = (n_new + page - 1) // page
    k, ks = ref.quantize_fp8(torch.randn(n_pages, page, 1, dim), torch.float8_e4m3fn, 128)
    v, vs = ref.quantize_fp8(torch.randn(n_pages, page, 1, dim), torch.float8_e4m3fn, 128)
    q = torch.randn(n_new, 1, dim).to(q_dtype)  # one query head: all 100 rows in one work item
    offsets = torch.tensor([0, n_new], dtype=torch.int32)
    lengths = torch.tensor([0], dtype=torch.int32)
    table = torch.arange(n_pages, dtype=torch.int32).view(1, -1)
    vs_bad = vs.clone()
    vs_bad[40 // page, 40 % page] = float("nan")
    args = [t.to(device) for t in (q, offsets, k, v, lengths, table)]
    got = supported_or_skip(device, pagedkv.flash_attn_paged, *args, k_scales=ks.to(device),
                            v_scales=vs_bad.to(device), quant_group=128, window_left=window)
    want = ref.flash_attn_paged(q, offsets, k, v, lengths, table, k_scales=ks, v_scales=vs,
                                quant_group=128, window_left=window)
    got = got.cpu()
    assert torch.isnan(got[40:41 + window]).all(), "rows that see the NaN value must be NaN"
    tol = 2e-2 if q_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got[84:].float(), want[84:].float(), atol=tol, rtol=tol)


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
    assert_attention_close(out, expected, q_dtype, f"rows {rows} {options}")
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
def test_flash_attn_paged_cuda_one_split_many_tiles(monkeypatch, loader, page_size, head_dim, cache_dtype):
    """PAGEDKV_CUDA_SPLITS=1: every CTA runs all its keys, >= 4 key tiles here (decode over 1000+ keys,
    a causal prefill chunk of 70 rows after 300 keys), so the pipeline's buffer reuse, FP8 conversion
    buffers and barrier parity flips run, with every loader that fits."""
    if loader not in available_loaders():
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    monkeypatch.setenv("PAGEDKV_CUDA_SPLITS", "1")
    _C.set_cuda_loader(loader)
    try:
        attend("cuda", [(1100, 1), (300, 70), (777, 1)], page_size=page_size, head_dim=head_dim,
               cache_dtype=cache_dtype, q_heads=8, seed=("one split", loader, page_size, head_dim, str(cache_dtype)))
    except RuntimeError as e:  # this page size does not fit the TMA loader
        assert "does not fit" in str(e)


@CUDA_ONLY
def test_flash_attn_paged_cuda_unsupported_raises():
    gen = generator(seed_from("unsupported"))
    for head_dim, q_dtype in [(128, torch.float32), (80, torch.bfloat16)]:
        kv, batch = make_setup(gen, [(4, 1)], layout="separate", page_size=16, num_kv_heads=1,
                               head_dim=head_dim, dtype=torch.bfloat16, device="cuda")
        fill_history(gen, kv, batch)
        q = randn(gen, (1, 1, head_dim), q_dtype, "cuda")
        with pytest.raises(RuntimeError, match="not supported on CUDA"):
            pagedkv.flash_attn_paged(q, batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                     batch.cache_lengths, batch.lookup_table)


@CUDA_ONLY
def test_flash_attn_paged_cuda_graph_decode_replay_with_new_lengths():
    d, hq, hk, b, p = 128, 8, 2, 4, 16
    gen = generator(seed_from("cuda-graph"))
    kv, batch = make_setup(gen, [(100, 1), (5, 1), (60, 1), (250, 1)], layout="separate", page_size=p,
                           num_kv_heads=hk, head_dim=d, dtype=torch.bfloat16, device="cuda")
    fill_history(gen, kv, batch)
    ops = torch.ops.pagedkv
    k, v, offsets, table = kv.k_cache, kv.v_cache, batch.input_row_offsets, batch.lookup_table
    q = torch.randn((b, hq, d), device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    lengths = batch.cache_lengths.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture
            ops.flash_attn_paged.out(q, offsets, k, v, lengths, table, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.flash_attn_paged.out(q, offsets, k, v, lengths, table, out=out)
    for new_lengths in ([100, 5, 60, 250], [1, 31, 0, 17], [255, 200, 128, 2]):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(torch.randn((b, hq, d)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.flash_attn_paged(q, offsets, k, v, lengths, table)
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


# ---------------------------------------------------------------------------------------------
# errors


def attn_call(device, dtype=torch.float8_e4m3fn):
    gen, kv, batch = setup_call(device, dtype)
    args = dict(
        q=randn(gen, (batch.num_tokens, 2 * HK, D), torch.float32, device),
        input_row_offsets=batch.input_row_offsets, k_cache=kv.k_cache, v_cache=kv.v_cache,
        cache_lengths=batch.cache_lengths, lookup_table=batch.lookup_table, scale=None,
        causal=True, k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=G, window_left=-1,
        softcap=0.0,
    )
    return kv, args


ATTN_ERRORS = index_errors("input_row_offsets", "cache_lengths", "k_cache") + [
    ("cache_lengths negative", set_("cache_lengths", lambda t, a: _with(t, (1,), -1)),
     ["cache_lengths"], []),
    ("length past max_pages*P", set_("cache_lengths", lambda t, a: _with(t, (0,), 9)),
     ["cache_lengths", "lookup_table"], []),
    ("T < offsets[B]", set_("q", lambda t, a: t[:5]), ["input_row_offsets", "q"], []),
    ("q 2-D", set_("q", lambda t, a: t[:, 0]), ["q"], []),
    ("q float64", set_("q", lambda t, a: t.double()), ["q"], []),
    ("q int64", set_("q", lambda t, a: t.long()), ["q"], []),
    ("q fp8", set_("q", lambda t, a: t.to(torch.float8_e5m2)), ["q"], []),
    ("q head size", set_("q", lambda t, a: t[..., :16]), ["q"], []),
    ("Hq % Hk != 0", set_("q", lambda t, a: t[:, :3]), ["q"], []),
    ("q stride(-1) != 1", set_("q", lambda t, a: strided_last(t)), ["q"], []),
    ("k_cache 5-D", set_("k_cache", lambda t, a: t[None]), ["k_cache"], []),
    ("k_cache stride(-1) != 1", set_("k_cache", lambda t, a: strided_last(t)), ["k_cache"], []),
    ("v_cache stride(-1) != 1", set_("v_cache", lambda t, a: strided_last(t)), ["v_cache"], []),
    ("v_cache N mismatch", set_("v_cache", lambda t, a: t[:-1]), ["v_cache"], []),
    ("v_cache Hk mismatch", set_("v_cache", lambda t, a: t[:, :, :1]), ["v_cache"], []),
    ("v_cache dtype", set_("v_cache", lambda t, a: torch.zeros(t.shape, dtype=torch.int16,
                                                               device=t.device)), ["v_cache"], []),
    ("k_scales missing", set_("k_scales", lambda t, a: None), ["k_scales"], []),
    ("v_scales missing", set_("v_scales", lambda t, a: None), ["v_scales"], []),
    ("k_scales groups", set_("k_scales", lambda t, a: t[..., :1]), ["k_scales"], []),
    ("v_scales P", set_("v_scales", lambda t, a: t[:, :1]), ["v_scales"], []),
    ("quant_group 0", set_("quant_group", lambda t, a: 0), ["quant_group"], []),
    ("window_left -2", set_("window_left", lambda t, a: -2), ["window_left"], []),
    ("softcap negative", set_("softcap", lambda t, a: -1.0), ["softcap"], []),
    ("softcap nan", set_("softcap", lambda t, a: float("nan")), ["softcap"], []),
    ("scale nan", set_("scale", lambda t, a: float("nan")), ["scale"], []),
    ("scale inf", set_("scale", lambda t, a: float("inf")), ["scale"], []),
]

ATTN_OUT_ERRORS = [
    ("out dtype", lambda args: torch.zeros((7, 4, D), dtype=torch.float16), ["out"]),
    ("out tokens", lambda args: torch.zeros((6, 4, D)), ["out"]),
    ("out heads", lambda args: torch.zeros((7, 2, D)), ["out"]),
    ("out head size", lambda args: torch.zeros((7, 4, 16)), ["out"]),
    ("out stride(-1) != 1", lambda args: strided_last(torch.zeros((7, 4, D))), ["out"]),
    ("out 2-D", lambda args: torch.zeros((7, 4 * D)), ["out"]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_ERRORS, ids=ids(ATTN_ERRORS))
def test_flash_attn_paged_errors(device, case):
    _, mutate, names, fragments = case
    kv, args = attn_call(device)
    mutate(args, kv)
    expect_error(device, torch.ops.pagedkv.flash_attn_paged, kv, args, names, fragments)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_extra_scales(device):
    kv, args = attn_call(device, torch.float32)
    args["k_scales"] = torch.ones((kv.num_pages, P, HK, 2), device=device)
    expect_error(device, torch.ops.pagedkv.flash_attn_paged, kv, args, ["k_scales"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_OUT_ERRORS, ids=ids(ATTN_OUT_ERRORS))
def test_flash_attn_paged_out_errors(device, case):
    _, make_out, names = case
    kv, args = attn_call(device)
    args["out"] = make_out(args).to(device)
    expect_error(device, torch.ops.pagedkv.flash_attn_paged.out, kv, args, names)


@CUDA_ONLY
@pytest.mark.parametrize("moved", ["q", "lookup_table", "cache_lengths", "input_row_offsets",
                                   "v_cache", "v_scales"])
def test_flash_attn_paged_mixed_devices(moved):
    kv, args = attn_call("cuda")
    args[moved] = args[moved].cpu()
    expect_error("cuda", torch.ops.pagedkv.flash_attn_paged, kv, args, [moved, "device"])


# ---------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("overload", ["default", "out"])
def test_opcheck_flash_attn_paged(device, dtype, overload):
    gen, kv, batch = small_setup(device, dtype)
    q = randn(gen, (batch.num_tokens, 4, 32), torch.float32, device)
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table, 0.2, True, kv.k_scales, kv.v_scales, 16, -1, 0.0)
    if overload == "default":
        supported_or_skip(device, opcheck, torch.ops.pagedkv.flash_attn_paged.default, args, cache_dtype=dtype)
    else:
        out = torch.empty((q.shape[0], 4, 32), device=device)
        supported_or_skip(device, opcheck, torch.ops.pagedkv.flash_attn_paged.out, args, {"out": out},
                          cache_dtype=dtype)


# ---------------------------------------------------------------------------------------------
# seeded fuzz (CPU; scripts/test.sh also runs the `per_isa` tests on every CPU kernel path)


@pytest.mark.per_isa
@pytest.mark.parametrize("chunk", chunks("attn"))
def test_flash_attn_paged_fuzz(chunk):
    run_chunk("attn", chunk)


def test_flash_attn_paged_fuzz_chunks_run_every_case_once():
    seen = []
    for chunk in range(CHUNKS):
        run_chunk("attn", chunk, case=lambda op, index: seen.append((op, index)))
    assert seen == [("attn", i) for i in range(cases_for("attn"))]


@pytest.mark.per_isa
def test_flash_attn_paged_meta_argument_is_rejected_by_name():
    """A meta tensor among CPU tensors dispatches to the fake kernel, which must not succeed silently."""
    cache = torch.zeros((2, 2, 1, 4))
    index = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([[1]], dtype=torch.int32).to("meta"))
    with pytest.raises(RuntimeError, match="lookup_table must be on the same device"):
        pagedkv.flash_attn_paged(torch.ones((1, 1, 4)), index[0], cache, cache, index[1], index[2])
    assert cache.abs().sum() == 0


@pytest.mark.per_isa
def test_flash_attn_paged_infinite_softcap_is_rejected():
    cache = torch.ones((1, 1, 1, 4))
    index = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="softcap must be finite"):
        pagedkv.flash_attn_paged(torch.ones((1, 1, 4)), index[0], cache, cache, index[1],
                                 torch.tensor([[0]], dtype=torch.int32), softcap=math.inf)

