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
