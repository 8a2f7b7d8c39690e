"""Constructor arguments are checked when an object is made, not at its first use.

The cache objects' integer, dtype, k_only and quant_group checks are in tests/test_cache_objects.py
(test_constructor_errors) and the page manager's in tests/test_page_manager.py; this file adds the
device of every cache object and the page size a PageManager shares with its caches. PagedCache
(transformers) is checked in tests/hf, which runs against both transformers lines.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import PageManager
from pagedkv.cache import (
    ContinuousBatchingKVCache,
    PagedKVCache,
    PagedKVCacheCollection,
    PagedKVCacheFA3Fallback,
)

# (num_pages or slots, num_layers, page_size or max_len, num_kv_heads, head_dim) where the class takes them
CACHE_CLASSES = {
    "collection": lambda **kw: PagedKVCacheCollection(4, 2, 8, 2, 16, **kw),
    "fa3_fallback": lambda **kw: PagedKVCacheFA3Fallback(4, 2, 8, 2, 16, **kw),
    "separate_pools": lambda **kw: PagedKVCache(4, 8, 2, 16, **kw),
    "continuous_batching": lambda **kw: ContinuousBatchingKVCache(4, 2, 8, 2, 16, **kw),
}
CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("kind", sorted(CACHE_CLASSES))
@pytest.mark.parametrize("device,error,match", [
    ("meta", ValueError, "device must be one of cpu, cuda .*got meta"),
    ("gpu", ValueError, "device must be one of cpu, cuda .*got 'gpu'"),
    (1.5, TypeError, "device must be one of cpu, cuda .*got float"),
    (True, TypeError, "device must be one of cpu, cuda .*got bool"),
    (f"cuda:{CUDA_COUNT}", ValueError, f"device cuda:{CUDA_COUNT} is not available: this process sees {CUDA_COUNT}"),
])
def test_cache_rejects_a_bad_device_at_construction(kind, device, error, match):
    with pytest.raises(error, match=match):
        CACHE_CLASSES[kind](device=device)


@pytest.mark.parametrize("kind", sorted(CACHE_CLASSES))
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_cache_accepts_the_cpu_device(kind, device):
    cache = CACHE_CLASSES[kind](device=device, dtype=torch.float8_e4m3fn)
    assert cache.device == torch.device("cpu")
    assert cache.k_cache(0).device == torch.device("cpu") and cache.k_scales(0).device == torch.device("cpu")


@pytest.mark.parametrize("kind", sorted(CACHE_CLASSES))
def test_cache_rejects_an_integer_dtype_naming_the_allowed_ones(kind):
    with pytest.raises(ValueError, match=r"dtype must be one of torch.float32, .*torch.float8_e5m2, got torch.int8"):
        CACHE_CLASSES[kind](dtype=torch.int8)


# ---- PageManager: its page size is its caches' page size -------------------------------------------


def test_page_manager_accepts_a_collections_blocks_and_scales():
    collection = PagedKVCacheCollection(6, 2, 4, 2, 16, dtype=torch.float8_e5m2)
    manager = PageManager(6, 4, caches=(collection.blocks, collection.scales))
    assert manager.caches[0] is collection.blocks


@pytest.mark.parametrize("layout", ["collection", "pool", "continuous_batching"])
def test_page_manager_rejects_caches_of_another_page_size(layout):
    if layout == "collection":  # [N, 2, L, P, Hk, D]: tokens at dim 3
        cache, token_dim = PagedKVCacheCollection(6, 2, 8, 2, 16).blocks, 3
    elif layout == "pool":  # [N, P, Hk, D]: tokens at dim 1
        cache, token_dim = PagedKVCache(6, 8, 2, 16).k_cache(0), 1
    else:  # [slots, 2, L, max_len, Hk, D]
        cache, token_dim = ContinuousBatchingKVCache(6, 2, 8, 2, 16).blocks, 3
    with pytest.raises(ValueError, match=rf"caches\[1\] holds pages of 8 tokens \(dim {token_dim} .*page_size=4"):
        PageManager(6, 4, caches=(torch.zeros(6, 4), cache))
    assert PageManager(6, 8, caches=(cache,)).page_size == 8


def test_page_manager_rejects_a_cache_without_a_token_dim():
    with pytest.raises(ValueError, match=r"caches\[0\] must have the page dim first .* and a token dim"):
        PageManager(6, 4, caches=(torch.zeros(6),))
