"""Pools over 2^31 elements: element offsets of the last pages do not fit int32.

The pool is an FP8 collection-style block [N, 2, P, Hk, D] (K and V of one page side by side,
4096 bytes per page) with N chosen so the last page's K and V both start past element 2^31
(~2.1 GB). It is allocated with torch.empty, so only the few OS pages the test writes are ever
touched: the test runs in about a second and needs ~2.2 GB of address space, not of RAM.

What it proves: paged_store writes the last page at the right place (its bytes equal a store into
a one-page pool), neighbours keep their sentinels, paged_load reads it back, and attention over a
sequence living in the last page equals, bit for bit, attention over the same data in page 0 of a
small pool (same kernel, same data: only the 64-bit offsets differ). The last test does the
same with separate K and V pools on every device.
"""

from __future__ import annotations

import os

import pytest
import torch

import pagedkv
from conftest import DEVICES, assert_attention_close, assert_bytes_equal, generator, randn, seed_from
from pagedkv import reference as ref

P, HK, D = 16, 1, 128
PAGE_BYTES = 2 * P * HK * D  # K and V of one page, FP8
NUM_PAGES = 2**31 // PAGE_BYTES + 2  # K of the last page starts at element > 2^31
FP8 = torch.float8_e4m3fn


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


# The shared pool below: its last page's K and V start past element 2^31 of one block.
NEEDS_4_GIB = pytest.mark.skipif(
    _available_bytes() < 4 * 2**30 or os.environ.get("PAGEDKV_SKIP_LARGE") == "1",
    reason="needs ~4 GiB of available memory (set PAGEDKV_SKIP_LARGE=1 to skip)",
)


@pytest.fixture(scope="module")
def pool():
    blocks = torch.empty((NUM_PAGES, 2, P, HK, D), dtype=FP8)
    scales = torch.empty((NUM_PAGES, 2, P, HK, 1), dtype=torch.float32)
    k, v = blocks[:, 0], blocks[:, 1]
    assert k.storage_offset() + (NUM_PAGES - 1) * k.stride(0) > 2**31
    return blocks, scales


def _index(cache_len, new, page):
    return (
        torch.tensor([0, new], dtype=torch.int32),
        torch.tensor([cache_len], dtype=torch.int32),
        torch.tensor([[page]], dtype=torch.int32),
    )


@NEEDS_4_GIB
def test_store_load_attention_on_the_last_page(pool):
    blocks, scales = pool
    last = NUM_PAGES - 1
    gen = torch.Generator().manual_seed(7)
    # sentinels in the neighbours of the last page and in page 0
    sentinel_pages = (0, last - 1)
    for page in sentinel_pages:
        blocks[page].view(torch.uint8).fill_(0x5A)
        scales[page].fill_(3.0)
    key = torch.randn((P, HK, D), generator=gen)
    value = torch.randn((P, HK, D), generator=gen)
    k, v, ks, vs = blocks[:, 0], blocks[:, 1], scales[:, 0], scales[:, 1]
    offsets, lengths, table = _index(0, P, last)
    pagedkv.paged_store(key, value, k, v, offsets, lengths, table, ks, vs, quant_group=D)

    # the same store into a one-page pool with the reference
    small = torch.zeros((1, 2, P, HK, D), dtype=FP8)
    small_scales = torch.zeros((1, 2, P, HK, 1))
    ref.paged_store(key, value, small[:, 0], small[:, 1], offsets, lengths, torch.tensor([[0]], dtype=torch.int32),
                    small_scales[:, 0], small_scales[:, 1], D)
    assert torch.equal(blocks[last].view(torch.uint8), small[0].view(torch.uint8))
    assert torch.equal(scales[last], small_scales[0])
    for page in sentinel_pages:
        assert (blocks[page].view(torch.uint8) == 0x5A).all(), f"page {page} changed"
        assert (scales[page] == 3.0).all(), f"scales of page {page} changed"

    # load it back (FP8 dequantized) and compare with the reference's load of the small pool
    seq = torch.tensor([P], dtype=torch.int32)
    loaded = pagedkv.paged_load(v, table, seq, scales=vs, quant_group=D)
    expected = torch.empty_like(loaded)
    ref.paged_load(small[:, 1], small_scales[:, 1], torch.tensor([[0]], dtype=torch.int32), seq,
                   torch.tensor([0, P], dtype=torch.int32), expected, D)
    assert torch.equal(loaded, expected)

    # attention over the last page == attention over page 0 of the small pool, bit for bit
    q = torch.randn((P, 4, D), generator=gen)
    big_out = pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table, k_scales=ks, v_scales=vs, quant_group=D)
    small_out = pagedkv.flash_attn_paged(q, offsets, small[:, 0], small[:, 1], lengths,
                                         torch.tensor([[0]], dtype=torch.int32), k_scales=small_scales[:, 0],
                                         v_scales=small_scales[:, 1], quant_group=D)
    assert torch.equal(big_out, small_out)
    want = ref.flash_attn_paged(q, offsets, small[:, 0], small[:, 1], lengths, torch.tensor([[0]], dtype=torch.int32),
                                k_scales=small_scales[:, 0], v_scales=small_scales[:, 1], quant_group=D)
    torch.testing.assert_close(big_out, want, rtol=1e-5, atol=1e-5)


