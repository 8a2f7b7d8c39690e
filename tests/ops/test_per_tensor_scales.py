"""CONTRACT v1.2 per-tensor FP8 scales: `k_scales` / `v_scales` (and paged_load's `scales`) of one
float32 element, shape [] or [1], one scale for every token, head and channel of that cache.

paged_store only reads it (codes `fp8(clamp(x / s))`, byte for byte the reference's, the scale tensor
unchanged); paged_load, flash_attn_paged (functional, .out, _lse) and flash_attn_paged_sparse
dequantize `float(q) * s`; each of K and V picks per-tensor or per-token scales on its own. A scale
that is not finite and > 0, or a scales tensor of another shape, dtype or device, is an error naming
the argument with nothing written. Caches are filled by the reference's store in the attention tests,
so those compare only the readers with the float64 reference. The error cases run once (the checks
are shared code), the cheap kernel cases also on every CPU kernel path (`per_isa`).
"""

from __future__ import annotations

import pytest
import torch

from conftest import index_value_checks
from pagedkv.cache import ContinuousBatchingKVCache, PagedKVCache, PagedKVCacheCollection, PagedKVCacheFA3Fallback
from op_helpers import (
    DEVICES,
    FP8_DTYPES,
    assert_attention_close,
    assert_bytes_equal,
    assert_lse_close,
    dtype_name,
    generator,
    opcheck,
    pagedkv,
    ref,
    seed_from,
    supported_or_skip,
)

SCALE_SHAPES = [pytest.param((), id="shape[]"), pytest.param((1,), id="shape[1]")]


def one_scale(value, device, shape=()):
    return torch.full(shape, value, dtype=torch.float32, device=device)


def per_token_scales(n, p, hk, d, group, device):
    return torch.ones((n, p, hk, ref.num_scale_groups(d, group)), dtype=torch.float32, device=device)


def page_table(gen, rows, num_pages, max_pages, device):
    """Row b's pages: disjoint slices of a random permutation of the pool."""
    perm = torch.randperm(num_pages, generator=gen)[: rows * max_pages]
    return perm.view(rows, max_pages).to(torch.int32).to(device)


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def offsets_of(counts, device):
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return int32(out, device)


# ---------------------------------------------------------------- paged_store


