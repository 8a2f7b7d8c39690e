"""Aliasing between arguments: a tensor an op reads must share no memory with one it writes, and
written tensors none with each other. A lookup table inside the cache being written changed its page
ids in the middle of a store (a segfault); `v_cache` the same tensor as `k_cache` overwrote K with V;
an `out=` over q or a cache wrote into it. Each is refused with a RuntimeError naming both arguments,
nothing written (`error_cases.expect_error` compares every byte). Views of one allocation that share
no element stay legal: the layout tests of each op run the contract's four layouts (K and V
interleaved page by page in the collection layout, per token in `[N, P, 2, Hk, D]`).
"""

from __future__ import annotations

import math

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

ALIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
POSITIONS = ("first", "middle", "last")


def _row(t, position):
    """The [D] row of a 4-D cache or scales view at its first, a middle or its last (page, slot, head)."""
    n, p, h = t.shape[:3]
    return t[{"first": (0, 0, 0), "middle": (n // 2, p // 2, h // 2), "last": (n - 1, p - 1, h - 1)}[position]]


def _int32_inside(t, position, values):
    """An int32 tensor shaped like `values`, holding them, in t's storage from (or up to) its row at `position`."""
    elements = -(-4 * values.numel() // t.element_size())
    ints = _rows_at(t, position, (elements,)).view(torch.uint8)[: 4 * values.numel()].view(torch.int32)
    ints = ints.view(values.shape)
    ints.copy_(values)  # valid values: the old kernels read them, then overwrote them mid-call
    return ints


def store_args(device, dtype, layout="collection"):
    gen, kv, batch = setup_call(device, dtype, layout)
    k, v, ks, vs = kv.views
    args = dict(key=randn(gen, (batch.num_tokens, HK, D), torch.float32, device),
                value=randn(gen, (batch.num_tokens, HK, D), torch.float32, device), k_cache=k, v_cache=v,
                input_row_offsets=batch.input_row_offsets, cache_lengths=batch.cache_lengths,
                lookup_table=batch.lookup_table, k_scales=ks, v_scales=vs, quant_group=G)
    return kv, args


INDEX_IN_CACHE = [(dtype, index, cache) for dtype in ALIAS_DTYPES
                  for index, cache in [("lookup_table", "k_cache"), ("cache_lengths", "v_cache"),
                                       ("input_row_offsets", "k_cache"), ("cache_lengths", "k_scales"),
                                       ("lookup_table", "v_scales")]
                  if dtype in FP8_DTYPES or not cache.endswith("scales")]


@pytest.mark.per_isa
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("dtype,index,cache", INDEX_IN_CACHE,
                         ids=[f"{dtype_name(d)}-{i}-{c}" for d, i, c in INDEX_IN_CACHE])
def test_paged_store_refuses_index_tensors_inside_a_written_cache(device_cpu, dtype, index, cache, position):
    kv, args = store_args(device_cpu, dtype)
    args[index] = _int32_inside(args[cache], position, args[index])
    expect_error(device_cpu, torch.ops.pagedkv.paged_store, kv, args, [index], [f"{index} overlaps {cache}"])


@pytest.mark.per_isa
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ALIAS_DTYPES, ids=dtype_name)
def test_paged_store_refuses_v_cache_that_is_k_cache(device_cpu, dtype, layout):
    kv, args = store_args(device_cpu, dtype, layout)
    args["v_cache"], args["v_scales"] = args["k_cache"], args["k_scales"]
    expect_error(device_cpu, torch.ops.pagedkv.paged_store, kv, args, ["v_cache"], ["v_cache overlaps k_cache"])


def _rows_at(t, position, shape):
    """A contiguous tensor of `shape` in t's storage that holds t's row at `position`: starting with it
    (first, middle), or ending with it (last, or where the storage would end first)."""
    row = _row(t, position)
    numel = math.prod(shape)
    offset = row.storage_offset() + (row.numel() - numel if position == "last" else 0)
    offset = min(offset, t.untyped_storage().nbytes() // t.element_size() - numel)  # still covers the row
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return row.as_strided(shape, strides, offset)


@pytest.mark.per_isa
@pytest.mark.parametrize("layout", ["collection", "fa3"])
def test_paged_store_refuses_shared_scales_and_shifted_v_cache(device_cpu, layout):
    kv, args = store_args(device_cpu, torch.float8_e5m2, layout)
    args["v_scales"] = args["k_scales"]
    expect_error(device_cpu, torch.ops.pagedkv.paged_store, kv, args, ["v_scales"], ["v_scales overlaps k_scales"])
    # V one token further into K's storage: K and V share every token but one
    kv, args = store_args(device_cpu, torch.float32, layout)
    k = args["k_cache"]
    args["v_cache"] = k.as_strided(k.shape, k.stride(), k.storage_offset() + k.stride(1))
    expect_error(device_cpu, torch.ops.pagedkv.paged_store, kv, args, ["v_cache"], ["v_cache overlaps k_cache"])


@pytest.mark.per_isa
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("target", ["q", "k_cache", "v_cache", "lookup_table", "cache_lengths"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_name)
def test_flash_attn_paged_out_must_not_alias_an_input(device_cpu, dtype, target, position):
    gen, kv, batch = setup_call(device_cpu, dtype, "fa3")  # K, then V: rows of one touch only it
    rows = batch.num_tokens
    fused = randn(gen, (rows + 2, 2 * HK, D), dtype, device_cpu)
    q, out = fused[1 : rows + 1], torch.zeros((rows, 2 * HK, D), dtype=dtype)
    args = dict(q=q, input_row_offsets=batch.input_row_offsets, k_cache=kv.k_cache, v_cache=kv.v_cache,
                cache_lengths=batch.cache_lengths, lookup_table=batch.lookup_table)
    if target == "q":  # out one row before, on, or one row after q
        out = fused[POSITIONS.index(position) : POSITIONS.index(position) + rows]
    elif target in ("k_cache", "v_cache"):
        out = _rows_at(args[target], position, out.shape)
    else:
        args[target] = _int32_inside(out.view(-1, 1, 1, D), position, args[target])
    expect_error(device_cpu, torch.ops.pagedkv.flash_attn_paged.out, kv, dict(args, out=out), [target],
                 [f"{target} overlaps out"])


@pytest.mark.per_isa
@pytest.mark.parametrize("target", ["cache", "lookup_table", "seq_lens", "output_row_offsets"])
@pytest.mark.parametrize("dtype", ALIAS_DTYPES, ids=dtype_name)
def test_paged_load_out_must_not_alias_an_input(device_cpu, dtype, target):
    gen, kv, batch = setup_call(device_cpu, dtype)
    out = torch.zeros((10, HK, D), dtype=torch.float32 if dtype in FP8_DTYPES else dtype)
    args = dict(cache=kv.k_cache, scales=kv.k_scales, lookup_table=batch.lookup_table, seq_lens=batch.seq_lens,
                output_row_offsets=torch.tensor([0, 7, 9], dtype=torch.int32), quant_group=G)
    if target == "cache":  # out's bytes over the cache's middle row
        out = _rows_at(kv.k_cache.view(torch.uint8), "middle", (out.numel() * out.element_size(),))
        out = out.view(torch.float32 if dtype in FP8_DTYPES else dtype).view(10, HK, D)
    else:
        args[target] = _int32_inside(out.view(-1, 1, 1, D), "middle", args[target])
    expect_error(device_cpu, torch.ops.pagedkv.paged_load, kv, dict(args, out=out), [target], [f"{target} overlaps out"])


@pytest.fixture
def device_cpu():
    return "cpu"


# ---------------------------------------------------------------------------------------------
# Packed MLA rows (kv_format): a packed store or load runs as two plain calls (latent with its scales,
# then rope), each checked on its own channels and bytes, and attention reads the rope as a tail past
# the latent view. Each check must still cover the whole rows and the whole key / out: a key whose rope
# channels lay in a row's latent bytes was overwritten by the latent store before the rope was read, and
# paged_load or attention wrote an out lying over rope or latent bytes into the cache.

PACKED_ROWS = {"fp8_ds_mla": (656, 528), "fp8_rope": (640, 512)}  # row bytes, rope offset
PACKED_PAGES, PACKED_PAGE_SIZE = 2, 2


def _packed_pool(kv_format, before=0, after=0):
    """A float32 buffer holding `before` bytes, a packed cache [2, 2, 1, row] of stored rows, then `after`
    bytes; returns (buffer, cache, per-tensor scale or None, offsets, lengths, table) for one row of 3 tokens."""
    row, _ = PACKED_ROWS[kv_format]
    size = PACKED_PAGES * PACKED_PAGE_SIZE * row
    buffer = torch.zeros((before + size + after) // 4, dtype=torch.float32)
    cache = buffer.view(torch.uint8)[before : before + size].view(PACKED_PAGES, PACKED_PAGE_SIZE, 1, row)
    scale = torch.tensor([0.02]) if kv_format == "fp8_rope" else None
    offsets, lengths = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    key = randn(generator(seed_from("packed alias", kv_format)), (3, 1, 576), torch.float32, "cpu")
    pagedkv.paged_store(key, None, cache, None, offsets, lengths, table, scale, kv_format=kv_format)
    return buffer, cache, scale, offsets, lengths, table


def _refused(call, fragment, *tensors):
    """call() raises a RuntimeError containing `fragment`, every byte of `tensors` unchanged."""
    before = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=fragment):
        call()
    for tensor, old in zip(tensors, before):
        assert torch.equal(tensor.view(torch.uint8), old.view(torch.uint8)), "a refused call wrote memory"


@pytest.mark.per_isa
@pytest.mark.parametrize("kv_format", list(PACKED_ROWS))
def test_packed_store_refuses_a_key_over_any_byte_of_the_rows(kv_format):
    # the key (float32 rows of 2304 bytes) ends with its last token's rope channels over page 0's first
    # latent bytes, which the store writes (table [1, 0]: the row's token 2 is page 0's slot 0)
    buffer, cache, scale, offsets, lengths, table = _packed_pool(kv_format, before=2 * 2304 + 2048)
    key = buffer[:3 * 576].view(3, 1, 576)
    key.normal_()
    _refused(lambda: pagedkv.paged_store(key, None, cache, None, offsets, lengths, table, scale,
                                         kv_format=kv_format), "paged_store: key overlaps k_cache", buffer)


def test_packed_store_refuses_a_per_tensor_scale_in_the_rope_bytes():
    buffer, cache, _, offsets, lengths, table = _packed_pool("fp8_rope")
    scale = cache[0, 0, 0, 512:516].view(torch.float32)  # page 0's slot 0 is written
    scale.fill_(0.02)
    key = randn(generator(5), (3, 1, 576), torch.float32, "cpu")
    _refused(lambda: pagedkv.paged_store(key, None, cache, None, offsets, lengths, table, scale,
                                         kv_format="fp8_rope"), "paged_store: k_scales overlaps k_cache", buffer)


@pytest.mark.per_isa
@pytest.mark.parametrize("kv_format", list(PACKED_ROWS))
def test_packed_load_refuses_an_out_over_any_byte_of_the_rows(kv_format):
    # out ends with its last row's rope channels over page 0's first latent bytes
    buffer, cache, scale, offsets, _, table = _packed_pool(kv_format, before=2 * 2304 + 2048)
    out = buffer[:3 * 576].view(3, 1, 576)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    _refused(lambda: torch.ops.pagedkv.paged_load(cache, scale, table, seq_lens, offsets, out, 128, kv_format),
             "paged_load: cache overlaps out", buffer)


def test_packed_load_refuses_a_per_tensor_scale_under_the_rope_channels_of_out():
    buffer, cache, _, offsets, _, table = _packed_pool("fp8_rope", after=3 * 2304)
    out = buffer[-3 * 576:].view(3, 1, 576)
    scale = out[2, 0, 540:541]  # a rope channel of out's last row
    scale.fill_(0.02)
    seq_lens = torch.tensor([3], dtype=torch.int32)
    _refused(lambda: torch.ops.pagedkv.paged_load(cache, scale, table, seq_lens, offsets, out, 128, "fp8_rope"),
             "paged_load: scales overlaps out", buffer)


@pytest.mark.per_isa
@pytest.mark.parametrize("kv_format", list(PACKED_ROWS))
def test_packed_attention_out_must_not_alias_the_rope(kv_format):
    # out starts in the rope bytes of the pool's last row (page 1, slot 1: token 1 of the row)
    row, rope = PACKED_ROWS[kv_format]
    buffer, cache, scale, offsets, lengths, table = _packed_pool(kv_format, after=3 * 16 * 512 * 4)
    start = (cache.numel() - row + rope) // 4
    out = buffer[start : start + 3 * 16 * 512].view(3, 16, 512)
    q = randn(generator(6), (3, 16, 576), torch.float32, "cpu")
    _refused(lambda: pagedkv.flash_attn_paged(q, offsets, cache, None, lengths, table, k_scales=scale,
                                              kv_format=kv_format, out=out), "flash_attn_paged: k_cache overlaps out",
             buffer)
