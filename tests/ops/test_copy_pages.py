"""copy_pages on every device: whole pages of a (strided) pool copied from src_pages to
dst_pages exactly, bad indices refused by name with nothing written, opcheck and torch.compile.
The page manager's copy-on-write, which uses it, is tested in tests/test_page_manager.py.
"""

from __future__ import annotations

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)
from pagedkv.page_manager import copy_pages


def _pages(values, device="cpu", dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float8_e5m2])
def test_copy_pages_copies_rows_of_strided_pools(device, dtype):
    base = torch.arange(6 * 2 * 3 * 4, dtype=torch.float32, device=device).reshape(6, 2, 3, 4).to(dtype)
    pool = base[:, 1]  # page stride 24, a non-contiguous view
    expected = pool.clone()
    expected[4] = pool[1]
    expected[0] = pool[2]
    copy_pages(pool, _pages([1, 2], device), _pages([4, 0], device))
    assert torch.equal(
        pool.view(torch.uint8) if dtype.itemsize == 1 else pool,
        expected.view(torch.uint8) if dtype.itemsize == 1 else expected,
    )
    assert torch.equal(
        base[:, 0].float(),
        torch.arange(6 * 2 * 3 * 4, dtype=torch.float32, device=device).reshape(6, 2, 3, 4)[:, 0].to(dtype).float(),
    )


@pytest.mark.parametrize(
    "src, dst, match",
    [
        (_pages([0, 1], dtype=torch.int64), _pages([2, 3]), "src_pages must be int32, got int64"),
        (_pages([0, 1]), _pages([2, 3], dtype=torch.int64), "dst_pages must be int32"),
        (_pages([[0, 1]]), _pages([2, 3]), "src_pages must be 1-D"),
        (_pages([0, 1]), _pages([2]), "same length"),
        (_pages([0, 6]), _pages([2, 3]), r"src_pages\[1\] = 6"),
        (_pages([0, 1]), _pages([2, -1]), r"dst_pages\[1\] = -1"),
        (_pages([0, 1]), _pages([2, 2]), "dst_pages must be distinct"),
        (_pages([0, 1]), _pages([2, 0]), "overlap"),
        (_pages([3]), _pages([3]), "overlap"),
    ],
)
def test_copy_pages_rejects_bad_indices_and_writes_nothing(src, dst, match):
    pool = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5)
    before = pool.clone()
    with pytest.raises(RuntimeError, match=match):
        copy_pages(pool, src, dst)
    assert torch.equal(pool, before)


def test_copy_pages_empty_and_zero_dim():
    pool = torch.ones(4, 3)
    copy_pages(pool, _pages([]), _pages([]))
    with pytest.raises(RuntimeError, match="pool"):
        copy_pages(torch.tensor(1.0), _pages([0]), _pages([1]))


def test_copy_pages_refuses_meta_index_lists():
    pool = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
    before = pool.clone()
    # meta index lists sent the call to the fake kernel, which returned without copying anything
    with pytest.raises(RuntimeError, match=r"copy_pages: src_pages must be on the same device as pool \(cpu\), got meta"):
        copy_pages(pool, _pages([0], "meta"), _pages([1], "meta"))
    with pytest.raises(RuntimeError, match=r"copy_pages: dst_pages must be on the same device as pool \(cpu\), got meta"):
        copy_pages(pool, _pages([0]), _pages([1], "meta"))
    assert torch.equal(pool, before)


def test_copy_pages_refuses_broadcast_pools_by_name():
    # a broadcast pool failed inside torch's copy, whose message names no argument
    with pytest.raises(RuntimeError, match=r"copy_pages: pool must not be a broadcast view \(stride 0 on dim 0\)"):
        copy_pages(torch.zeros(1, 3).expand(4, 3), _pages([0]), _pages([1]))
    # more dims than a descriptor records still copy
    pool = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 1, 1, 1, 1, 1, 3)
    copy_pages(pool, _pages([0]), _pages([1]))
    assert torch.equal(pool[1], pool[0])


def test_copy_pages_opcheck_and_compile():
    pool = torch.randn(6, 2, 3)
    src, dst = _pages([1, 3]), _pages([0, 5])
    torch.library.opcheck(torch.ops.pagedkv.copy_pages.default, (pool, src, dst))

    @torch.compile(fullgraph=True, backend="eager")
    def step(pool, src, dst):
        torch.ops.pagedkv.copy_pages(pool, src, dst)
        return pool * 2

    pool = torch.randn(6, 2, 3)
    expected = pool.clone()
    expected[dst.long()] = pool[src.long()]
    torch.testing.assert_close(step(pool, src, dst), expected * 2)
    torch.testing.assert_close(pool, expected)
