"""The real ops (pagedkv._C) against the plain-torch reference over parameter grids.

Grids: every axis varied alone around a base case, a few axes fully crossed where cheap, plus a
seeded random sample of the full product. Store/load are copies and must match the reference byte
for byte (FP8 bytes and scales included); attention is compared with the float64 reference within
1e-5 (float32 queries) or 2e-2 (float16/bfloat16 queries) per-row relative L2 error.

Caches are filled with NaN before use, so any read of an unused slot, page or neighbouring layer
shows up as NaN, and any stray write shows up as a byte difference in the storage.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import pagedkv
from conftest import (
    CACHE_DTYPES,
    DEVICES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    LAYOUTS,
    assert_attention_close,
    assert_bytes_equal,
    dtype_name,
    fill_history,
    make_setup,
    poison_,
    ragged_inputs,
    randn,
    generator,
    seed_from,
)
from pagedkv import reference as ref
from pagedkv.cache import PagedKVCacheCollection

HEAD_DIMS = (64, 80, 96, 128, 256)
STORE_HEAD_DIMS = HEAD_DIMS + (576,)
PAGE_SIZES = (1, 2, 16, 64, 256)
GQA_RATIOS = (1, 4, 8)
QUANT_GROUPS = (128, 32, 64)
NUM_KV_HEADS = 2
RANDOM_SAMPLES = 40


def rows_for(page_size):
    """(cache_length, new_tokens) per row: prefill, decode, zero new tokens, empty, chunked
    prefill, and a chunk crossing a page boundary deep in the sequence."""
    return [(0, 5), (37, 1), (20, 0), (0, 0), (9, 12), (2 * page_size - 2, 4)]


# ---------------------------------------------------------------------------------------------
# Case generation


def normalize(case):
    """Drop combinations that do not exist and collapse axes that do not matter."""
    case = dict(case)
    fp8 = case["cache_dtype"] in FP8_DTYPES
    if not fp8 or (case["quant_group"] != 128 and case["quant_group"] >= case["head_dim"]):
        case["quant_group"] = 128
    if case["layout"] == "continuous":
        case["page_size"] = 16  # the slot length is derived from the rows
    return case


def build_cases(base, axes, crosses, samples, seed, keep=lambda c: True):
    cases, seen = [], set()

    def add(case):
        case = normalize(case)
        key = tuple(sorted((k, str(v)) for k, v in case.items()))
        if keep(case) and key not in seen:
            seen.add(key)
            cases.append(case)

    add(base)
    for name, values in axes.items():
        for v in values:
            add({**base, name: v})
    for names in crosses:
        for combo in itertools.product(*(axes[n] for n in names)):
            add({**base, **dict(zip(names, combo))})
    rnd = random.Random(seed)
    for _ in range(samples):
        add({name: rnd.choice(values) for name, values in axes.items()})
    return cases


def short(v):
    if isinstance(v, torch.dtype):
        return (
            dtype_name(v).replace("float", "f").replace("bf16", "bf16").replace("8_e4m3fn", "8e4m3")
            .replace("8_e5m2", "8e5m2")
        )
    return str(v)


def case_id(case):
    return "-".join(f"{k[:2]}{short(v)}" for k, v in case.items())


def params(cases):
    return [pytest.param(c, id=case_id(c)) for c in cases]


# ---------------------------------------------------------------------------------------------
# paged_store


STORE_AXES = {
    "key_dtype": FLOAT_DTYPES,
    "cache_dtype": CACHE_DTYPES,
    "head_dim": STORE_HEAD_DIMS,
    "page_size": PAGE_SIZES,
    "num_kv_heads": (1, 2, 8),
    "layout": LAYOUTS,
    "noncontig": (False, True),
    "quant_group": QUANT_GROUPS,
    "k_only": (False, True),
}
STORE_BASE = dict(
    key_dtype=torch.float32, cache_dtype=torch.bfloat16, head_dim=128, page_size=16,
    num_kv_heads=2, layout="collection", noncontig=False, quant_group=128, k_only=False,
)
STORE_CASES = build_cases(
    STORE_BASE,
    STORE_AXES,
    crosses=[
        ("cache_dtype", "key_dtype", "head_dim"),
        ("layout", "page_size", "noncontig"),
        ("cache_dtype", "head_dim", "quant_group"),
        ("cache_dtype", "layout", "k_only"),
    ],
    samples=RANDOM_SAMPLES,
    seed=1,
)


def store_inputs(gen, case, num_tokens, device):
    """Random key/value with the FP8 edge cases: an all-zero (token, head), a zero group,
    a huge token and a tiny token."""
    D, H = case["head_dim"], case["num_kv_heads"]

    def one():
        x = ragged_inputs(gen, num_tokens, H, D, torch.float32, "cpu", case["noncontig"])
        if num_tokens >= 4:
            x[0, 0] = 0
            x[1, :, : min(case["quant_group"], D)] = 0
            x[2] *= 1000.0
            x[3] *= 1e-3
        return x.to(case["key_dtype"]).to(device)

    key = one()
    value = None if case["k_only"] else one()
    return key, value


def run_store(case, device, poison="nan", unused="random", rows=None, padding=2):
    gen = generator(seed_from("store", case_id(case)))
    rows = rows_for(case["page_size"]) if rows is None else rows
    kv, batch = make_setup(
        gen, rows, layout=case["layout"], page_size=case["page_size"],
        num_kv_heads=case["num_kv_heads"], head_dim=case["head_dim"], dtype=case["cache_dtype"],
        quant_group=case["quant_group"], k_only=case["k_only"], noncontig=case["noncontig"],
        padding=padding, unused=unused, device=device,
    )
    kv.poison_(poison, gen)
    key, value = store_inputs(gen, case, batch.num_tokens, device)
    expected = kv.clone()
    ref.paged_store(
        key, value, *expected.views[:2], batch.input_row_offsets, batch.cache_lengths,
        batch.lookup_table, *expected.views[2:], case["quant_group"],
    )
    k, v, ks, vs = kv.views
    pagedkv.paged_store(
        key, value, k, v, batch.input_row_offsets, batch.cache_lengths, batch.lookup_table,
        ks, vs, case["quant_group"],
    )
    kv.assert_equal(expected, f"paged_store {case_id(case)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(STORE_CASES))
def test_paged_store(device, case):
    run_store(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_store_random_byte_poison(device, cache_dtype, layout):
    """Sentinel bytes (random, including NaN/Inf patterns) around the written slots survive."""
    case = {**STORE_BASE, "cache_dtype": cache_dtype, "layout": layout, "head_dim": 64,
            "quant_group": 32, "noncontig": True}
    run_store(normalize(case), device, poison="bytes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_store_ignores_unused_table_entries(device, layout):
    """Entries past a row's last page (-1, N, INT32_MAX, INT32_MIN here) are never read."""
    case = normalize({**STORE_BASE, "layout": layout, "cache_dtype": torch.float8_e4m3fn})
    run_store(case, device, unused="garbage")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_empty_batches(device):
    case = {**STORE_BASE, "head_dim": 64}
    run_store(case, device, rows=[], padding=3)  # B = 0, only padding rows
    run_store(case, device, rows=[(0, 0), (5, 0)], padding=0)  # T = 0
    run_store(case, device, rows=[(0, 0)], padding=4)


