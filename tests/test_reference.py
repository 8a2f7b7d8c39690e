"""The plain-torch reference against independent naive computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import (
    FP8_DTYPES,
    LAYOUTS,
    as_bytes,
    dtype_name,
    fill_history,
    make_setup,
    randn,
)
from pagedkv import reference as ref

ROUND_TRIP_BOUND = {torch.float8_e4m3fn: 1 / 16, torch.float8_e5m2: 1 / 8}


def naive_gather(cache, scales, table_row, length, group):
    """Token-by-token gather with python ints; dequantizes FP8 in float64."""
    page_size = cache.shape[1]
    rows = []
    for t in range(length):
        page, slot = int(table_row[t // page_size]), t % page_size
        row = cache[page, slot].to(torch.float64)
        if scales is not None:
            channel_scale = torch.stack(
                [scales[page, slot, :, c // group] for c in range(cache.shape[-1])], dim=-1
            )
            row = row * channel_scale.to(torch.float64)
        rows.append(row)
    if not rows:
        return torch.zeros((0, *cache.shape[2:]), dtype=torch.float64)
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------
# FP8 helpers


def test_fp8_max():
    assert ref.fp8_max(torch.float8_e4m3fn) == 448.0
    assert ref.fp8_max(torch.float8_e5m2) == 57344.0
    with pytest.raises(ValueError, match="dtype"):
        ref.fp8_max(torch.float16)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("head_dim,group", [(64, 128), (80, 32), (96, 64), (576, 128), (7, 3)])
def test_quantize_scale_rule(rng, fp8_dtype, head_dim, group):
    x = randn(rng, (6, 3, head_dim), scale=3.0)
    x[0, 1] = 0  # every group of this (token, head) has amax == 0
    q, scales = ref.quantize_fp8(x, fp8_dtype, group)
    fmax = ref.fp8_max(fp8_dtype)
    assert q.dtype == fp8_dtype and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (6, 3, math.ceil(head_dim / group))
    for g in range(scales.shape[-1]):
        chunk = x[..., g * group : (g + 1) * group]
        amax = chunk.abs().amax(-1)
        expected = torch.where(amax == 0, torch.ones_like(amax), amax / fmax)
        assert torch.equal(scales[..., g], expected)
        # The largest magnitude of every non-zero group lands exactly on +-FP8_MAX.
        qmax = q[..., g * group : (g + 1) * group].float().abs().amax(-1)
        assert torch.equal(qmax[amax > 0], torch.full_like(qmax[amax > 0], fmax))
    assert torch.equal(scales[0, 1], torch.ones_like(scales[0, 1]))
    assert (q[0, 1].float() == 0).all()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("head_dim,group", [(128, 128), (80, 32), (256, 64)])
def test_quantize_round_trip_bound(rng, fp8_dtype, src_dtype, head_dim, group):
    x = randn(rng, (32, 2, head_dim), src_dtype, scale=5.0)
    q, scales = ref.quantize_fp8(x, fp8_dtype, group)
    back = ref.dequantize_fp8(q, scales, group, torch.float64)
    err = (back - x.double()).abs()
    for g in range(scales.shape[-1]):
        sl = slice(g * group, (g + 1) * group)
        bound = x[..., sl].double().abs().amax(-1, keepdim=True) * ROUND_TRIP_BOUND[fp8_dtype]
        assert (err[..., sl] <= bound).all()


def test_quantize_rounds_to_nearest_even():
    # e4m3 spacing in [8, 16) is 1: 8.5 -> 8 (even), 9.5 -> 10; scale is 448/448 = 1.
    x = torch.tensor([[448.0, 8.5, 9.5, -8.5, 0.0]])
    q, s = ref.quantize_fp8(x, torch.float8_e4m3fn, 8)
    assert s.tolist() == [[1.0]]
    assert q.float().tolist() == [[448.0, 8.0, 10.0, -8.0, 0.0]]
    # e5m2 spacing in [8, 16) is 2: 9 -> 8, 11 -> 12.
    x = torch.tensor([[57344.0, 9.0, 11.0]])
    q, s = ref.quantize_fp8(x, torch.float8_e5m2, 8)
    assert s.tolist() == [[1.0]]
    assert q.float().tolist() == [[57344.0, 8.0, 12.0]]


def test_quantize_divides_in_float32():
    # x / scale in float32 (not float64, not multiplication by a reciprocal).
    x = torch.tensor([[3.0, 1.1, 0.7, 2.9]])
    q, s = ref.quantize_fp8(x, torch.float8_e4m3fn, 4)
    scale32 = torch.tensor(3.0, dtype=torch.float32) / 448.0
    assert s.item() == scale32.item()
    expected = (x / scale32).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(as_bytes(q), as_bytes(expected))


def test_dequantize_by_hand():
    q = torch.tensor([[1.0, -2.0, 0.5, 448.0, 3.0]]).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5, 2.0, 0.25]])
    out = ref.dequantize_fp8(q, scales, 2, torch.float32)
    assert out.tolist() == [[0.5, -1.0, 1.0, 896.0, 0.75]]
    assert ref.dequantize_fp8(q, scales, 2, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="groups"):
        ref.dequantize_fp8(q, scales[:, :2], 2)


# ---------------------------------------------------------------------------------------------
# paged_store / paged_load


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_store_writes_exactly_the_addressed_slots(rng, layout, page_size):
    rows = [(0, 4), (5, 2), (3, 0), (0, 0), (2 * page_size - 1, 3)]
    kv, batch = make_setup(
        rng, rows, layout=layout, page_size=page_size, num_kv_heads=2, head_dim=8,
        dtype=torch.float32, padding=2,
    )
    kv.poison_("nan")
    key = randn(rng, (batch.num_tokens, 2, 8))
    value = randn(rng, (batch.num_tokens, 2, 8))
    k, v, _, _ = kv.views
    before_k, before_v = k.clone(), v.clone()
    ref.paged_store(key, value, k, v, batch.input_row_offsets, batch.cache_lengths, batch.lookup_table)
    written = torch.zeros(k.shape[:2], dtype=torch.bool)
    P = k.shape[1]
    offsets = batch.input_row_offsets.tolist()
    for b, (cache_len, new) in enumerate(rows):
        for i in range(new):
            pos = cache_len + i
            page, slot = int(batch.lookup_table[b, pos // P]), pos % P
            assert torch.equal(k[page, slot], key[offsets[b] + i])
            assert torch.equal(v[page, slot], value[offsets[b] + i])
            written[page, slot] = True
    assert torch.equal(as_bytes(k[~written]), as_bytes(before_k[~written]))
    assert torch.equal(as_bytes(v[~written]), as_bytes(before_v[~written]))
    # Padding in the views' storage (other layer, K/V of other views) is untouched too.
    untouched = sum(int(torch.isnan(b.float()).sum()) for b in kv.bases.values())
    assert untouched == sum(b.numel() for b in kv.bases.values()) - 2 * int(written.sum()) * 2 * 8


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, *FP8_DTYPES], ids=dtype_name)
def test_store_load_round_trip(rng, cache_dtype):
    rows = [(0, 5), (7, 3), (0, 0)]
    kv, batch = make_setup(
        rng, rows, layout="collection", page_size=4, num_kv_heads=2, head_dim=80,
        dtype=cache_dtype, quant_group=32,
    )
    key = randn(rng, (batch.num_tokens, 2, 80))
    fill_history(rng, kv, batch)
    k, _, ks, _ = kv.views
    ref.paged_store(
        key, None if kv.k_only else key, k, kv.v_cache, batch.input_row_offsets,
        batch.cache_lengths, batch.lookup_table, ks, kv.v_scales, 32,
    )
    seq_lens = batch.seq_lens
    out_offsets = torch.tensor([0, 5, 15, 15], dtype=torch.int32)
    out = torch.full((16, 2, 80), float("nan"))
    ref.paged_load(k, ks, batch.lookup_table, seq_lens, out_offsets, out, 32)
    assert torch.isnan(out[15]).all()  # past the last row: untouched
    for b, (cache_len, new) in enumerate(rows):
        loaded = out[out_offsets[b] + cache_len : out_offsets[b] + cache_len + new]
        src = key[batch.input_row_offsets[b] : batch.input_row_offsets[b + 1]]
        if cache_dtype in FP8_DTYPES:
            q, s = ref.quantize_fp8(src, cache_dtype, 32)
            assert torch.equal(loaded, ref.dequantize_fp8(q, s, 32, torch.float32))
        else:
            assert torch.equal(loaded, src.to(cache_dtype).float())
        full = naive_gather(k, ks, batch.lookup_table[b], cache_len + new, 32)
        # float32 product of the exact float64 one: both are the correctly rounded float32 result.
        assert torch.equal(out[out_offsets[b] : out_offsets[b] + cache_len + new], full.float())


def test_contiguous_kv_padded_and_ragged_agree(rng):
    rows = [(3, 2), (0, 0), (10, 1)]
    kv, batch = make_setup(
        rng, rows, layout="fa3", page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float16,
    )
    fill_history(rng, kv, batch)
    ragged, offsets = ref.contiguous_kv(kv.k_cache, None, batch.lookup_table, batch.seq_lens)
    padded, lengths = ref.contiguous_kv(
        kv.k_cache, None, batch.lookup_table, batch.seq_lens, padded=True
    )
    assert offsets.tolist() == [0, 5, 5, 16] and lengths.tolist() == [5, 0, 11]
    assert padded.shape == (3, 2, 11, 16)
    for b in range(3):
        rows_b = ragged[offsets[b] : offsets[b + 1]]
        assert torch.equal(padded[b, :, : lengths[b]], rows_b.transpose(0, 1))
        assert (padded[b, :, lengths[b] :] == 0).all()


# ---------------------------------------------------------------------------------------------
# flash_attn_paged


def sdpa_attention(q, kv, batch, *, scale, causal, window_left):
    """torch SDPA per row on naively gathered float64 K/V, with an explicit boolean mask."""
    num_q_heads = q.shape[1]
    out = torch.zeros((q.shape[0], num_q_heads, kv.v_cache.shape[-1]), dtype=torch.float64)
    offsets = batch.input_row_offsets.tolist()
    for b, (cache_len, new) in enumerate(batch.rows):
        if new == 0:
            continue
        total = cache_len + new
        keys = naive_gather(kv.k_cache, kv.k_scales, batch.lookup_table[b], total, kv.quant_group)
        values = naive_gather(kv.v_cache, kv.v_scales, batch.lookup_table[b], total, kv.quant_group)
        query = q[offsets[b] : offsets[b + 1]].double()
        mask = torch.ones((new, total), dtype=torch.bool)
        for i in range(new):
            p = cache_len + i
            for j in range(total):
                visible = (not causal or j <= p) and (window_left < 0 or j >= p - window_left)
                mask[i, j] = visible
        o = F.scaled_dot_product_attention(
            query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[offsets[b] : offsets[b + 1]] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "gqa,causal,window_left,scale",
    [(1, True, -1, None), (4, True, -1, 0.3), (2, False, -1, None), (4, True, 2, None),
     (1, False, 0, None), (2, False, 3, 0.05)],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=dtype_name)
def test_attention_matches_sdpa(rng, layout, gqa, causal, window_left, scale, cache_dtype):
    rows = [(0, 4), (6, 1), (4, 0), (0, 0), (3, 5)]
    num_kv_heads, head_dim = 2, 16
    kv, batch = make_setup(
        rng, rows, layout=layout, page_size=4, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=cache_dtype, quant_group=8, padding=2,
    )
    kv.poison_("nan")
    fill_history(rng, kv, batch)
    q = randn(rng, (batch.num_tokens, num_kv_heads * gqa, head_dim), torch.float64)
    out = ref.flash_attn_paged(
        q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
        batch.lookup_table, scale, causal, kv.k_scales, kv.v_scales, kv.quant_group,
        window_left,
    )
    expected = sdpa_attention(
        q, kv, batch, scale=scale if scale is not None else head_dim**-0.5, causal=causal,
        window_left=window_left,
    )
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert (out[batch.used_tokens :] == 0).all()


def test_attention_softcap_scalar_loops(rng):
    rows = [(2, 3), (0, 1)]
    softcap, scale = 0.7, 0.9
    kv, batch = make_setup(
        rng, rows, layout="separate", page_size=2, num_kv_heads=1, head_dim=4,
        dtype=torch.float32,
    )
    fill_history(rng, kv, batch)
    q = randn(rng, (batch.num_tokens, 2, 4), torch.float64)
    out = ref.flash_attn_paged(
        q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
        batch.lookup_table, scale=scale, softcap=softcap,
    )
    offsets = batch.input_row_offsets.tolist()
    for b, (cache_len, new) in enumerate(rows):
        keys = naive_gather(kv.k_cache, None, batch.lookup_table[b], cache_len + new, 128)
        values = naive_gather(kv.v_cache, None, batch.lookup_table[b], cache_len + new, 128)
        for i in range(new):
            for h in range(2):
                qi = q[offsets[b] + i, h].tolist()
                logits = []
                for j in range(cache_len + i + 1):
                    s = scale * sum(a * c for a, c in zip(qi, keys[j, 0].tolist()))
                    logits.append(softcap * math.tanh(s / softcap))
                m = max(logits)
                w = [math.exp(s - m) for s in logits]
                expected = [
                    sum(w[j] * values[j, 0, d].item() for j in range(len(w))) / sum(w)
                    for d in range(4)
                ]
                assert out[offsets[b] + i, h].tolist() == pytest.approx(expected, rel=1e-12)


def test_attention_window_zero_returns_own_value(rng):
    rows = [(5, 3)]
    kv, batch = make_setup(
        rng, rows, layout="collection", page_size=2, num_kv_heads=2, head_dim=8,
        dtype=torch.float32,
    )
    fill_history(rng, kv, batch)
    q = randn(rng, (3, 4, 8))
    out = ref.flash_attn_paged(
        q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
        batch.lookup_table, window_left=0, compute_dtype=torch.float32,
    )
    values = naive_gather(kv.v_cache, None, batch.lookup_table[0], 8, 128)
    for i in range(3):
        for h in range(4):
            assert torch.equal(out[i, h].double(), values[5 + i, h // 2])


def test_attention_output_dtype_and_zero_rows(rng):
    rows = [(0, 0), (4, 2), (3, 0)]
    kv, batch = make_setup(
        rng, rows, layout="continuous", page_size=0, num_kv_heads=1, head_dim=8,
        dtype=torch.bfloat16, padding=3,
    )
    kv.poison_("nan")
    fill_history(rng, kv, batch)
    q = randn(rng, (batch.num_tokens, 2, 8), torch.bfloat16)
    out = ref.flash_attn_paged(
        q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
        batch.lookup_table,
    )
    assert out.dtype == torch.bfloat16 and out.shape == (5, 2, 8)
    assert torch.isfinite(out).all()
    assert (out[2:] == 0).all() and (out[:2] != 0).any()


def test_index_arguments_are_checked_by_name():
    """The reference reads the index tensors as the ops check them: a 2-D input_row_offsets was read
    flattened (a store ran), an empty one attended nothing, a list raised AttributeError, meta lengths
    "Cannot copy out of meta tensor". Each now raises naming the argument, nothing written."""
    k, v = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
    key, q = torch.randn(1, 1, 8), torch.randn(1, 2, 8)
    i32 = lambda *values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    offsets, lengths, table = i32(0, 1), i32(0), i32(0)[None]
    cases = [
        ("input_row_offsets", offsets[None], ValueError, r"input_row_offsets must be 1-D \[B\+1\], got 2-D"),
        ("input_row_offsets", [0, 1], TypeError, r"input_row_offsets must be a 1-D tensor \[B\+1\], got list"),
        ("input_row_offsets", offsets[:0], ValueError, r"input_row_offsets\.size\(0\) must be B\+1"),
        ("cache_lengths", lengths.to("meta"), ValueError, r"cache_lengths must be on the same device as the cache"),
        ("lookup_table", table.long(), ValueError, r"lookup_table must be int32, got int64"),
    ]
    for name, value, error, message in cases:
        args = {"input_row_offsets": offsets, "cache_lengths": lengths, "lookup_table": table, name: value}
        with pytest.raises(error, match=rf"^paged_store: {message}"):
            ref.paged_store(key, key, k, v, args["input_row_offsets"], args["cache_lengths"], args["lookup_table"])
        assert not k.any() and not v.any()
        with pytest.raises(error, match=rf"^flash_attn_paged: {message}"):
            ref.flash_attn_paged(q, args["input_row_offsets"], k, v, args["cache_lengths"], args["lookup_table"])
    with pytest.raises(ValueError, match=r"^paged_load: output_row_offsets\.size\(0\) must be B or B\+1"):
        ref.paged_load(k, None, table, i32(1), i32(0, 1, 1), torch.zeros(1, 1, 8))
    with pytest.raises(TypeError, match=r"^kv_format must be None, 'fp8_ds_mla' or 'fp8_rope' \(a str\), got list"):
        ref.paged_load(k, None, table, i32(1), i32(0), torch.zeros(1, 1, 8), kv_format=["fp8_ds_mla"])
