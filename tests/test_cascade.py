"""pagedkv.cascade_attention (shared-prefix batches: the prefix attended once for all queries, the rest
per request, merged by log-sum-exp) against pagedkv.reference's flash_attn_paged over the whole
sequences; its argument checks; the device-side path (lse + merge with sinks) under torch.compile.
"""

from __future__ import annotations


import pytest
import torch

import pagedkv
from conftest import (
    DEVICES,
    assert_attention_close,
    dtype_name,
    fill_history,
    generator,
    make_setup,
    randn,
    ragged_inputs,
    seed_from,
    supported_or_skip,
)
from pagedkv import reference as ref

def shared_prefix_batch(gen, device, *, shared_pages, own, new, page_size=8, cache_dtype=torch.bfloat16,
                        num_pages=None):
    """B rows sharing their first `shared_pages` pages, each with `own[b]` more cached tokens and
    `new[b]` new ones (already stored)."""
    batch_rows = [(shared_pages * page_size + o, n) for o, n in zip(own, new)]
    kv, batch = make_setup(gen, batch_rows, layout="collection", page_size=page_size, num_kv_heads=2,
                           head_dim=32, dtype=cache_dtype, quant_group=16, device=device)
    fill_history(gen, kv, batch)
    # every row now points its first pages at row 0's: the prefix is stored once
    table = batch.lookup_table.clone()
    table[:, :shared_pages] = table[:1, :shared_pages]
    return kv, batch, table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cascade_equals_flash_attn_paged(device, cache_dtype, with_sinks):
    gen = generator(seed_from("cascade", dtype_name(cache_dtype), with_sinks))
    kv, batch, table = shared_prefix_batch(gen, device, shared_pages=3, own=[5, 0, 17, 9], new=[1, 4, 1, 2],
                                           cache_dtype=cache_dtype)
    q = ragged_inputs(gen, batch.num_tokens + 2, 8, 32, torch.float32, device)  # 2 padding rows
    sinks = randn(gen, (8,), torch.float32, device) if with_sinks else None
    common = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=16, softcap=3.0, sinks=sinks)
    got = supported_or_skip(device, pagedkv.cascade_attention, q, batch.input_row_offsets, kv.k_cache, kv.v_cache,
                            batch.cache_lengths, table, 3, **common)
    expected = ref.flash_attn_paged(q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                    batch.cache_lengths, table, **common)
    assert_attention_close(got, expected, torch.float32, "cascade", q16_on_cuda=True)
    assert (got[batch.num_tokens:] == 0).all()


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score", [2.0**17, 2.0**20, 2.0**23, -(2.0**23)], ids=lambda s: f"{s:g}")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn],
                         ids=dtype_name)