# ---------------------------------------------------------------------------------------------
# paged_load


LOAD_AXES = {
    "out_dtype": FLOAT_DTYPES,
    "cache_dtype": CACHE_DTYPES,
    "head_dim": STORE_HEAD_DIMS,
    "page_size": PAGE_SIZES,
    "num_kv_heads": (1, 2, 8),
    "layout": LAYOUTS,
    "noncontig": (False, True),
    "quant_group": QUANT_GROUPS,
}
LOAD_BASE = dict(
    out_dtype=torch.float32, cache_dtype=torch.bfloat16, head_dim=128, page_size=16,
    num_kv_heads=2, layout="collection", noncontig=False, quant_group=128,
)
LOAD_CASES = build_cases(
    LOAD_BASE,
    LOAD_AXES,
    crosses=[
        ("cache_dtype", "out_dtype", "head_dim"),
        ("layout", "page_size", "noncontig"),
        ("cache_dtype", "head_dim", "quant_group"),
    ],
    samples=RANDOM_SAMPLES,
    seed=2,
)


def run_load(case, device, unused="random"):
    gen = generator(seed_from("load", case_id(case)))
    rows = rows_for(case["page_size"])
    kv, batch = make_setup(
        gen, rows, layout=case["layout"], page_size=case["page_size"],
        num_kv_heads=case["num_kv_heads"], head_dim=case["head_dim"], dtype=case["cache_dtype"],
        quant_group=case["quant_group"], noncontig=case["noncontig"], unused=unused,
        device=device,
    )
    kv.poison_("nan")
    fill_history(gen, kv, batch, torch.float32)
    seq_lens = batch.seq_lens
    # Output regions with gaps (rows past seq_lens[b] stay untouched) and trailing padding.
    gaps = torch.randint(0, 3, (len(rows),), generator=gen, dtype=torch.int32)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(seq_lens.cpu() + gaps, 0)
    offsets = offsets.to(device)
    D, H = case["head_dim"], case["num_kv_heads"]
    out = torch.empty((int(offsets[-1]) + 2, H, D + (4 if case["noncontig"] else 0)),
                      dtype=case["out_dtype"], device=device)
    poison_(out, "nan")
    out = out[..., :D]
    expected = out.clone()
    for which in ("k", "v"):
        cache = kv.k_cache if which == "k" else kv.v_cache
        scales = kv.k_scales if which == "k" else kv.v_scales
        ref.paged_load(cache, scales, batch.lookup_table, seq_lens, offsets, expected,
                       case["quant_group"])
        torch.ops.pagedkv.paged_load(cache, scales, batch.lookup_table, seq_lens, offsets, out,
                                     case["quant_group"])
        assert_bytes_equal(out, expected, f"paged_load {which} {case_id(case)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(LOAD_CASES))
def test_paged_load(device, case):
    run_load(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_load_ignores_unused_table_entries(device, layout):
    run_load(normalize({**LOAD_BASE, "layout": layout}), device, unused="garbage")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=dtype_name)
def test_paged_load_python_convenience(device, cache_dtype):
    gen = generator(seed_from("load-convenience", str(cache_dtype)))
    kv, batch = make_setup(
        gen, [(3, 4), (0, 0), (10, 2)], layout="fa3", page_size=4, num_kv_heads=2, head_dim=64,
        dtype=cache_dtype, quant_group=32, device=device,
    )
    fill_history(gen, kv, batch)
    out = pagedkv.paged_load(kv.k_cache, batch.lookup_table, batch.seq_lens, scales=kv.k_scales,
                             quant_group=32)
    expected, _ = ref.contiguous_kv(kv.k_cache, kv.k_scales, batch.lookup_table, batch.seq_lens,
                                    quant_group=32)
    assert out.shape == (19, 2, 64)
    assert_bytes_equal(out, expected.to(out.dtype), "paged_load convenience")
    out16 = pagedkv.paged_load(kv.k_cache, batch.lookup_table, batch.seq_lens, scales=kv.k_scales,
                               out_dtype=torch.float16, quant_group=32)
    assert out16.dtype == torch.float16


# ---------------------------------------------------------------------------------------------
# flash_attn_paged


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
        result = pagedkv.flash_attn_paged(*args, out=out)
        assert result.data_ptr() == out.data_ptr()
    else:
        out = pagedkv.flash_attn_paged(*args)
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
    out = pagedkv.flash_attn_paged(q, *args, **kwargs)
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
    out = pagedkv.flash_attn_paged(q, *args, softcap=softcap)
    expected = ref.flash_attn_paged(q.double(), *args, softcap=softcap)
    assert_attention_close(out, expected, q_dtype, "large logits")


@pytest.mark.parametrize("device", DEVICES)
def test_many_rows_random_lengths(device):
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
    out = pagedkv.flash_attn_paged(q, *args, **kwargs)
    expected = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert_attention_close(out, expected, torch.float16, "many rows")
    key = randn(gen, (batch.num_tokens, 4, 96), torch.bfloat16, device)
    expected_kv = kv.clone()
    ref.paged_store(key, key, *expected_kv.views[:2], batch.input_row_offsets,
                    batch.cache_lengths, batch.lookup_table, *expected_kv.views[2:], 32)
    pagedkv.paged_store(key, key, kv.k_cache, kv.v_cache, batch.input_row_offsets,
                        batch.cache_lengths, batch.lookup_table, kv.k_scales, kv.v_scales, 32)
    kv.assert_equal(expected_kv, "many rows store")


@pytest.mark.parametrize("device", DEVICES)
def test_rows_filling_the_table_exactly(device):
    """cache_length + new == max_pages * P: the last slot of the last page, no spare column."""
    gen = generator(seed_from("exact-capacity"))
    rows = [(13, 3), (15, 1), (0, 16)]
    kv, batch = make_setup(gen, rows, layout="collection", page_size=4, num_kv_heads=2,
                           head_dim=64, dtype=torch.float8_e4m3fn, quant_group=32,
                           extra_columns=0, device=device)
    assert batch.lookup_table.shape[1] * 4 == 16
    fill_history(gen, kv, batch)
    key = randn(gen, (batch.num_tokens, 2, 64), torch.float32, device)
    expected_kv = kv.clone()
    ref.paged_store(key, key, *expected_kv.views[:2], batch.input_row_offsets,
                    batch.cache_lengths, batch.lookup_table, *expected_kv.views[2:], 32)
    pagedkv.paged_store(key, key, kv.k_cache, kv.v_cache, batch.input_row_offsets,
                        batch.cache_lengths, batch.lookup_table, kv.k_scales, kv.v_scales, 32)
    kv.assert_equal(expected_kv, "exact capacity store")
    q = randn(gen, (batch.num_tokens, 4, 64), torch.float32, device)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=32)
    assert_attention_close(pagedkv.flash_attn_paged(q, *args, **kwargs),
                           ref.flash_attn_paged(q.double(), *args, **kwargs), torch.float32,
                           "exact capacity attention")


