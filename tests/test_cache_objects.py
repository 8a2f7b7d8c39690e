"""Cache objects: view geometry of the four layouts, round trips through the ops, KVCacheBatch."""

from __future__ import annotations

import importlib
import math
import sys
import types

import pytest
import torch

import pagedkv
from conftest import (
    DEVICES,
    FP8_DTYPES,
    assert_attention_close,
    dtype_name,
    make_batch,
    randn,
)
from pagedkv import reference as ref
from pagedkv.cache import (
    ContinuousBatchingKVCache,
    KVCacheBatch,
    PagedKVCache,
    PagedKVCacheCollection,
    PagedKVCacheFA3Fallback,
)

N, L, P, HK, D = 7, 3, 4, 2, 16


def _reference_ops_module():
    """A stand-in for pagedkv.ops that runs the plain-torch reference."""

    def paged_load(cache, lookup_table, seq_lens, scales=None, out_dtype=None, quant_group=128, *, kv_format=None):
        if out_dtype is None:
            out_dtype = torch.float32 if cache.dtype in FP8_DTYPES else cache.dtype
        offsets = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(seq_lens, 0)
        out = torch.empty((int(offsets[-1]), *cache.shape[2:]), dtype=out_dtype)
        ref.paged_load(cache, scales, lookup_table, seq_lens, offsets, out, quant_group, kv_format)
        return out

    module = types.ModuleType("pagedkv.ops")
    module.paged_store = ref.paged_store
    module.paged_load = paged_load
    module.flash_attn_paged = ref.flash_attn_paged
    return module


@pytest.fixture(params=["reference", "ops"])
def backend(request, monkeypatch):
    """Run the cache objects on the reference (monkeypatched pagedkv.ops) or on the real ops."""
    if request.param == "reference":
        module = _reference_ops_module()
        monkeypatch.setitem(sys.modules, "pagedkv.ops", module)
        monkeypatch.setattr(pagedkv, "ops", module, raising=False)
    else:
        importlib.import_module("pagedkv.ops")  # must exist: no skip
    return request.param


# ---------------------------------------------------------------------------------------------
# View geometry


def _offset_bytes(view, base):
    return view.data_ptr() - base.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
@pytest.mark.parametrize("k_only", [False, True])
def test_collection_views(dtype, k_only):
    cache = PagedKVCacheCollection(N, L, P, HK, D, dtype=dtype, k_only=k_only, quant_group=8)
    kv = 1 if k_only else 2
    assert cache.blocks.shape == (N, kv, L, P, HK, D) and cache.blocks.dtype == dtype
    es = cache.blocks.element_size()
    for layer in range(L):
        k = cache.k_cache(layer)
        assert k.shape == (N, P, HK, D)
        assert k.stride() == (kv * L * P * HK * D, HK * D, D, 1)
        assert _offset_bytes(k, cache.blocks) == layer * P * HK * D * es
        if k_only:
            assert cache.v_cache(layer) is None and cache.v_scales(layer) is None
        else:
            v = cache.v_cache(layer)
            assert v.stride() == k.stride()
            assert _offset_bytes(v, cache.blocks) == (L + layer) * P * HK * D * es
    if dtype in FP8_DTYPES:
        groups = math.ceil(D / 8)
        assert cache.scales.shape == (N, kv, L, P, HK, groups)
        assert cache.scales.dtype == torch.float32
        ks = cache.k_scales(2)
        assert ks.shape == (N, P, HK, groups)
        assert ks.stride() == (kv * L * P * HK * groups, HK * groups, groups, 1)
        assert _offset_bytes(ks, cache.scales) == 2 * P * HK * groups * 4
    else:
        assert cache.scales is None and cache.k_scales(0) is None and cache.v_scales(0) is None


def test_fa3_views_are_shared_by_layers():
    cache = PagedKVCacheFA3Fallback(N, L, P, HK, D, dtype=torch.float8_e5m2, quant_group=128)
    assert cache.blocks.shape == (2, N, P, HK, D)
    assert cache.scales.shape == (2, N, P, HK, 1)
    for layer in range(L):
        assert cache.k_cache(layer).data_ptr() == cache.blocks.data_ptr()
        assert cache.k_cache(layer).is_contiguous()
        assert _offset_bytes(cache.v_cache(layer), cache.blocks) == N * P * HK * D
        assert cache.v_scales(layer).shape == (N, P, HK, 1)
    tables = torch.arange(L * 2 * 3, dtype=torch.int32).reshape(L, 2, 3)
    assert torch.equal(cache._table(1, tables), tables[1])
    assert torch.equal(cache._table(1, tables[0]), tables[0])
    with pytest.raises(ValueError, match="lookup_table"):
        cache._table(0, torch.zeros((L + 1, 2, 3), dtype=torch.int32))