def test_cascade_is_exact_at_large_scores(device, cache_dtype, score):
    """Every key scores `score` (1e5..1e7): the prefix's 4 keys hold V = 1, the row's own 4 keys V = 3,
    so the attention is exactly 2. The two partial log-sum-exps are equal; merging them through a
    float32 logaddexp gave 2.008 to 2.5 here."""
    if device == "cuda" and cache_dtype == torch.float16 and abs(score) > torch.finfo(torch.float16).max:
        pytest.skip("CUDA multiplies queries in the cache's 16-bit type: a query element of "
                    f"{score:g} is past float16's range")
    page, dim = 4, 8
    k_cache = torch.zeros((3, page, 1, dim), dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    scales = (torch.zeros((3, page, 1, 1), device=device) if cache_dtype == torch.float8_e4m3fn else None)
    v_scales = scales.clone() if scales is not None else None
    key = torch.zeros((2 * page, 1, dim), device=device)
    key[:, 0, 0] = 1.0
    value = torch.full((2 * page, 1, dim), 3.0, device=device)
    value[:page] = 1.0
    table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
    index = lambda *values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    pagedkv.paged_store(key, value, k_cache, v_cache, index(0, 2 * page), index(0), table, scales, v_scales,
                        quant_group=dim)
    for q_dtype in (torch.float32, torch.bfloat16):
        q = torch.zeros((1, 2, dim), dtype=q_dtype, device=device)
        q[0, :, 0] = score  # a power of two: every score is exactly `score`
        args = (q, index(0, 1), k_cache, v_cache, index(2 * page - 1), table)
        common = dict(scale=1.0, k_scales=scales, v_scales=v_scales, quant_group=dim)
        got = supported_or_skip(device, pagedkv.cascade_attention, *args, 1, **common)
        expected = ref.flash_attn_paged(*args, **common)
        assert torch.equal(got.float(), torch.full_like(got.float(), 2.0)), (q_dtype, got)
        assert torch.equal(expected.float(), got.float())


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_more_queries_than_prefix_tokens(device):
    """Prefill chunks longer than the prefix: the prefix part runs in chunks of <= prefix tokens."""
    gen = generator(7)
    kv, batch, table = shared_prefix_batch(gen, device, shared_pages=1, own=[0, 3], new=[11, 6], page_size=4)
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32, device)
    got = supported_or_skip(device, pagedkv.cascade_attention, q, batch.input_row_offsets, kv.k_cache, kv.v_cache,
                            batch.cache_lengths, table, 1, k_scales=kv.k_scales, v_scales=kv.v_scales,
                            quant_group=16)
    expected = ref.flash_attn_paged(q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                    batch.cache_lengths, table, k_scales=kv.k_scales, v_scales=kv.v_scales,
                                    quant_group=16)
    assert_attention_close(got, expected, torch.float32, "cascade chunks", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_empty_steps_equal_flash_attn_paged(device):
    """No query rows (T = 0), and no batch row (B = 0, the query rows all padding): torch.cat of no
    prefix chunks raised "expected a non-empty list of Tensors", and B = 0 had no row 0 to take the
    shared pages from. Both now give flash_attn_paged's empty or all-zero result."""
    gen = generator(5)
    kv, batch, table = shared_prefix_batch(gen, device, shared_pages=2, own=[1, 3], new=[0, 0])
    common = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=16)
    index = lambda *values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    for rows, q_rows, offsets, lengths, lookup in [
        ("T=0", 0, batch.input_row_offsets, batch.cache_lengths, table),
        ("B=0", 0, index(0), index(), table[:0]),
        ("B=0, 3 padding rows", 3, index(0), index(), table[:0]),
    ]:
        q = ragged_inputs(gen, q_rows, 4, 32, torch.float32, device)
        got = supported_or_skip(device, pagedkv.cascade_attention, q, offsets, kv.k_cache, kv.v_cache, lengths,
                                lookup, 2, **common)
        assert got.shape == (q_rows, 4, 32) and got.dtype == q.dtype, rows
        assert (got == 0).all(), rows


def test_cascade_rejects_rows_that_do_not_share_the_prefix():
    gen = generator(3)
    kv, batch, table = shared_prefix_batch(gen, "cpu", shared_pages=2, own=[1, 2], new=[1, 1])
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32)
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths)
    bad = table.clone()
    bad[1, 1] = (int(bad[0, 1]) + 1) % kv.k_cache.shape[0]
    with pytest.raises(ValueError, match=r"lookup_table\[:, :shared_pages\].*rows \[1\]"):
        pagedkv.cascade_attention(*args, bad, 2)
    with pytest.raises(ValueError, match="cache_lengths.*>= the shared prefix"):
        pagedkv.cascade_attention(q, batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                  torch.tensor([1, 30], dtype=torch.int32), table, 2)
    with pytest.raises(ValueError, match="shared_pages must be in"):
        pagedkv.cascade_attention(*args, table, 0)
    with pytest.raises(TypeError, match="shared_pages must be an int"):
        pagedkv.cascade_attention(*args, table, 2.0)