@pytest.mark.parametrize("device", DEVICES)
def test_strided_index_tensors(device):
    """A column slice of a preallocated table and lengths/offsets taken from wider metadata."""
    gen = generator(seed_from("strided-index"))
    kv, batch = make_setup(gen, [(5, 3), (0, 4), (9, 1)], layout="separate", page_size=4,
                           num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=device)
    fill_history(gen, kv, batch)
    cols = batch.lookup_table.shape[1]
    wide = torch.full((3, 2 * cols), 2**31 - 1, dtype=torch.int32, device=device)
    wide[:, :cols] = batch.lookup_table
    table = wide[:, :cols]
    meta = torch.zeros((4, 3), dtype=torch.int32, device=device)
    meta[:, 0] = batch.input_row_offsets
    meta[:3, 1] = batch.cache_lengths
    offsets, lengths = meta[:, 0], meta[:3, 1]
    assert not (table.is_contiguous() or offsets.is_contiguous() or lengths.is_contiguous())
    q = randn(gen, (batch.num_tokens, 4, 64), torch.float32, device)
    out = pagedkv.flash_attn_paged(q, offsets, kv.k_cache, kv.v_cache, lengths, table)
    expected = ref.flash_attn_paged(q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                    batch.cache_lengths, batch.lookup_table)
    assert_attention_close(out, expected, torch.float32, "strided index tensors")
    key = randn(gen, (batch.num_tokens, 2, 64), torch.float32, device)
    expected_kv = kv.clone()
    ref.paged_store(key, key, *expected_kv.views[:2], batch.input_row_offsets,
                    batch.cache_lengths, batch.lookup_table)
    pagedkv.paged_store(key, key, kv.k_cache, kv.v_cache, offsets, lengths, table)
    kv.assert_equal(expected_kv, "store with strided index tensors")
    seq = torch.zeros((3, 2), dtype=torch.int32, device=device)
    seq[:, 0] = batch.seq_lens
    loaded = pagedkv.paged_load(kv.k_cache, table, seq[:, 0])
    reference_rows, _ = ref.contiguous_kv(kv.k_cache, None, batch.lookup_table, batch.seq_lens)
    assert_bytes_equal(loaded, reference_rows, "load with strided index tensors")


