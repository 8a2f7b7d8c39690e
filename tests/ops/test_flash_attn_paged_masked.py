"""flash_attn_paged with a NaN or inf in a key that some query rows cannot see.

A key after a query's position (causal) or before its window is masked for that query: its
probability is 0, and 0 * NaN is NaN, so a non-finite V value (or FP8 V scale, or K value/scale)
of a key that another row of the same tile does see must still never reach the masked row's
output. Each case puts one bad key at the causal diagonal or at the window's edge of a prefill
chunk (rows in one work item, many items, a split key range), on one KV head; the rows that do not
see it, and every head of the other KV heads, must equal the float64 reference (which sums only
the keys each row sees, pagedkv.reference._attend_visible); the rows that see a bad V value must be
non-finite on its heads. `per_isa`: scripts/test.sh reruns these on every CPU kernel path.
"""

from __future__ import annotations

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

pytestmark = [pytest.mark.usefixtures("cuda_knobs"), pytest.mark.per_isa]

# (cache dtype, quant_group): FP8 with scale groups smaller than a row, and one scale per token
CACHES = [
    (torch.float32, 128),
    (torch.bfloat16, 128),
    (torch.float16, 128),
    (torch.float8_e4m3fn, 32),
    (torch.float8_e4m3fn, 128),
    (torch.float8_e5m2, 128),
]
BAD = ["v_nan", "v_inf", "v_scale_nan", "k_nan", "k_scale_nan"]
# (cached, new) tokens of the one batch row, head_dim, query heads per KV head, page size
SHAPES = [
    ((5, 3), 64, 1, 4),  # the report's case: 8 keys, rows at 5, 6, 7
    ((40, 70), 128, 4, 16),  # a chunk crossing key tiles, GQA
    ((2000, 3), 64, 2, 1),  # a long row: the key range is split over work items
]


def _make(cache_dtype, group, head_dim, num_kv_heads, page_size, total, gen):
    pages = (total + page_size - 1) // page_size + 1
    k = randn(gen, (pages, page_size, num_kv_heads, head_dim))
    v = randn(gen, (pages, page_size, num_kv_heads, head_dim))
    if cache_dtype.is_floating_point and cache_dtype.itemsize >= 2:
        return k.to(cache_dtype), v.to(cache_dtype), None, None
    kc, ks = ref.quantize_fp8(k, cache_dtype, group)
    vc, vs = ref.quantize_fp8(v, cache_dtype, group)
    return kc, vc, ks, vs


def _poison(bad, kc, vc, ks, vs, page, slot):
    """Make (page, slot) of KV head 0 non-finite as `bad` says; False when the cache has no such part."""
    part = {"v": vc, "k": kc, "v_scale": vs, "k_scale": ks}[bad.rsplit("_", 1)[0]]
    if part is None:
        return False
    value = float("inf") if bad.endswith("inf") else float("nan")
    if part.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if value == float("inf") and part.dtype == torch.float8_e4m3fn:
            return False  # e4m3fn has no inf
        part[page, slot, 0] = torch.tensor(value).to(part.dtype)
    else:
        part[page, slot, 0] = value
    return True