def test_separate_pools():
    cache = PagedKVCache(N, P, HK, D, dtype=torch.float16, num_layers=2)
    assert cache.k_cache(0).shape == (N, P, HK, D) and cache.k_cache(0).is_contiguous()
    assert cache.k_cache(0).data_ptr() != cache.v_cache(0).data_ptr()
    assert cache.k_cache(1).data_ptr() != cache.k_cache(0).data_ptr()
    assert cache.k_scales(0) is None
    single = PagedKVCache(N, P, HK, D, dtype=torch.float8_e4m3fn, quant_group=5, k_only=True)
    assert single.num_layers == 1 and single.v_cache() is None
    assert single.k_scales().shape == (N, P, HK, 4) and single.v_scales() is None


def test_continuous_views_and_lookup_table():
    cache = ContinuousBatchingKVCache(5, L, 12, HK, D, dtype=torch.float32)
    assert cache.blocks.shape == (5, 2, L, 12, HK, D)
    assert cache.page_size == 12 and cache.num_pages == 5
    k = cache.k_cache(1)
    assert k.shape == (5, 12, HK, D) and k.stride() == (2 * L * 12 * HK * D, HK * D, D, 1)
    table = cache.lookup_table([3, 0, 4])
    assert table.dtype == torch.int32 and table.tolist() == [[3], [0], [4]]
    assert cache.lookup_table(torch.tensor([2])).shape == (1, 1)
    with pytest.raises(ValueError, match="slots"):
        cache.lookup_table([1, 5])
    # slots are checked as given: the int32 conversion wrapped 2^32 + 1 to slot 1, truncated 1.7 to 1
    # and took True as 1, silently another row's slot
    with pytest.raises(ValueError, match=r"slots\[0\] must be in \[0, 5\), got 4294967297"):
        cache.lookup_table(torch.tensor([2**32 + 1]))
    for bad in (torch.tensor([1.7]), torch.tensor([True]), [1.7], [True]):
        with pytest.raises(TypeError, match="slots"):
            cache.lookup_table(bad)
    assert cache.lookup_table(torch.tensor([[4], [1]], dtype=torch.int64)).tolist() == [[4], [1]]


# ---------------------------------------------------------------------------------------------
# Round trips through the ops


def _build(kind, dtype, k_only=False, head_dim=D, quant_group=8, device="cpu"):
    common = dict(dtype=dtype, device=device, k_only=k_only, quant_group=quant_group)
    if kind == "collection":
        return PagedKVCacheCollection(24, L, P, HK, head_dim, **common)
    if kind == "fa3":
        return PagedKVCacheFA3Fallback(24, L, P, HK, head_dim, **common)
    if kind == "separate":
        return PagedKVCache(24, P, HK, head_dim, num_layers=L, **common)
    if kind == "continuous":
        return ContinuousBatchingKVCache(6, L, 20, HK, head_dim, **common)
    raise ValueError(kind)


KINDS = ["collection", "fa3", "separate", "continuous"]


def _step(rng, cache, kind, rows, device):
    """Batch metadata for `rows`; FA3 gets stacked per-layer tables [L, B, max_pages]."""
    if kind == "continuous":
        perm = torch.randperm(cache.num_slots, generator=rng)[: len(rows)].tolist()
        table = cache.lookup_table(perm).to(device)
        offsets = torch.tensor([0] + list(_cumsum([n for _, n in rows])), dtype=torch.int32)
        return KVCacheBatch(
            offsets.to(device), torch.tensor([c for c, _ in rows], dtype=torch.int32).to(device),
            table,
        )
    batch, _ = make_batch(rng, rows, page_size=P, num_pages=cache.num_pages, device=device)
    table = batch.lookup_table
    if kind == "fa3":
        # Each layer maps the rows to its own pages of the shared pool.
        per_layer = [table]
        for _ in range(L - 1):
            other, _ = make_batch(rng, rows, page_size=P, num_pages=cache.num_pages, device=device)
            per_layer.append(other.lookup_table)
        width = max(t.shape[1] for t in per_layer)
        table = torch.stack(
            [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in per_layer]
        )
    return KVCacheBatch(batch.input_row_offsets, batch.cache_lengths, table)


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