@pytest.mark.parametrize("device", DEVICES)
def test_pool_over_2_31_elements(device):
    """Offsets are 64-bit: pages past element 2^31 of an FP8 pool (memory left untouched
    except the pages used, so this costs little resident memory)."""
    P, H, D = 16, 1, 128
    N = 2**31 // (P * H * D) + 3
    k_cache = torch.empty((N, P, H, D), dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.empty((N, P, H, D), dtype=torch.float8_e4m3fn, device=device)
    k_scales = torch.empty((N, P, H, 1), device=device)
    v_scales = torch.empty((N, P, H, 1), device=device)
    assert k_cache.numel() > 2**31
    pages = [N - 1, N - 2, N - 3, 0]
    table = torch.tensor([pages[:2], pages[2:]], dtype=torch.int32, device=device)
    offsets = torch.tensor([0, 20, 25], dtype=torch.int32, device=device)
    lengths = torch.zeros(2, dtype=torch.int32, device=device)
    gen = generator(seed_from("big-pool"))
    key = randn(gen, (25, H, D), torch.float32, device)
    value = randn(gen, (25, H, D), torch.float32, device)
    pagedkv.paged_store(key, value, k_cache, v_cache, offsets, lengths, table, k_scales, v_scales)
    # The same step on a 4-page pool through the reference.
    small = [torch.zeros((4, P, H, D), dtype=torch.float8_e4m3fn, device=device) for _ in "kv"]
    small_scales = [torch.zeros((4, P, H, 1), device=device) for _ in "kv"]
    small_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    ref.paged_store(key, value, *small, offsets, lengths, small_table, *small_scales)
    index = torch.tensor(pages, device=device)
    for big, little in [(k_cache, small[0]), (v_cache, small[1]), (k_scales, small_scales[0]),
                        (v_scales, small_scales[1])]:
        got = big[index]
        for page, count in [(0, 16), (1, 4), (2, 5)]:
            assert_bytes_equal(got[page, :count], little[page, :count], f"page {pages[page]}")
    q = randn(gen, (25, 2, D), torch.float32, device)
    out = pagedkv.flash_attn_paged(q, offsets, k_cache, v_cache, lengths, table,
                                   k_scales=k_scales, v_scales=v_scales)
    expected = ref.flash_attn_paged(q.double(), offsets, *small, lengths, small_table,
                                    k_scales=small_scales[0], v_scales=small_scales[1])
    assert_attention_close(out, expected, torch.float32, "pool over 2^31 elements")
    seq_lens = torch.tensor([20, 5], dtype=torch.int32, device=device)
    assert_bytes_equal(
        pagedkv.paged_load(k_cache, table, seq_lens, scales=k_scales),
        pagedkv.paged_load(small[0], small_table, seq_lens, scales=small_scales[0]),
        "load past 2^31",
    )


# ---------------------------------------------------------------------------------------------
# opcheck and torch.compile


def small_setup(device, dtype):
    gen = generator(seed_from("opcheck", str(dtype)))
    kv, batch = make_setup(gen, [(3, 4), (0, 0), (6, 1)], layout="collection", page_size=4,
                           num_kv_heads=2, head_dim=32, dtype=dtype, quant_group=16, padding=1,
                           device=device)
    fill_history(gen, kv, batch)
    return gen, kv, batch


# torch's schema checker compares tensors with arithmetic that FP8 lacks on CPU
# ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn); FP8 runs the other checks.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
OPCHECK_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


def opcheck(op, args, kwargs=None, *, cache_dtype):
    utils = FP8_OPCHECK_UTILS if cache_dtype in FP8_DTYPES else "ALL"
    torch.library.opcheck(op, args, kwargs, test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_name)
def test_opcheck_paged_store(device, dtype):
    gen, kv, batch = small_setup(device, dtype)
    key = randn(gen, (batch.num_tokens, 2, 32), torch.float32, device)
    value = randn(gen, (batch.num_tokens, 2, 32), torch.float32, device)
    k, v, ks, vs = kv.views
    opcheck(
        torch.ops.pagedkv.paged_store.default,
        (key, value, k, v, batch.input_row_offsets, batch.cache_lengths, batch.lookup_table,
         ks, vs, 16),
        cache_dtype=dtype,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_name)
def test_opcheck_paged_load(device, dtype):
    gen, kv, batch = small_setup(device, dtype)
    out = torch.zeros((int(batch.seq_lens.sum()), 2, 32), device=device)
    offsets = torch.tensor([0, 7, 7, 14], dtype=torch.int32, device=device)
    opcheck(
        torch.ops.pagedkv.paged_load.default,
        (kv.k_cache, kv.k_scales, batch.lookup_table, batch.seq_lens, offsets, out, 16),
        cache_dtype=dtype,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("overload", ["default", "out"])
def test_opcheck_flash_attn_paged(device, dtype, overload):
    gen, kv, batch = small_setup(device, dtype)
    q = randn(gen, (batch.num_tokens, 4, 32), torch.float32, device)
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table, 0.2, True, kv.k_scales, kv.v_scales, 16, -1, 0.0)
    if overload == "default":
        opcheck(torch.ops.pagedkv.flash_attn_paged.default, args, cache_dtype=dtype)
    else:
        out = torch.empty((q.shape[0], 4, 32), device=device)
        opcheck(torch.ops.pagedkv.flash_attn_paged.out, args, {"out": out}, cache_dtype=dtype)


class TinyAttentionLayer(torch.nn.Module):
    """q/k/v projections, paged_store into a collection, flash_attn_paged, output projection."""

    def __init__(self, cache, layer, hidden, num_q_heads, num_kv_heads, head_dim):
        super().__init__()
        self.cache, self.layer = cache, layer
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.qkv = torch.nn.Linear(hidden, (num_q_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.proj = torch.nn.Linear(num_q_heads * head_dim, hidden, bias=False)

    def forward(self, x, input_row_offsets, cache_lengths, lookup_table):
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim)
        q = qkv[:, : self.num_q_heads]
        k = qkv[:, self.num_q_heads : self.num_q_heads + self.num_kv_heads]
        v = qkv[:, self.num_q_heads + self.num_kv_heads :]
        self.cache.store(self.layer, k, v, input_row_offsets, cache_lengths, lookup_table)
        o = self.cache.attention(self.layer, q, input_row_offsets, cache_lengths, lookup_table,
                                 softcap=20.0)
        return self.proj(o.reshape(tokens, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=dtype_name)
def test_torch_compile_fullgraph(device, backend, dtype):
    torch.manual_seed(0)
    caches = [PagedKVCacheCollection(12, 2, 4, 2, 16, dtype=dtype, device=device, quant_group=8)
              for _ in range(2)]
    eager = TinyAttentionLayer(caches[0], 1, 32, 4, 2, 16).to(device)
    compiled_layer = TinyAttentionLayer(caches[1], 1, 32, 4, 2, 16).to(device)
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, backend=backend, fullgraph=True)
    table = torch.tensor([[3, 7, 1], [0, 11, 5]], dtype=torch.int32, device=device)
    steps = [([0, 5, 7], [0, 0]), ([0, 1, 2], [5, 2]), ([0, 3, 4], [6, 3])]
    with torch.no_grad():
        for offsets, lengths in steps:
            offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
            lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
            x = torch.randn((int(offsets[-1]) + 1, 32), device=device)  # one padding row
            expected = eager(x, offsets, lengths, table)
            got = compiled(x, offsets, lengths, table)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if backend == "aot_eager":
        # Same aten kernels for the projections: the stored bytes must match exactly.
        assert_bytes_equal(caches[1].blocks, caches[0].blocks, "compiled cache blocks")
        if caches[0].scales is not None:
            assert_bytes_equal(caches[1].scales, caches[0].scales, "compiled cache scales")
    elif dtype == torch.float32:
        torch.testing.assert_close(caches[1].blocks, caches[0].blocks, rtol=1e-5, atol=1e-6)