def test_cascade_checks_its_arguments_by_name_as_the_ops_do():
    """The cascade reads input_row_offsets, cache_lengths and lookup_table itself (the prefix check,
    the offsets' end, the table's columns) before any op sees them: 2-D or empty offsets gave a
    broadcast error or an IndexError, meta lengths or tables beside a CPU cache "Cannot copy out of meta
    tensor". Each is now refused naming the argument (type, rank, int32, device, B), nothing computed."""
    gen = generator(4)
    kv, batch, table = shared_prefix_batch(gen, "cpu", shared_pages=2, own=[1, 2], new=[1, 1])
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32)
    offsets, lengths = batch.input_row_offsets, batch.cache_lengths
    good = dict(q=q, input_row_offsets=offsets, k_cache=kv.k_cache, v_cache=kv.v_cache, cache_lengths=lengths,
                lookup_table=table)
    cases = [  # (argument, bad value, error, message after "cascade_attention: ")
        ("input_row_offsets", offsets[None], ValueError, r"input_row_offsets must be 1-D \[B\+1\], got 2-D"),
        ("input_row_offsets", offsets[:0], ValueError,
         r"input_row_offsets\.size\(0\) must be B\+1 \(B = 2 rows of cache_lengths\), got 0"),
        ("input_row_offsets", offsets.tolist(), TypeError, r"input_row_offsets must be a 1-D tensor \[B\+1\], got list"),
        ("input_row_offsets", offsets.long(), ValueError, r"input_row_offsets must be int32, got int64"),
        ("cache_lengths", lengths.to("meta"), ValueError,
         r"cache_lengths must be on the same device as k_cache \(cpu\), got meta"),
        ("cache_lengths", lengths[:1], ValueError, r"lookup_table\.size\(0\) must be 1 \(B, the length of cache_lengths\)"),
        ("lookup_table", table.to("meta"), ValueError,
         r"lookup_table must be on the same device as k_cache \(cpu\), got meta"),
        ("lookup_table", table[0], ValueError, r"lookup_table must be 2-D \[B, max_pages\], got 1-D"),
        ("q", q[0], ValueError, r"q must be 3-D \[T, Hq, D\], got 2-D"),
        ("k_cache", kv.k_cache[0], ValueError, r"k_cache must be 4-D \[N, P, Hk, D\], got 3-D"),
    ]
    for name, value, error, message in cases:
        with pytest.raises(error, match=rf"^cascade_attention: {message}"):
            pagedkv.cascade_attention(**{**good, name: value}, shared_pages=2)



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_cascade_fullgraph(device, backend):
    gen = generator(5)
    kv, batch, table = shared_prefix_batch(gen, device, shared_pages=2, own=[3, 1, 0], new=[1, 1, 1])
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32, device)
    sinks = randn(gen, (4,), torch.float32, device)

    def attend(q, offsets, lengths, table):
        # two partial attentions merged, with sinks: the cascade's device-side path
        a, la = pagedkv.flash_attn_paged_lse(q, offsets, kv.k_cache, kv.v_cache, lengths, table, sinks=sinks)
        b, lb = pagedkv.flash_attn_paged_lse(q, offsets, kv.k_cache, kv.v_cache, lengths, table)
        return pagedkv.merge_attn_states(a, la, b, lb)

    expected = supported_or_skip(device, attend, q, batch.input_row_offsets, batch.cache_lengths, table)
    got = torch.compile(attend, backend=backend, fullgraph=True)(q, batch.input_row_offsets,
                                                                 batch.cache_lengths, table)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "fp8_rope"])
def test_cascade_over_packed_mla_rows(device, kv_format):
    """Packed MLA rows (kv_format, v_cache None): the cascade equals flash_attn_paged over the whole
    sequences (the float64 reference), sinks and softcap on."""
    gen = generator(seed_from("cascade-mla", kv_format))
    page_size, shared_pages, heads = 8, 2, 16
    own, new = [5, 0, 11], [1, 3, 1]
    rows = len(own)
    pages_per_row = shared_pages + max(-(-(o + n) // page_size) for o, n in zip(own, new))
    num_pages = rows * pages_per_row
    row_width = 656 if kv_format == "fp8_ds_mla" else 640
    cache = torch.zeros(num_pages, page_size, 1, row_width, dtype=torch.uint8)
    scale = torch.tensor([0.02]) if kv_format == "fp8_rope" else None
    # store every row's keys (the prefix once, in row 0's pages) through the op itself
    table = torch.randperm(num_pages, generator=gen).to(torch.int32).view(rows, pages_per_row)
    table[:, :shared_pages] = table[:1, :shared_pages]
    lengths = [shared_pages * page_size + o for o in own]
    for b in range(rows):
        first = 0 if b == 0 else shared_pages * page_size  # row 0 writes the prefix
        count = lengths[b] + new[b] - first
        keys = randn(gen, (count, 1, 576))
        pagedkv.paged_store(keys, None, cache, None, torch.tensor([0, count], dtype=torch.int32),
                            torch.tensor([first], dtype=torch.int32), table[b:b + 1], scale, kv_format=kv_format)
    offsets = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    cache_lengths = torch.tensor(lengths, dtype=torch.int32)
    q = randn(gen, (int(offsets[-1]), heads, 576))
    sinks = randn(gen, (heads,))
    common = dict(k_scales=scale, softcap=3.0, sinks=sinks, kv_format=kv_format)
    on = (lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
    got = supported_or_skip(device, pagedkv.cascade_attention, on(q), on(offsets), on(cache), None,
                            on(cache_lengths), on(table), shared_pages, **{k: on(v) for k, v in common.items()})
    expected = ref.flash_attn_paged(q.double(), offsets, cache, None, cache_lengths, table, **common)
    assert_attention_close(got, expected, torch.float32, f"cascade {kv_format}", q16_on_cuda=True)