def _expected_stored(x, dtype, quant_group):
    if dtype in FP8_DTYPES:
        q, s = ref.quantize_fp8(x, dtype, quant_group)
        return ref.dequantize_fp8(q, s, quant_group, torch.float32)
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_store_load_attention_round_trip(rng, backend, device, kind, dtype):
    # the CUDA kernels attend with 16-bit queries and head sizes 64-256
    d, q_dtype = (D, torch.float32) if device == "cpu" else (64, torch.bfloat16)
    cache = _build(kind, dtype, head_dim=d, device=device)
    rows = [(0, 6), (0, 3), (0, 0)]
    step = _step(rng, cache, kind, rows, device)
    layer = 1
    key = randn(rng, (9, HK, d), torch.float32, device)
    value = randn(rng, (9, HK, d), torch.float32, device)
    before = {n: t.clone() for n, t in _storage(cache).items()}
    cache.store(layer, key, value, step.input_row_offsets, step.cache_lengths, step.lookup_table)
    _assert_only_layer_changed(cache, kind, layer, before)

    seq_lens = step.seq_lens()
    k_loaded = cache.load(layer, step.lookup_table, seq_lens)
    v_loaded = cache.load(layer, step.lookup_table, seq_lens, which="v", out_dtype=torch.float32)
    assert k_loaded.dtype == (torch.float32 if dtype in FP8_DTYPES else dtype)
    assert k_loaded.shape == (9, HK, d)
    assert torch.equal(k_loaded.float().cpu(), _expected_stored(key, dtype, 8).float().cpu())
    assert torch.equal(v_loaded.cpu(), _expected_stored(value, dtype, 8).float().cpu())

    # Decode step: one more token for rows 0 and 1, then attend.
    offsets2 = torch.tensor([0, 1, 2, 2], dtype=torch.int32, device=device)
    lengths2 = torch.tensor([6, 3, 0], dtype=torch.int32, device=device)
    step2 = KVCacheBatch(offsets2, lengths2, step.lookup_table)
    assert step2.max_context_length() == 7 and not step2.empty_cache()
    k2 = randn(rng, (2, HK, d), torch.float32, device)
    cache.store(layer, k2, k2, offsets2, lengths2, step.lookup_table)
    # one padding row
    q = randn(rng, (3, 2 * HK, d), q_dtype, device)
    out = cache.attention(layer, q, offsets2, lengths2, step.lookup_table, softcap=2.0)
    table = cache._table(layer, step.lookup_table)
    expected = ref.flash_attn_paged(
        q.double(), offsets2, cache.k_cache(layer), cache.v_cache(layer), lengths2, table,
        k_scales=cache.k_scales(layer), v_scales=cache.v_scales(layer), quant_group=8,
        softcap=2.0,
    )
    assert out.shape == (3, 2 * HK, d) and out.dtype == q_dtype
    assert_attention_close(out, expected, q_dtype, f"{kind} attention")
    assert (out[2] == 0).all()


def _storage(cache):
    if isinstance(cache, PagedKVCache):
        tensors = {f"k{i}": t for i, t in enumerate(cache.k_pools)}
        tensors.update({f"v{i}": t for i, t in enumerate(cache.v_pools or [])})
        tensors.update({f"ks{i}": t for i, t in enumerate(cache.k_scale_pools or [])})
        tensors.update({f"vs{i}": t for i, t in enumerate(cache.v_scale_pools or [])})
        return tensors
    tensors = {"blocks": cache.blocks}
    if cache.scales is not None:
        tensors["scales"] = cache.scales
    return tensors


def _assert_only_layer_changed(cache, kind, layer, before):
    after = _storage(cache)
    for name, old in before.items():
        new = after[name]
        if kind in ("collection", "continuous"):
            other = [i for i in range(L) if i != layer]
            assert torch.equal(new[:, :, other].view(torch.uint8), old[:, :, other].view(torch.uint8))
            assert not torch.equal(new[:, :, layer].view(torch.uint8), old[:, :, layer].view(torch.uint8))
        elif kind == "separate":
            if not name.endswith(str(layer)):
                assert torch.equal(new.view(torch.uint8), old.view(torch.uint8)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=dtype_name)