def store_inputs(gen, dtype, rows, hk, d, scale, device):
    """Keys around the clamp: multiples of s * FP8_MAX just below, at and past it, plus Gaussians."""
    fmax = ref.fp8_max(dtype)
    total = sum(rows)
    x = torch.randn((total, hk, d), generator=gen, dtype=torch.float64) * scale * fmax * 0.4
    edge = torch.tensor([0.999, 1.0, 1.001, 1.5, 40.0, -0.999, -1.0, -1.001, -3.0, 0.0], dtype=torch.float64)
    x.view(-1)[: edge.numel()] = edge * scale * fmax
    return x


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("scale_shape", SCALE_SHAPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_store_bytes_match_reference(device, cache_dtype, key_dtype, scale_shape, head_dim):
    gen = generator(seed_from("store", cache_dtype, key_dtype, scale_shape, head_dim))
    n, p, hk, group = 10, 4, 2, 16
    rows, cached = [3, 1, 6], [2, 7, 0]
    table = page_table(gen, 3, n, 3, device)
    offsets, lengths = offsets_of(rows, device), int32(cached, device)
    for value in (0.37, 1.0, 3.0e-3, 1234.5):
        key = store_inputs(gen, cache_dtype, rows, hk, head_dim, value, "cpu").to(key_dtype).to(device)
        val = torch.randn((sum(rows), hk, head_dim), generator=gen).to(key_dtype).to(device)
        k_scale = one_scale(value, device, scale_shape)
        # V with per-token scales in the same call: each tensor is its own choice
        raw = torch.randint(0, 256, (n, p, hk, head_dim), generator=gen, dtype=torch.uint8)
        k_cache = raw.view(cache_dtype).to(device)
        v_cache = raw.flip(0).view(cache_dtype).to(device)
        v_scales = torch.rand((n, p, hk, ref.num_scale_groups(head_dim, group)), generator=gen).to(device)
        expected = [t.clone() for t in (k_cache, v_cache, v_scales)]
        ref.paged_store(key, val, *expected[:2], offsets, lengths, table, k_scale.clone(), expected[2], group)
        pagedkv.paged_store(key, val, k_cache, v_cache, offsets, lengths, table, k_scale, v_scales, group)
        what = f"scale {value}"
        assert_bytes_equal(k_cache, expected[0], f"k_cache, {what}")
        assert_bytes_equal(v_cache, expected[1], f"v_cache, {what}")
        assert_bytes_equal(v_scales, expected[2], f"v_scales, {what}")
        assert k_scale.shape == scale_shape and k_scale.item() == torch.tensor(value, dtype=torch.float32).item()
        # the codes are x / s clamped, not x / (amax / FP8_MAX)
        fmax = ref.fp8_max(cache_dtype)
        page, slot = int(table[0, 0]), 2
        direct = (key[0].float().cpu() / k_scale.cpu().reshape(())).clamp(-fmax, fmax).to(cache_dtype)
        assert_bytes_equal(k_cache[page, slot].cpu(), direct, f"row 0 codes, {what}")


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
def test_store_k_only(device, cache_dtype):
    """A K-only (MLA) cache with a per-tensor scale: value and v_cache None."""
    gen = generator(seed_from("k_only", cache_dtype))
    k_cache = torch.zeros((4, 8, 1, 96), dtype=cache_dtype, device=device)
    key = store_inputs(gen, cache_dtype, [5], 1, 96, 0.05, "cpu").float().to(device)
    table, offsets, lengths = int32([[2, 0]], device), offsets_of([5], device), int32([6], device)
    expected = k_cache.clone()
    ref.paged_store(key, None, expected, None, offsets, lengths, table, one_scale(0.05, device))
    pagedkv.paged_store(key, None, k_cache, None, offsets, lengths, table, one_scale(0.05, device, (1,)))
    assert_bytes_equal(k_cache, expected, "k_cache")


@pytest.mark.parametrize("device", DEVICES)
def test_store_k_and_v_share_one_scale_tensor(device):
    """A per-tensor scale is only read, so K and V may pass the same tensor (no aliasing error)."""
    gen = generator(seed_from("shared"))
    k_cache = torch.zeros((4, 4, 2, 64), dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = store_inputs(gen, torch.float8_e4m3fn, [6], 2, 64, 0.02, "cpu").float().to(device)
    value = key.flip(0)
    table, offsets, lengths = int32([[3, 1]], device), offsets_of([6], device), int32([1], device)
    scale = one_scale(0.02, device, (1,))
    expected = (k_cache.clone(), v_cache.clone())
    ref.paged_store(key, value, *expected, offsets, lengths, table, scale, scale)
    pagedkv.paged_store(key, value, k_cache, v_cache, offsets, lengths, table, scale, scale)
    assert_bytes_equal(k_cache, expected[0], "k_cache")
    assert_bytes_equal(v_cache, expected[1], "v_cache")


# ---------------------------------------------------------------- paged_load


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_name)
@pytest.mark.parametrize("group", [16, 128])
@pytest.mark.parametrize("scale_shape", SCALE_SHAPES)
def test_load_matches_reference(device, cache_dtype, out_dtype, group, scale_shape):
    gen = generator(seed_from("load", cache_dtype, out_dtype, group, scale_shape))
    n, p, hk, d = 9, 4, 2, 64
    raw = torch.randint(0, 256, (n, p, hk, d), generator=gen, dtype=torch.uint8)
    raw[raw & 0x7F >= (0x7F if cache_dtype == torch.float8_e4m3fn else 0x7C)] = 0x11  # no NaN/inf codes
    cache = raw.view(cache_dtype).to(device)
    scale = one_scale(0.0372, device, scale_shape)
    table = page_table(gen, 2, n, 4, device)
    seq_lens = int32([7, 13], device)
    out = torch.full((22, hk, d), float("nan"), dtype=out_dtype, device=device)
    expected = out.clone()
    offsets = int32([0, 8, 21], device)  # a gap row and a trailing row stay untouched
    ref.paged_load(cache, scale, table, seq_lens, offsets, expected, group)
    torch.ops.pagedkv.paged_load(cache, scale, table, seq_lens, offsets, out, group)
    assert_bytes_equal(out, expected, "paged_load out")
    got = pagedkv.paged_load(cache, table, seq_lens, scales=scale, out_dtype=out_dtype, quant_group=group)
    assert_bytes_equal(got, torch.cat([expected[0:7], expected[8:21]]), "pagedkv.paged_load")
    assert scale.item() == torch.tensor(0.0372, dtype=torch.float32).item()


# ---------------------------------------------------------------- flash_attn_paged


def filled_caches(gen, device, cache_dtype, rows, hk, d, dv, p, group, k_mode, v_mode, k_value=0.011, v_value=0.023):
    """Separate K/V pools holding every row's cached and new tokens, written by the reference store
    with a per-tensor scale ("tensor") or per-token scales ("token")."""
    total = [c + n for c, n in rows]
    max_pages = max(-(-t // p) for t in total)
    num_pages = len(rows) * max_pages + 3
    table = page_table(gen, len(rows), num_pages, max_pages, device)
    k_cache = torch.zeros((num_pages, p, hk, d), dtype=cache_dtype, device=device)
    v_cache = torch.zeros((num_pages, p, hk, dv), dtype=cache_dtype, device=device)
    k_scales = (one_scale(k_value, device) if k_mode == "tensor"
                else per_token_scales(num_pages, p, hk, d, group, device))
    v_scales = (one_scale(v_value, device, (1,)) if v_mode == "tensor"
                else per_token_scales(num_pages, p, hk, dv, group, device))
    keys = torch.randn((sum(total), hk, d), generator=gen) * 2.0
    values = torch.randn((sum(total), hk, dv), generator=gen) * 3.0
    ref.paged_store(keys.to(device), values.to(device), k_cache, v_cache, offsets_of(total, device),
                    int32([0] * len(rows), device), table, k_scales, v_scales, group)
    return table, k_cache, v_cache, k_scales, v_scales


# name: rows (cached, new), Hq, Hk, D, P, G, q dtype, cache dtype, K / V scale mode, window, softcap, sinks, causal
ATTN_CASES = {
    "decode-gqa": ([(37, 1), (5, 1), (0, 1), (70, 1)], 8, 2, 64, 16, 128, torch.bfloat16, torch.float8_e4m3fn,
                   "tensor", "tensor", -1, 0.0, False, True),
    "decode-groups-e5m2": ([(20, 1), (63, 1)], 4, 4, 64, 1, 16, torch.float32, torch.float8_e5m2,
                           "tensor", "tensor", -1, 0.0, False, True),
    "prefill-window-softcap-sinks": ([(9, 6), (0, 11)], 4, 1, 64, 5, 32, torch.float16, torch.float8_e4m3fn,
                                     "tensor", "tensor", 7, 30.0, True, True),
    "prefill-k-tensor-v-token": ([(12, 5), (3, 3)], 6, 2, 128, 8, 128, torch.bfloat16, torch.float8_e4m3fn,
                                 "tensor", "token", -1, 0.0, False, True),
    "decode-k-token-v-tensor": ([(40, 1), (17, 1)], 8, 2, 64, 16, 16, torch.float32, torch.float8_e4m3fn,
                                "token", "tensor", -1, 0.0, True, True),
    "non-causal-f32": ([(4, 7)], 2, 2, 64, 4, 128, torch.float32, torch.float8_e5m2,
                       "tensor", "tensor", -1, 0.0, False, False),
    "split-kv-decode": ([(1500, 1), (3, 1)], 8, 2, 64, 64, 128, torch.bfloat16, torch.float8_e4m3fn,
                        "tensor", "tensor", -1, 0.0, False, True),
}
CHEAP = {"decode-gqa", "decode-groups-e5m2", "prefill-window-softcap-sinks", "decode-k-token-v-tensor"}


def attn_case_params():
    return [pytest.param(name, id=name, marks=[pytest.mark.per_isa] if name in CHEAP else []) for name in ATTN_CASES]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", attn_case_params())
def test_attention_matches_reference(device, name):
    rows, hq, hk, d, p, group, q_dtype, cache_dtype, k_mode, v_mode, window, softcap, with_sinks, causal = (
        ATTN_CASES[name])
    gen = generator(seed_from("attn", name))
    table, k_cache, v_cache, k_scales, v_scales = filled_caches(gen, device, cache_dtype, rows, hk, d, d, p, group,
                                                                k_mode, v_mode)
    new = [n for _, n in rows]
    offsets, lengths = offsets_of(new, device), int32([c for c, _ in rows], device)
    q = (torch.randn((sum(new) + 1, hq, d), generator=gen)).to(q_dtype).to(device)  # one padding row
    sinks = torch.randn((hq,), generator=gen).to(device) if with_sinks else None
    args = (q, offsets, k_cache, v_cache, lengths, table, None, causal, k_scales, v_scales, group, window, softcap,
            sinks)
    want_out, want_lse = ref.flash_attn_paged_lse(*args)
    out, lse = supported_or_skip(device, pagedkv.flash_attn_paged_lse, *args)
    assert_attention_close(out, want_out, q_dtype, f"{name} _lse out", q16_on_cuda=True)
    assert_lse_close(lse, want_lse, q_dtype, f"{name} lse", q16_on_cuda=True)
    assert_attention_close(pagedkv.flash_attn_paged(*args), want_out, q_dtype, f"{name} functional",
                           q16_on_cuda=True)
    preallocated = torch.full_like(out, float("nan"))
    pagedkv.flash_attn_paged(*args, out=preallocated)
    assert_attention_close(preallocated, want_out, q_dtype, f"{name} .out", q16_on_cuda=True)
    # the scales were read, not ignored: attention with unit scales differs
    if k_mode == "tensor":
        unit = ref.flash_attn_paged(*args[:8], one_scale(1.0, device), *args[9:])
        assert not torch.allclose(unit, want_out.to(unit.dtype), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("modes", [("tensor", "tensor"), ("tensor", "token"), ("token", "tensor")],
                         ids=lambda m: f"k-{m[0]}-v-{m[1]}")
@pytest.mark.parametrize("group", [16, 128])
@pytest.mark.per_isa
def test_sparse_matches_reference(device, modes, group):
    gen = generator(seed_from("sparse", modes, group))
    hq, hk, d, p = 4, 2, 64, 8
    table, k_cache, v_cache, k_scales, v_scales = filled_caches(gen, device, torch.float8_e4m3fn, [(0, 40)], hk, d,
                                                                d, p, group, *modes)
    tokens = k_cache.shape[0] * p
    t, listed = 5, 12
    indices = torch.randint(-1, tokens, (t, hk, listed), generator=gen, dtype=torch.int32)
    indices[0, 0, :3] = indices[0, 0, 3]  # duplicates count as listed
    indices[1] = -1  # a row with no token outputs zeros
    indices = indices.to(device)
    q = torch.randn((t, hq, d), generator=gen).to(torch.bfloat16).to(device)
    sinks = torch.randn((hq,), generator=gen).to(device)
    args = (q, k_cache, v_cache, indices, None, k_scales, v_scales, group, 20.0, sinks)
    expected = ref.flash_attn_paged_sparse(*args)
    got = supported_or_skip(device, pagedkv.flash_attn_paged_sparse, *args)
    assert_attention_close(got, expected, torch.bfloat16, "sparse")


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_passes_per_tensor_scales(device):
    """cascade_attention hands the scales to its two flash_attn_paged_lse calls: equal to the reference
    over the whole rows (per-tensor K, per-token V)."""
    gen = generator(seed_from("cascade"))
    n, p, hk, d, group = 8, 4, 2, 64, 128
    raw = torch.randint(0, 0x70, (2, n, p, hk, d), generator=gen, dtype=torch.uint8)
    raw[1] |= (torch.rand(raw[1].shape, generator=gen) < 0.5).to(torch.uint8) << 7  # signed V codes
    k_cache, v_cache = raw.view(torch.float8_e4m3fn).to(device).unbind(0)
    k_scales = one_scale(0.004, device)
    v_scales = (torch.rand((n, p, hk, 1), generator=gen) + 0.5).to(device)
    table = int32([[5, 1, 7, 0], [5, 1, 3, 2]], device)  # two shared pages
    offsets, lengths = offsets_of([1, 3], device), int32([10, 8], device)
    q = torch.randn((5, 4, d), generator=gen).to(torch.bfloat16).to(device)
    got = supported_or_skip(device, pagedkv.cascade_attention, q, offsets, k_cache, v_cache, lengths, table, 2,
                            k_scales=k_scales, v_scales=v_scales, quant_group=group)
    expected = ref.flash_attn_paged(q, offsets, k_cache, v_cache, lengths, table, k_scales=k_scales,
                                    v_scales=v_scales, quant_group=group)
    assert_attention_close(got, expected, torch.bfloat16, "cascade", q16_on_cuda=True)


CACHE_CLASSES = {
    "collection": lambda **kw: PagedKVCacheCollection(8, 2, 4, 2, 64, **kw),
    "fa3": lambda **kw: PagedKVCacheFA3Fallback(8, 2, 4, 2, 64, **kw),
    "separate": lambda **kw: PagedKVCache(8, 4, 2, 64, num_layers=2, **kw),
    "continuous": lambda **kw: ContinuousBatchingKVCache(3, 2, 12, 2, 64, **kw),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(CACHE_CLASSES))
def test_cache_objects_with_per_tensor_scales(device, layout):
    """per_tensor_scales=True: one scale per layer and K/V (tensor_scales, settable), no per-token
    scales; store, attention and load through the object equal the reference with those scales."""
    gen = generator(seed_from("cache", layout))
    cache = CACHE_CLASSES[layout](dtype=torch.float8_e4m3fn, device=device, per_tensor_scales=True)
    assert cache.tensor_scales.shape == (2, 2) and getattr(cache, "scales", None) is None
    cache.tensor_scales[1] = torch.tensor([0.013, 0.021])
    table = cache.lookup_table([2, 0]) if layout == "continuous" else int32([[5, 1, 7], [0, 6, 2]], device)
    offsets, lengths = offsets_of([5, 1], device), int32([0, 6], device)
    key = (torch.randn((7, 2, 64), generator=gen) * 3).to(device)
    value = (torch.randn((7, 2, 64), generator=gen) * 4).to(device)
    k_scale, v_scale = cache.k_scales(1), cache.v_scales(1)
    assert k_scale.dim() == 0 and k_scale.item() == pytest.approx(0.013)
    k_expected, v_expected = cache.k_cache(1).clone(), cache.v_cache(1).clone()
    ref.paged_store(key, value, k_expected, v_expected, offsets, lengths, table, k_scale, v_scale)
    cache.store(1, key, value, offsets, lengths, table)
    assert_bytes_equal(cache.k_cache(1), k_expected, f"{layout} k_cache")
    assert_bytes_equal(cache.v_cache(1), v_expected, f"{layout} v_cache")
    q = torch.randn((7, 4, 64), generator=gen).to(torch.bfloat16).to(device)
    got = supported_or_skip(device, cache.attention, 1, q, offsets, lengths, table)
    expected = ref.flash_attn_paged(q, offsets, cache.k_cache(1), cache.v_cache(1), lengths, table,
                                    k_scales=k_scale, v_scales=v_scale)
    assert_attention_close(got, expected, torch.bfloat16, f"{layout} attention", q16_on_cuda=True)
    seq_lens = int32([5, 7], device)
    loaded = cache.load(1, table, seq_lens, which="v")
    want = torch.cat(ref.gather_rows(cache.v_cache(1), v_scale, table, seq_lens))
    assert_bytes_equal(loaded, want, f"{layout} load")


def test_cache_per_tensor_scales_need_fp8():
    with pytest.raises(ValueError, match="per_tensor_scales needs an FP8 dtype"):
        PagedKVCache(4, 4, 2, 64, dtype=torch.bfloat16, per_tensor_scales=True)


def test_k_only_cache_with_per_tensor_scales():
    """K-only (MLA): V is K's first channels, dequantized with K's per-tensor scale."""
    gen = generator(seed_from("k_only_cache"))
    cache = PagedKVCacheCollection(6, 1, 4, 1, 96, dtype=torch.float8_e4m3fn, k_only=True, per_tensor_scales=True)
    cache.tensor_scales.fill_(0.02)
    table, offsets, lengths = int32([[3, 1]], "cpu"), offsets_of([6], "cpu"), int32([0], "cpu")
    cache.store(0, torch.randn((6, 1, 96), generator=gen) * 4, None, offsets, lengths, table)
    q = torch.randn((6, 2, 96), generator=gen)
    got = cache.attention(0, q, offsets, lengths, table, v_head_dim=64)
    k = cache.k_cache(0)
    expected = ref.flash_attn_paged(q, offsets, k, k[..., :64], lengths, table, k_scales=cache.k_scales(0),
                                    v_scales=cache.k_scales(0))
    assert cache.v_scales(0) is None
    assert_attention_close(got, expected, torch.float32, "k-only attention")


# ---------------------------------------------------------------- errors


BAD_SCALES = {
    "two-elements": (lambda dev: torch.ones(2, device=dev), "must be 4-D"),
    "one-element-2d": (lambda dev: torch.ones(1, 1, device=dev), "must be 4-D"),
    "float64": (lambda dev: torch.ones((), dtype=torch.float64, device=dev), "must be float32"),
    "nan": (lambda dev: one_scale(float("nan"), dev), "finite and > 0"),
    "inf": (lambda dev: one_scale(float("inf"), dev, (1,)), "finite and > 0"),
    "zero": (lambda dev: one_scale(0.0, dev), "finite and > 0"),
    "negative": (lambda dev: one_scale(-0.5, dev, (1,)), "finite and > 0"),
}


def error_setup(device):
    gen = generator(seed_from("errors"))
    n, p, hk, d = 6, 4, 2, 64
    raw = torch.randint(0, 0x70, (2, n, p, hk, d), generator=gen, dtype=torch.uint8)
    k_cache, v_cache = raw.view(torch.float8_e4m3fn).to(device).unbind(0)
    table, offsets, lengths = int32([[3, 1], [0, 5]], device), offsets_of([2, 3], device), int32([1, 4], device)
    key = torch.randn((5, hk, d), generator=gen).to(device)
    return k_cache, v_cache, table, offsets, lengths, key


def run_op(op, device, k_scales, v_scales):
    """Calls `op` with these scales; returns the tensors that must not change."""
    k_cache, v_cache, table, offsets, lengths, key = error_setup(device)
    if op == "paged_store":
        return (lambda: pagedkv.paged_store(key, key, k_cache, v_cache, offsets, lengths, table, k_scales, v_scales),
                [k_cache, v_cache])
    if op == "paged_load":
        out = torch.zeros((16, 2, 64), device=device)
        return (lambda: torch.ops.pagedkv.paged_load(k_cache, k_scales, table, int32([5, 7], device),
                                                     int32([0, 5, 12], device), out, 128), [k_cache, out])
    q = torch.randn((5, 4, 64), device=device)
    if op == "flash_attn_paged":
        out = torch.zeros_like(q)
        return (lambda: pagedkv.flash_attn_paged(q, offsets, k_cache, v_cache, lengths, table, k_scales=k_scales,
                                                 v_scales=v_scales, out=out), [k_cache, v_cache, out])
    indices = torch.zeros((5, 2, 3), dtype=torch.int32, device=device)
    return (lambda: pagedkv.flash_attn_paged_sparse(q, k_cache, v_cache, indices, None, k_scales, v_scales),
            [k_cache, v_cache])


OPS = ["paged_store", "paged_load", "flash_attn_paged", "flash_attn_paged_sparse"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad", list(BAD_SCALES))
@pytest.mark.parametrize("which", ["k", "v"])
def test_bad_scale_raises_and_writes_nothing(device, op, bad, which):
    if op == "paged_load" and which == "v":
        pytest.skip("paged_load has one scales argument")
    make_bad, message = BAD_SCALES[bad]
    good = one_scale(0.5, device)
    k_scales, v_scales = (make_bad(device), good) if which == "k" else (good, make_bad(device))
    call, untouched = run_op(op, device, k_scales, v_scales)
    before = [t.clone() for t in untouched] + [k_scales.clone(), v_scales.clone()]
    name = "scales" if op == "paged_load" else f"{which}_scales"
    with index_value_checks(device), pytest.raises(RuntimeError, match=rf"{op}: {name}\b.*{message}"):
        call()
    for got, want in zip(untouched + [k_scales, v_scales], before):
        assert_bytes_equal(got.reshape(-1), want.reshape(-1), f"{op} after a bad {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_valid_calls_pass_where_bad_ones_fail(device):
    """The error setup itself is valid: the errors above come from the scales alone."""
    for op in OPS:
        call, _ = run_op(op, device, one_scale(0.5, device), one_scale(0.25, device, (1,)))
        call()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=DEVICES[1].marks, id="cuda")])
@pytest.mark.parametrize("op", OPS)
def test_scale_on_another_device(device, op):
    call, untouched = run_op(op, device, one_scale(0.5, "cpu"), one_scale(0.5, device))
    before = [t.clone() for t in untouched]
    name = "scales" if op == "paged_load" else "k_scales"
    with pytest.raises(RuntimeError, match=rf"{name} must be on the same device"):
        call()
    for got, want in zip(untouched, before):
        assert_bytes_equal(got, want, f"{op} after a scale on the host")


@pytest.mark.parametrize("device", DEVICES)
def test_per_tensor_scale_of_a_float_cache_is_refused(device):
    k_cache, v_cache, table, offsets, lengths, key = error_setup(device)
    with pytest.raises(RuntimeError, match="k_scales must be None"):
        pagedkv.paged_store(key, key, k_cache.float(), v_cache.float(), offsets, lengths, table,
                            one_scale(0.5, device), None)


# ---------------------------------------------------------------- opcheck, torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    k_cache, v_cache, table, offsets, lengths, key = error_setup(device)
    k_scale, v_scale = one_scale(0.05, device), one_scale(0.07, device, (1,))
    opcheck(torch.ops.pagedkv.paged_store.default,
            (key, key, k_cache, v_cache, offsets, lengths, table, k_scale, v_scale, 128),
            cache_dtype=torch.float8_e4m3fn)
    q = torch.randn((5, 4, 64), device=device, dtype=torch.bfloat16)
    attn = (q, offsets, k_cache, v_cache, lengths, table, None, True, k_scale, v_scale, 128, -1, 0.0, None)
    opcheck(torch.ops.pagedkv.flash_attn_paged.default, attn, cache_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    def step(key, value, q, k_cache, v_cache, offsets, lengths, table, k_scale, v_scale):
        pagedkv.paged_store(key, value, k_cache, v_cache, offsets, lengths, table, k_scale, v_scale)
        return pagedkv.flash_attn_paged(q, offsets, k_cache, v_cache, lengths, table, k_scales=k_scale,
                                        v_scales=v_scale)

    k_cache, v_cache, table, offsets, lengths, key = error_setup(device)
    q = torch.randn((5, 4, 64), device=device, dtype=torch.bfloat16)
    value = key * 0.5
    scales = (one_scale(0.02, device), one_scale(0.03, device, (1,)))
    eager_caches = (k_cache.clone(), v_cache.clone())
    expected = supported_or_skip(device, step, key, value, q, *eager_caches, offsets, lengths, table, *scales)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(key, value, q, k_cache, v_cache, offsets, lengths, table, *scales)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_bytes_equal(k_cache, eager_caches[0], "compiled k_cache")
    assert_bytes_equal(v_cache, eager_caches[1], "compiled v_cache")