@NEEDS_4_GIB
def test_rows_spanning_the_whole_pool(pool):
    """Two rows whose pages are the first and the last of the pool, in one call each op."""
    blocks, scales = pool
    last = NUM_PAGES - 1
    gen = torch.Generator().manual_seed(8)
    k, v, ks, vs = blocks[:, 0], blocks[:, 1], scales[:, 0], scales[:, 1]
    key = torch.randn((2 * P, HK, D), generator=gen)
    offsets = torch.tensor([0, P, 2 * P], dtype=torch.int32)
    lengths = torch.tensor([0, 0], dtype=torch.int32)
    table = torch.tensor([[last], [0]], dtype=torch.int32)
    pagedkv.paged_store(key, key, k, v, offsets, lengths, table, ks, vs, quant_group=D)
    out = pagedkv.paged_load(k, table, torch.tensor([P, P], dtype=torch.int32), scales=ks, quant_group=D)
    # row 0 (last page) and row 1 (page 0) hold the same quantisation of their inputs
    small = torch.zeros((2, P, HK, D), dtype=FP8)
    small_scales = torch.zeros((2, P, HK, 1))
    ref.paged_store(key, None, small, None, offsets, lengths, torch.tensor([[0], [1]], dtype=torch.int32),
                    small_scales, None, D)
    want = torch.empty_like(out)
    ref.paged_load(small, small_scales, torch.tensor([[0], [1]], dtype=torch.int32),
                   torch.tensor([P, P], dtype=torch.int32), offsets, want, D)
    assert torch.equal(out, want)
    q = torch.randn((2 * P, 2, D), generator=gen)
    got = pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table, k_scales=ks, v_scales=vs, quant_group=D)
    expected = pagedkv.flash_attn_paged(q, offsets, small, small, lengths, torch.tensor([[0], [1]], dtype=torch.int32),
                                        k_scales=small_scales, v_scales=small_scales, quant_group=D)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_separate_pools_over_2_31_elements(device):
    """Separate K and V pools [N, P, Hk, D] with pages past element 2^31, on every device: store,
    attention and load there equal the same step on a 4-page pool (memory left untouched except
    the pages used, so this costs little resident memory)."""
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
    # The CUDA kernels attend with 16-bit queries only.
    q_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = randn(gen, (25, 2, D), q_dtype, device)
    out = pagedkv.flash_attn_paged(q, offsets, k_cache, v_cache, lengths, table,
                                   k_scales=k_scales, v_scales=v_scales)
    expected = ref.flash_attn_paged(q.double(), offsets, *small, lengths, small_table,
                                    k_scales=small_scales[0], v_scales=small_scales[1])
    assert_attention_close(out, expected, q_dtype, "pool over 2^31 elements")
    seq_lens = torch.tensor([20, 5], dtype=torch.int32, device=device)
    assert_bytes_equal(
        pagedkv.paged_load(k_cache, table, seq_lens, scales=k_scales),
        pagedkv.paged_load(small[0], small_table, seq_lens, scales=small_scales[0]),
        "load past 2^31",
    )