def test_k_only_mla_attention(rng, backend, dtype):
    head_dim, v_head_dim, group = 576, 512, 64
    cache = PagedKVCacheCollection(8, 2, 4, 1, head_dim, dtype=dtype, k_only=True, quant_group=group)
    rows = [(0, 5), (0, 2)]
    step = _step(rng, cache, "collection", rows, "cpu")
    key = randn(rng, (7, 1, head_dim))
    with pytest.raises(ValueError, match="value"):
        cache.store(0, key, key, step.input_row_offsets, step.cache_lengths, step.lookup_table)
    cache.store(0, key, None, step.input_row_offsets, step.cache_lengths, step.lookup_table)
    loaded = cache.load(0, step.lookup_table, step.seq_lens())
    assert torch.equal(loaded, _expected_stored(key, dtype, group).float())
    with pytest.raises(ValueError, match="which"):
        cache.load(0, step.lookup_table, step.seq_lens(), which="v")
    q = randn(rng, (7, 4, head_dim))
    out = cache.attention(
        0, q, step.input_row_offsets, step.cache_lengths, step.lookup_table,
        v_head_dim=v_head_dim, scale=0.05,
    )
    assert out.shape == (7, 4, v_head_dim)
    ks = cache.k_scales(0)
    expected = ref.flash_attn_paged(
        q.double(), step.input_row_offsets, cache.k_cache(0), cache.k_cache(0)[..., :v_head_dim],
        step.cache_lengths, step.lookup_table, scale=0.05, k_scales=ks,
        v_scales=None if ks is None else ks[..., : v_head_dim // group], quant_group=group,
    )
    assert_attention_close(out, expected, torch.float32, "MLA attention", q16_on_cuda=True)


def test_layer_and_which_errors():
    cache = _build("collection", torch.float16)
    with pytest.raises(ValueError, match="layer"):
        cache.k_cache(L)
    with pytest.raises(TypeError, match="layer"):
        cache.v_cache(1.0)
    with pytest.raises(ValueError, match="which"):
        cache.load(0, torch.zeros((1, 1), dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                   which="q")
    with pytest.raises(ValueError, match="value"):
        cache.store(0, torch.zeros(1, HK, D), None, None, None, None)


# ---------------------------------------------------------------------------------------------
# Constructors


CONSTRUCTORS = {
    "collection": lambda *a, **k: PagedKVCacheCollection(*a, **k),
    "fa3": lambda *a, **k: PagedKVCacheFA3Fallback(*a, **k),
    "continuous": lambda *a, **k: ContinuousBatchingKVCache(*a, **k),
}
ARG_NAMES = {
    "collection": ["num_pages", "num_layers", "page_size", "num_kv_heads", "head_dim"],
    "fa3": ["num_pages", "num_layers", "page_size", "num_kv_heads", "head_dim"],
    "continuous": ["num_slots", "num_layers", "max_seq_len", "num_kv_heads", "head_dim"],
    "separate": ["num_pages", "page_size", "num_kv_heads", "head_dim"],
}
CONSTRUCTORS["separate"] = lambda *a, **k: PagedKVCache(*a, **k)


@pytest.mark.parametrize("kind", KINDS)
def test_constructor_errors(kind):
    make = CONSTRUCTORS[kind]
    good = [4] * len(ARG_NAMES[kind])
    for i, name in enumerate(ARG_NAMES[kind]):
        args = list(good)
        args[i] = 0
        with pytest.raises(ValueError, match=name):
            make(*args)
        args[i] = 2.0
        with pytest.raises(TypeError, match=name):
            make(*args)
        args[i] = True
        with pytest.raises(TypeError, match=name):
            make(*args)
    with pytest.raises(ValueError, match="dtype"):
        make(*good, dtype=torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        make(*good, dtype="bfloat16")
    with pytest.raises(ValueError, match="quant_group"):
        make(*good, quant_group=0)
    with pytest.raises(TypeError, match="k_only"):
        make(*good, k_only=1)
    cache = make(*good, dtype=torch.float8_e5m2, quant_group=3)
    assert cache.k_scales(0).shape[-1] == 2


# ---------------------------------------------------------------------------------------------
# KVCacheBatch


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def test_batch_accessors():
    batch = KVCacheBatch(_i32([0, 5, 5, 6]), _i32([0, 12, 3]), torch.zeros((3, 4), dtype=torch.int32))
    assert batch.batch_size == 3
    assert [batch.cache_length(b) for b in range(3)] == [0, 12, 3]
    assert [batch.num_new_tokens(b) for b in range(3)] == [5, 0, 1]
    assert batch.max_prompt_length() == 5
    assert batch.max_context_length() == 12
    assert not batch.empty_cache()
    assert batch.total_tokens() == 6
    assert batch.seq_lens().tolist() == [5, 12, 4] and batch.seq_lens().dtype == torch.int32
    prefill = KVCacheBatch(_i32([0, 2, 9]), _i32([0, 0]), torch.zeros((2, 1), dtype=torch.int32))
    assert prefill.empty_cache() and prefill.max_context_length() == 7
    empty = KVCacheBatch(_i32([0]), _i32([]), torch.zeros((0, 1), dtype=torch.int32))
    assert empty.batch_size == 0 and empty.max_prompt_length() == 0 and empty.empty_cache()
    assert "batch_size=3" in repr(batch)


def test_batch_row_index_and_int32_lengths():
    batch = KVCacheBatch(_i32([0, 2, 5]), _i32([3, 0]), torch.zeros((2, 1), dtype=torch.int32))
    # Negative rows were Python list indices: num_new_tokens(-1) gave offsets[0] - offsets[-1] = -5.
    for bad in (-1, 2):
        with pytest.raises(IndexError, match=rf"^batch_idx must be in \[0, 2\), got {bad}$"):
            batch.num_new_tokens(bad)
        with pytest.raises(IndexError, match=rf"^batch_idx must be in \[0, 2\), got {bad}$"):
            batch.cache_length(bad)
    with pytest.raises(TypeError, match="^batch_idx must be an int, got float$"):
        batch.cache_length(0.0)
    # A row past int32 wrapped in seq_lens(): cache_lengths 2^31-1 + 2 new gave seq_lens [-2].
    with pytest.raises(ValueError, match=r"^cache_lengths\[0\] \+ new tokens must be <= 2147483647 .*"
                                         r"got 2147483647 \+ 2$"):
        KVCacheBatch(_i32([0, 2]), _i32([2**31 - 1]), torch.zeros((1, 1), dtype=torch.int32))
    edge = KVCacheBatch(_i32([0, 2]), _i32([2**31 - 3]), torch.zeros((1, 1), dtype=torch.int32))
    assert edge.seq_lens().tolist() == [2**31 - 1]


@pytest.mark.parametrize(
    "offsets,lengths,table,exc,name",
    [
        ([0, 1], [0], "i64", TypeError, "lookup_table"),
        ("i64", [0], "ok", TypeError, "input_row_offsets"),
        ([0, 1], "i64", "ok", TypeError, "cache_lengths"),
        ("list", [0], "ok", TypeError, "input_row_offsets"),
        ([0, 1, 2], [0], "ok", ValueError, "input_row_offsets"),
        ([0, 1], [0], "rows", ValueError, "lookup_table"),
        ([0, 1], [0], "1d", ValueError, "lookup_table"),
        ([1, 2], [0], "ok", ValueError, "input_row_offsets"),
        ([0, 3, 2], [0, 0], "ok2", ValueError, "non-decreasing"),
        ([0, 1], [-1], "ok", ValueError, "cache_lengths"),
    ],
)
def test_batch_constructor_errors(offsets, lengths, table, exc, name):
    def tensor(spec):
        if spec == "i64":
            return torch.tensor([0, 1])
        if spec == "list":
            return [0, 1]
        return _i32(spec)

    tables = {
        "i64": torch.zeros((1, 2), dtype=torch.int64),
        "ok": torch.zeros((1, 2), dtype=torch.int32),
        "ok2": torch.zeros((2, 2), dtype=torch.int32),
        "rows": torch.zeros((3, 2), dtype=torch.int32),
        "1d": torch.zeros(1, dtype=torch.int32),
    }
    with pytest.raises(exc, match=name):
        KVCacheBatch(tensor(offsets), tensor(lengths), tables[table])


def test_host_read_arguments_are_checked_by_name():
    """Arguments read on the host: a slot given as one int raised "'int' object is not iterable", meta
    tensors given to KVCacheBatch "Cannot copy out of meta tensor"; both name the argument now."""
    cache = ContinuousBatchingKVCache(5, L, 12, HK, D, dtype=torch.float32)
    for bad in (3, "03", None):
        with pytest.raises(TypeError, match=r"^slots must be a sequence of ints or a 1-D integer tensor, got "):
            cache.lookup_table(bad)
    with pytest.raises(ValueError, match=r"slots must hold values .* got a meta tensor"):
        cache.lookup_table(torch.tensor([1], device="meta"))
    assert cache.lookup_table((4, 1)).tolist() == [[4], [1]]
    meta = [t.to("meta") for t in (_i32([0, 2]), _i32([3]), torch.zeros((1, 1), dtype=torch.int32))]
    with pytest.raises(ValueError, match=r"^KVCacheBatch: input_row_offsets must hold values"):
        KVCacheBatch(*meta)
