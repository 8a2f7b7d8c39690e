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

