"""pagedkv.host_alloc.zeros: the cache classes' CPU allocation (huge-page advised on Linux).

Checks values (zero), shape, dtype, contiguity and alignment; that the memory outlives the
allocation it is carved from; that ops store into and read back from such a cache exactly as
from a torch.zeros cache; the small-tensor and PAGEDKV_HUGE_PAGES=0 fallbacks; and that the
cache classes allocate through it.
"""

import gc
import sys

import pytest
import torch

import pagedkv
from pagedkv import host_alloc

HUGE = 2 << 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_zeros_values_shape_alignment(dtype):
    shape = (64, 16, 8, 128)  # 1M elements: 1-4 MiB, past the huge-page threshold for 2+ byte types
    t = host_alloc.zeros(shape, dtype=dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t.float(), torch.zeros(shape))
    if host_alloc.huge_pages_requested(t):
        assert t.data_ptr() % HUGE == 0
    elif t.numel() * t.element_size() >= 2 * HUGE and sys.platform.startswith("linux"):
        pytest.fail("a large CPU tensor on Linux was not advised (madvise failed?)")


def test_memory_outlives_the_carving():
    t = host_alloc.zeros((1024, 1024, 2), dtype=torch.float32)  # 8 MiB
    t[-1, -1, -1] = 7.0
    t[0, 0, 0] = 3.0
    gc.collect()
    junk = [torch.ones(1 << 20) for _ in range(8)]  # reuse of freed memory would show below
    assert t[-1, -1, -1].item() == 7.0 and t[0, 0, 0].item() == 3.0
    assert t.sum().item() == 10.0
    del junk



@pytest.mark.parametrize("numel", [15, 4 << 20], ids=["small", "huge-page"])
def test_cpu_is_cpu_under_a_default_device(numel):
    """zeros(..., device="cpu") under `with torch.device("meta")` (how models are built before their
    weights load) returned a meta tensor for large sizes: the carving's torch.empty took the context's
    device, so a PagedKVCacheCollection(..., device="cpu") made there had meta pages."""
    with torch.device("meta"):
        t = host_alloc.zeros((numel,), dtype=torch.float32, device="cpu")
        cache = pagedkv.PagedKVCacheCollection(64, 2, 16, 8, 128, dtype=torch.bfloat16, device="cpu")
    assert t.device.type == "cpu" and torch.equal(t, torch.zeros(numel))
    assert cache.blocks.device.type == "cpu" and not cache.blocks.any()


def test_small_tensor_is_plain():
    t = host_alloc.zeros((3, 5), dtype=torch.bfloat16)
    assert not host_alloc.huge_pages_requested(t)
    assert torch.equal(t, torch.zeros(3, 5, dtype=torch.bfloat16))


def test_env_turns_it_off(monkeypatch):
    monkeypatch.setenv("PAGEDKV_HUGE_PAGES", "0")
    monkeypatch.setattr(host_alloc, "_libc", None)  # forget the cached choice
    t = host_alloc.zeros((1024, 1024, 4), dtype=torch.float32)
    assert not host_alloc.huge_pages_requested(t)
    assert torch.equal(t, torch.zeros(1024, 1024, 4))
    monkeypatch.setattr(host_alloc, "_libc", None)


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_alloc.thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages not available to madvise here")
def test_linux_large_tensor_is_advised():
    t = host_alloc.zeros((8 << 20,), dtype=torch.uint8)
    assert host_alloc.huge_pages_requested(t)
    assert t.data_ptr() % HUGE == 0


def test_ops_round_trip_through_advised_cache():
    gen = torch.Generator().manual_seed(3)
    n_pages, p, hk, d = 256, 16, 4, 128  # 4 MiB per bf16 pool
    kc = host_alloc.zeros((n_pages, p, hk, d), dtype=torch.bfloat16)
    vc = host_alloc.zeros((n_pages, p, hk, d), dtype=torch.bfloat16)
    kc_ref = torch.zeros_like(kc)
    vc_ref = torch.zeros_like(vc)
    lengths = torch.tensor([0, 37], dtype=torch.int32)
    offsets = torch.tensor([0, 50, 71], dtype=torch.int32)
    table = torch.randperm(n_pages, generator=gen)[:16].to(torch.int32).view(2, 8)
    key = torch.randn(71, hk, d, generator=gen).to(torch.bfloat16)
    value = torch.randn(71, hk, d, generator=gen).to(torch.bfloat16)
    for k_, v_ in ((kc, vc), (kc_ref, vc_ref)):
        torch.ops.pagedkv.paged_store(key, value, k_, v_, offsets, lengths, table)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    q = torch.randn(71, hk * 2, d, generator=gen).to(torch.bfloat16)
    out = pagedkv.flash_attn_paged(q, offsets, kc, vc, lengths, table)
    ref = pagedkv.flash_attn_paged(q, offsets, kc_ref, vc_ref, lengths, table)
    assert torch.equal(out, ref)


def test_cache_classes_allocate_through_it():
    c = pagedkv.PagedKVCache(num_pages=128, num_layers=2, page_size=16, num_kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16)
    for pool in c.k_pools + c.v_pools:
        assert torch.equal(pool, torch.zeros_like(pool))
        if sys.platform.startswith("linux") and host_alloc.thp_mode() in ("always", "madvise"):
            assert host_alloc.huge_pages_requested(pool)