def _case(device, cache_dtype, group, bad, where, shape, q_dtype, op="attn"):
    (cached, new), head_dim, gqa, page_size = shape
    total, num_kv_heads = cached + new, 2
    gen = generator(seed_from("masked-nonfinite", str(cache_dtype), group, bad, where, shape, str(q_dtype)))
    kc, vc, ks, vs = _make(cache_dtype, group, head_dim, num_kv_heads, page_size, total, gen)
    pages = kc.shape[0]
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(1, -1)
    positions = torch.arange(cached, total)
    if where == "causal":
        key, window = total - 2, -1  # seen by the last two rows only
        sees = positions >= key
    else:
        window = max(1, new // 2)
        key = cached + new // 2 - window  # seen by the first half of the chunk only
        sees = (positions - window <= key) & (positions >= key)
    logical_page, slot = divmod(key, page_size)
    if not _poison(bad, kc, vc, ks, vs, int(table[0, logical_page]), slot):
        pytest.skip(f"{bad} does not exist for {dtype_name(cache_dtype)} caches")
    q = randn(gen, (new, num_kv_heads * gqa, head_dim), q_dtype)
    offsets = torch.tensor([0, new], dtype=torch.int32)
    lengths = torch.tensor([cached], dtype=torch.int32)
    args = [offsets, kc, vc, lengths, table]
    kwargs = dict(k_scales=ks, v_scales=vs, quant_group=group, window_left=window)
    dev = [t.to(device) for t in args]
    dkw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
    if op == "lse":
        got, got_lse = supported_or_skip(device, pagedkv.flash_attn_paged_lse, q.to(device), *dev, **dkw)
        want, want_lse = ref.flash_attn_paged_lse(q.double(), *args, **kwargs)
    else:
        got = supported_or_skip(device, pagedkv.flash_attn_paged, q.to(device), *dev, **dkw)
        want = ref.flash_attn_paged(q.double(), *args, **kwargs)
    bad_heads = slice(0, gqa)  # the query heads of KV head 0
    what = f"{bad} key at {key} ({where}), rows {sees.nonzero().flatten().tolist()} see it"
    on = sees.to(got.device)  # the output stays on its device: the tolerance follows it (CUDA: 16-bit queries)
    assert_attention_close(got[~on], want[~sees], q_dtype, f"rows that do not see the {what}", q16_on_cuda=True)
    assert_attention_close(got[on, gqa:], want[sees, gqa:], q_dtype, f"KV head 1, {what}", q16_on_cuda=True)
    if bad.startswith("v"):
        assert not torch.isfinite(got[on, bad_heads]).any(), f"rows that see the {what} must be non-finite"
    if op == "lse":
        assert_lse_close(got_lse[~on], want_lse[~sees], q_dtype, f"lse, {what}", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0][0]}+{s[0][1]}-d{s[1]}-g{s[2]}-p{s[3]}")
@pytest.mark.parametrize("where", ["causal", "window"])
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("cache", CACHES, ids=lambda c: f"{dtype_name(c[0])}-G{c[1]}")
def test_masked_nonfinite_key_never_reaches_rows_that_cannot_see_it(device, cache, bad, where, shape):
    q_dtype = torch.float32 if cache[0] == torch.float32 else torch.bfloat16
    _case(device, cache[0], cache[1], bad, where, shape, q_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("cache", [(torch.bfloat16, 128), (torch.float8_e4m3fn, 128)], ids=lambda c: dtype_name(c[0]))
def test_masked_nonfinite_value_every_query_dtype_and_lse(device, q_dtype, cache):
    _case(device, cache[0], cache[1], "v_nan", "causal", SHAPES[1], q_dtype, op="lse")
    _case(device, cache[0], cache[1], "v_scale_nan", "window", SHAPES[1], q_dtype, op="lse")


def test_report_example_and_cascade():
    """The report's reproduction (queries at 5 and 6 cannot see key 7), and cascade_attention over a
    shared prefix whose suffix holds a NaN value past two of the three rows."""
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    torch.manual_seed(0)
    kc, vc, q = torch.randn(4, 4, 1, 8), torch.randn(4, 4, 1, 8), torch.randn(3, 1, 8)
    vc[1, 3] = float("nan")  # key 7
    o = pagedkv.flash_attn_paged(q, t([0, 3]), kc, vc, t([5]), t([[0, 1]]))
    assert not o[:2].isnan().any() and o[2].isnan().all()
    clean = vc.clone()
    clean[1, 3] = 0.0
    want = ref.flash_attn_paged(q.double(), t([0, 3]), kc, clean, t([5]), t([[0, 1]]))
    torch.testing.assert_close(o[:2].double(), want[:2], atol=1e-5, rtol=1e-5)
    # cascade: page 0 (keys 0..3) shared by two rows; each row's suffix page holds a NaN at key 7
    kc2, vc2 = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8)
    vc2[1, 3] = vc2[2, 3] = float("nan")
    q2 = torch.randn(6, 1, 8)
    args = (t([0, 3, 6]), kc2, vc2, t([5, 5]), t([[0, 1], [0, 2]]))
    got = pagedkv.cascade_attention(q2, *args, shared_pages=1)
    vclean = vc2.clone()
    vclean[1, 3] = vclean[2, 3] = 0.0
    want = ref.flash_attn_paged(q2.double(), args[0], kc2, vclean, *args[3:])
    for rows in (slice(0, 2), slice(3, 5)):
        torch.testing.assert_close(got[rows].double(), want[rows], atol=1e-5, rtol=1e-5)
    assert got[2].isnan().all() and got[5].isnan().all()
