"""Ops called from several Python threads at once.

torch.ops calls release the GIL, so the threads below really run the C kernels concurrently (each
also splitting its work over the intra-op pool). Every thread's results must equal, bit for bit,
the same calls made sequentially: the ops keep no global mutable state, and calls on different
caches, or on disjoint pages of one pool, do not interfere. Failing calls in some threads must not
disturb the others.

The page manager is not thread-safe by contract: Python calls are serialised by the GIL and a
native call that overlaps another is refused (PKV_PM_BUSY, tested in tests/c/test_page_manager.c).
Here: several threads driving one manager on their own sequences keep it consistent and end in
the state a sequential run reaches.
"""

from __future__ import annotations

import threading

import pytest
import torch

import pagedkv
from pagedkv import PageManager

THREADS = 4
ROUNDS = 12
P, HK, HQ, D = 8, 2, 4, 32
NEW_TOKENS = 24  # per round and row
PAGES_PER_ROW = -(-ROUNDS * NEW_TOKENS // P)


def _run_threads(work, count=THREADS):
    """Run work(i) in `count` threads released together; re-raise the first exception."""
    barrier = threading.Barrier(count)
    errors = []

    def target(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as error:  # noqa: BLE001 - collected and re-raised below
            errors.append(error)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _inputs(seed, rows):
    """Per-round keys, values and queries for `rows` rows of NEW_TOKENS tokens."""
    gen = torch.Generator().manual_seed(seed)
    shape = (ROUNDS, rows * NEW_TOKENS)
    key = torch.randn((*shape, HK, D), generator=gen)
    value = torch.randn((*shape, HK, D), generator=gen)
    q = torch.randn((*shape, HQ, D), generator=gen).to(torch.bfloat16)
    return key, value, q


def _steps(k_cache, v_cache, k_scales, v_scales, table, inputs, rows):
    """ROUNDS of store -> attention -> load on one pool; returns every output."""
    key, value, q = inputs
    offsets = torch.arange(0, (rows + 1) * NEW_TOKENS, NEW_TOKENS, dtype=torch.int32)
    outputs = []
    for r in range(ROUNDS):
        lengths = torch.full((rows,), r * NEW_TOKENS, dtype=torch.int32)
        pagedkv.paged_store(key[r], value[r], k_cache, v_cache, offsets, lengths, table, k_scales, v_scales, 16)
        outputs.append(pagedkv.flash_attn_paged(q[r], offsets, k_cache, v_cache, lengths, table,
                                                k_scales=k_scales, v_scales=v_scales, quant_group=16))
        outputs.append(pagedkv.paged_load(k_cache, table, lengths + NEW_TOKENS, scales=k_scales, quant_group=16))
    return outputs


def _pool(num_pages, dtype):
    """Collection-style block [N, 2, P, Hk, D] and its scales (FP8 only)."""
    blocks = torch.zeros((num_pages, 2, P, HK, D), dtype=dtype)
    scales = torch.zeros((num_pages, 2, P, HK, 2)) if dtype == torch.float8_e4m3fn else None
    return blocks, scales


def _views(blocks, scales):
    ks = vs = None
    if scales is not None:
        ks, vs = scales[:, 0], scales[:, 1]
    return blocks[:, 0], blocks[:, 1], ks, vs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_threads_on_separate_caches(dtype):
    rows = 2
    tables = [torch.randperm(rows * PAGES_PER_ROW, generator=torch.Generator().manual_seed(i)).to(torch.int32)
              .reshape(rows, PAGES_PER_ROW) for i in range(THREADS)]
    inputs = [_inputs(100 + i, rows) for i in range(THREADS)]

    sequential = []
    for i in range(THREADS):
        blocks, scales = _pool(rows * PAGES_PER_ROW, dtype)
        outs = _steps(*_views(blocks, scales), tables[i], inputs[i], rows)
        sequential.append((outs, blocks, scales))

    pools = [_pool(rows * PAGES_PER_ROW, dtype) for _ in range(THREADS)]
    results = [None] * THREADS

    def work(i):
        results[i] = _steps(*_views(*pools[i]), tables[i], inputs[i], rows)

    _run_threads(work)
    for i in range(THREADS):
        want_outs, want_blocks, want_scales = sequential[i]
        for j, (got, want) in enumerate(zip(results[i], want_outs)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"thread {i} output {j} differs"
        assert torch.equal(pools[i][0].view(torch.uint8), want_blocks.view(torch.uint8)), f"thread {i} pool differs"
        if want_scales is not None:
            assert torch.equal(pools[i][1], want_scales), f"thread {i} scales differ"


def test_threads_on_disjoint_pages_of_one_pool():
    """Each thread owns the rows and pages of its sequences in one shared pool."""
    rows = 1
    num_pages = THREADS * PAGES_PER_ROW
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(5)).to(torch.int32)
    tables = [order[i * PAGES_PER_ROW : (i + 1) * PAGES_PER_ROW].reshape(1, PAGES_PER_ROW) for i in range(THREADS)]
    inputs = [_inputs(200 + i, rows) for i in range(THREADS)]

    blocks, scales = _pool(num_pages, torch.float8_e4m3fn)
    sequential = [_steps(*_views(blocks, scales), tables[i], inputs[i], rows) for i in range(THREADS)]
    want_blocks, want_scales = blocks.clone(), scales.clone()

    blocks, scales = _pool(num_pages, torch.float8_e4m3fn)
    views = _views(blocks, scales)
    results = [None] * THREADS

    def work(i):
        results[i] = _steps(*views, tables[i], inputs[i], rows)

    _run_threads(work)
    for i in range(THREADS):
        for j, (got, want) in enumerate(zip(results[i], sequential[i])):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"thread {i} output {j} differs"
    assert torch.equal(blocks.view(torch.uint8), want_blocks.view(torch.uint8))
    assert torch.equal(scales, want_scales)


def test_failing_calls_in_other_threads_change_nothing():
    """Half the threads store valid rows; the other half make calls that must be rejected (a page
    id out of range, a slot written twice, int64 offsets) against the same pool, many times."""
    num_pages = THREADS * PAGES_PER_ROW
    blocks, scales = _pool(num_pages, torch.float8_e4m3fn)
    k, v, ks, vs = _views(blocks, scales)
    valid_threads = range(0, THREADS, 2)
    tables = {i: torch.arange(i * PAGES_PER_ROW, (i + 1) * PAGES_PER_ROW, dtype=torch.int32).reshape(1, -1)
              for i in valid_threads}
    inputs = {i: _inputs(300 + i, 1) for i in valid_threads}
    want = blocks.clone(), scales.clone()
    for i in valid_threads:
        _steps(*_views(*want), tables[i], inputs[i], 1)

    bad_calls = [
        dict(table=torch.tensor([[num_pages]], dtype=torch.int32), lengths=[0], match="lookup_table"),
        dict(table=torch.tensor([[1], [1]], dtype=torch.int32), lengths=[0, 0], match="lookup_table"),
        dict(table=torch.tensor([[1]], dtype=torch.int32), lengths=[-5], match="cache_lengths"),
    ]
    rejected = [0] * THREADS

    def work(i):
        if i in tables:
            _steps(k, v, ks, vs, tables[i], inputs[i], 1)
            return
        key = torch.full((2 * P, HK, D), 7.0)
        for r in range(ROUNDS * 3):
            bad = bad_calls[r % len(bad_calls)]
            rows = len(bad["lengths"])
            offsets = torch.tensor([0, P, 2 * P][: rows + 1], dtype=torch.int32)
            with pytest.raises(RuntimeError, match=bad["match"]):
                pagedkv.paged_store(key[: rows * P], key[: rows * P], k, v, offsets,
                                    torch.tensor(bad["lengths"], dtype=torch.int32), bad["table"], ks, vs, 16)
            with pytest.raises(RuntimeError, match="lookup_table must be int32"):
                pagedkv.flash_attn_paged(key[:P].repeat(1, 2, 1), offsets[:2], k, v, torch.zeros(1, dtype=torch.int32),
                                         bad["table"][:1].long(), k_scales=ks, v_scales=vs, quant_group=16)
            rejected[i] += 2

    _run_threads(work)
    assert sum(rejected) == 2 * ROUNDS * 3 * (THREADS - len(tables))
    assert torch.equal(blocks.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scales, want[1])


def test_page_manager_shared_by_threads_stays_consistent():
    """Threads run add/reserve/commit/fork/release cycles on their own sequence ids of one
    manager; afterwards the manager is consistent and every sequence has the length that the
    thread's own (sequential) bookkeeping predicts."""
    manager = PageManager(num_pages=4096, page_size=4)
    cycles = 60
    expected = {}
    lock = threading.Lock()

    def work(i):
        base = 1000 * (i + 1)
        for c in range(cycles):
            seq = base + c
            prompt = [(i + c + t) % 5 for t in range(9)]
            cached = manager.add_sequence(seq, prompt)
            manager.reserve(seq, len(prompt) - cached)
            manager.commit(seq, len(prompt) - cached, prompt[cached:])
            manager.fork(seq, seq + 500)
            manager.reserve(seq + 500, 3)
            manager.commit(seq + 500, 3)
            if c % 3 == 0:
                manager.release(seq)
            else:
                with lock:
                    expected[seq] = len(prompt)
            with lock:
                expected[seq + 500] = len(prompt) + 3

    _run_threads(work)
    manager.check_invariants()
    assert manager.num_sequences == len(expected)
    for seq, length in expected.items():
        assert manager.length(seq) == length
    lookup_table, cache_lengths = manager.export(sorted(expected))
    assert cache_lengths.tolist() == [expected[s] for s in sorted(expected)]
    assert lookup_table.dtype == torch.int32
