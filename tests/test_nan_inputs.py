"""Non-finite inputs: a NaN or inf in a stored group follows the contract's
scale rule exactly as the reference computes it (bytes and scales equal)."""

import pytest
import torch

import pagedkv
from pagedkv import reference


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 5, 31])
def test_fp8_store_non_finite_matches_reference(cache_dtype, bad, where):
    torch.manual_seed(1)
    n_pages, page, heads, dim, group = 4, 2, 2, 64, 32
    key = torch.randn(3, heads, dim)
    key[1, 0, where] = bad
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    lengths = torch.tensor([1], dtype=torch.int32)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    caches = [torch.zeros(n_pages, page, heads, dim, dtype=cache_dtype) for _ in range(2)]
    scales = [torch.zeros(n_pages, page, heads, dim // group) for _ in range(2)]
    pagedkv.paged_store(key, None, caches[0], None, offsets, lengths, table, scales[0], None, group)
    reference.paged_store(key, None, caches[1], None, offsets, lengths, table, scales[1], None, group)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert torch.equal(scales[0].view(torch.int32), scales[1].view(torch.int32))
