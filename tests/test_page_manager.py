"""Tests of pagedkv.page_manager (the Python front of the C page manager); the copy_pages op it
copies pages with is tested in tests/ops/test_copy_pages.py.

The random tests drive the manager and a small pure-Python model of it (abstract pages, reference
counts by holder, one registered page per cached prefix) side by side, and play the KV cache: the
test writes each committed token's id into real cache tensors at the slots the manager handed out,
so copy-on-write copies (done by the manager through copy_pages) and prefix sharing are checked on
data, not only on bookkeeping.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from pagedkv.page_manager import OutOfPagesError, PageManager

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def snapshot(manager: PageManager, seq_ids):
    return (
        manager.free_pages,
        manager.used_pages,
        manager.shared_pages,
        manager.num_sequences,
        manager.prefix_pages,
        {s: (manager.length(s), tuple(manager.pages(s))) for s in seq_ids},
    )


def _slots(manager: PageManager, seq_id: int, start: int, count: int):
    """(page, slot) index tensors of positions start .. start+count-1 of a sequence."""
    pages = torch.tensor(manager.pages(seq_id) or [0], dtype=torch.long)
    positions = torch.arange(start, start + count)
    return pages[positions // manager.page_size], positions % manager.page_size


def write_tokens(manager: PageManager, cache: torch.Tensor, seq_id: int, start: int, tokens):
    """Write token ids at positions start.. of a sequence, as paged_store would (before commit)."""
    pages, slots = _slots(manager, seq_id, start, len(tokens))
    values = torch.tensor(list(tokens), dtype=cache.dtype).reshape((-1,) + (1,) * (cache.dim() - 2))
    cache[pages, slots] = values.expand((len(tokens),) + tuple(cache.shape[2:])).clone()


def read_tokens(manager: PageManager, cache: torch.Tensor, seq_id: int) -> list[int]:
    """Token ids stored at positions 0 .. length-1 of a sequence (first element of each slot)."""
    length = manager.length(seq_id)
    if length == 0:
        return []
    pages, slots = _slots(manager, seq_id, 0, length)
    return [int(v) for v in cache[pages, slots].reshape(length, -1)[:, 0].tolist()]


# ---------------------------------------------------------------------------------------------
# construction, counters, errors
# ---------------------------------------------------------------------------------------------


def test_fresh_manager_counters():
    manager = PageManager(10, 4)
    assert (manager.num_pages, manager.page_size) == (10, 4)
    assert (manager.free_pages, manager.used_pages, manager.shared_pages) == (10, 0, 0)
    assert manager.num_sequences == 0 and manager.prefix_pages == 0
    manager.check_invariants()
    assert "num_pages=10" in repr(manager)


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((0, 4), {}, "num_pages"),
        ((-1, 4), {}, "num_pages"),
        ((2**31, 4), {}, "num_pages"),
        ((8, 0), {}, "page_size"),
        ((8.0, 4), {}, "num_pages"),
        ((True, 4), {}, "num_pages"),
        ((8, "4"), {}, "page_size"),
        ((8, 4), {"caches": [torch.zeros(7, 4)]}, "caches[0]"),
        ((8, 4), {"caches": [torch.zeros(8, 4), torch.zeros(())]}, "caches[1]"),
        ((8, 4), {"caches": [[0] * 8]}, "caches[0]"),
        ((8, 4), {"caches": torch.zeros(8, 4)}, "caches"),
    ],
)
def test_constructor_rejects_bad_arguments(args, kwargs, name):
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        PageManager(*args, **kwargs)


def test_unknown_sequence_raises_key_error_naming_the_id():
    manager = PageManager(8, 4)
    manager.add_sequence(1)
    calls = [
        lambda: manager.reserve(12345, 1),
        lambda: manager.can_reserve(12345, 1),
        lambda: manager.pages_needed(12345, 1),
        lambda: manager.commit(12345, 0),
        lambda: manager.release(12345),
        lambda: manager.fork(12345, 2),
        lambda: manager.length(12345),
        lambda: manager.pages(12345),
        lambda: manager.export([1, 12345]),
    ]
    for call in calls:
        with pytest.raises(KeyError, match="12345"):
            call()
    assert 1 in manager and 12345 not in manager
    assert manager.num_sequences == 1 and manager.free_pages == 8


def test_bad_arguments_raise_value_error_naming_the_argument():
    manager = PageManager(8, 4)
    manager.add_sequence(1)
    manager.reserve(1, 3)
    cases = [
        (lambda: manager.add_sequence(1), "seq_id"),
        (lambda: manager.add_sequence(2**63), "seq_id"),
        (lambda: manager.add_sequence("a"), "seq_id"),
        (lambda: manager.add_sequence(2, [1, 2**31]), "prompt_tokens"),
        (lambda: manager.add_sequence(2, [1, 2.5]), "prompt_tokens"),
        (lambda: manager.add_sequence(2, "abc"), "prompt_tokens"),
        (lambda: manager.add_sequence(2, torch.ones(3)), "prompt_tokens"),
        (lambda: manager.reserve(1, -1), "num_new_tokens"),
        (lambda: manager.reserve(1, 2**31), "num_new_tokens"),
        (lambda: manager.can_reserve(1, -1), "num_new_tokens"),
        (lambda: manager.commit(1, -1), "num_new_tokens"),
        (lambda: manager.commit(1, 5), "num_new_tokens"),  # beyond the reserved capacity 4
        (lambda: manager.commit(1, 2, [1]), "tokens"),
        (lambda: manager.commit(1, 1, [2**40]), "tokens"),
        (lambda: manager.fork(1, 1), "dst_seq"),
        (lambda: manager.fork(1.0, 3), "src_seq"),
        (lambda: manager.export([1], width=17), "width"),
        (lambda: manager.export(["x"]), r"seq_ids\[0\]"),
    ]
    before = snapshot(manager, [1])
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
    assert snapshot(manager, [1]) == before
    manager.check_invariants()


def test_lengths_stay_within_int32():
    manager = PageManager(8, 4)
    manager.add_sequence(1)
    manager.reserve(1, 3)
    manager.commit(1, 3)
    with pytest.raises(ValueError, match="int32"):  # cache_lengths are exported as int32
        manager.reserve(1, 2**31 - 3)
    with pytest.raises(OutOfPagesError):
        manager.reserve(1, 2**31 - 4)


def test_out_of_pages_leaves_state_unchanged():
    manager = PageManager(6, 4)
    manager.add_sequence(1)
    manager.reserve(1, 10)  # 3 pages
    manager.commit(1, 6)
    manager.fork(1, 2)  # shares 2 pages, page 1 partly full
    manager.add_sequence(3)
    manager.reserve(3, 8)  # 2 pages, 1 left
    before = snapshot(manager, [1, 2, 3])
    assert manager.free_pages == 1
    # sequence 2 needs a private copy of its shared page 1 and a new page: 2 > 1 free
    assert manager.pages_needed(2, 6) == 2
    assert not manager.can_reserve(2, 6)
    with pytest.raises(OutOfPagesError, match="copy-on-write") as info:
        manager.reserve(2, 6)
    assert isinstance(info.value, RuntimeError)
    assert snapshot(manager, [1, 2, 3]) == before
    with pytest.raises(OutOfPagesError):
        manager.reserve(3, 1000)
    assert snapshot(manager, [1, 2, 3]) == before
    manager.check_invariants()
    # the exact fit succeeds
    assert manager.can_reserve(2, 2)
    manager.reserve(2, 2)
    assert manager.free_pages == 0


def test_commit_into_a_shared_page_needs_reserve():
    manager = PageManager(8, 4)
    manager.add_sequence(1)
    manager.reserve(1, 4)
    manager.commit(1, 2)
    manager.fork(1, 2)
    with pytest.raises(ValueError, match="reserve"):
        manager.commit(2, 1)
    manager.reserve(2, 1)
    manager.commit(2, 1)
    assert manager.length(2) == 3 and manager.length(1) == 2


def test_release_returns_pages_and_accepts_any_int64_id():
    manager = PageManager(8, 2)
    for seq in (-(2**63), -1, 0, 2**63 - 1):
        manager.add_sequence(seq)
        manager.reserve(seq, 3)
        manager.commit(seq, 3)
    assert manager.free_pages == 0 and manager.used_pages == 8
    manager.check_invariants()
    for seq in (-1, 2**63 - 1, 0, -(2**63)):
        manager.release(seq)
    assert manager.free_pages == 8 and manager.num_sequences == 0
    with pytest.raises(KeyError):
        manager.release(0)


# ---------------------------------------------------------------------------------------------
# fork and copy-on-write on real cache data
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_fork_copy_on_write_copies_every_cache(device):
    num_pages, page_size, layers, heads, dim = 8, 4, 2, 2, 3
    # a collection [N, 2, L, P, Hk, D], its FP8 scales-like float32 companion, and an FP8 pool
    blocks = torch.zeros(num_pages, 2, layers, page_size, heads, dim, device=device)
    scales = torch.zeros(num_pages, 2, layers, page_size, heads, 1, device=device)
    fp8 = torch.zeros(num_pages, page_size, heads, dim, device=device).to(torch.float8_e4m3fn)
    manager = PageManager(num_pages, page_size, caches=(blocks, scales, fp8))

    manager.add_sequence(1)
    manager.reserve(1, 6)
    a_pages = manager.pages(1)
    for page in a_pages:  # sequence 1 writes its 6 tokens
        blocks[page] = page + 1
        scales[page] = -(page + 1)
        fp8[page] = float(page + 1)
    manager.commit(1, 6)
    manager.fork(1, 2)
    assert manager.pages(2) == a_pages and manager.shared_pages == 2
    free_before = manager.free_pages

    manager.reserve(2, 1)  # writes into shared page 1: private copy
    b_pages = manager.pages(2)
    assert b_pages[0] == a_pages[0] and b_pages[1] != a_pages[1]
    assert manager.free_pages == free_before - 1 and manager.shared_pages == 1
    new = b_pages[1]
    torch.testing.assert_close(blocks[new], blocks[a_pages[1]], rtol=0, atol=0)
    torch.testing.assert_close(scales[new], scales[a_pages[1]], rtol=0, atol=0)
    assert torch.equal(fp8[new].view(torch.uint8), fp8[a_pages[1]].view(torch.uint8))
    # sequence 2 writes its token 6 into its copy: sequence 1's page is untouched
    blocks[new, :, :, 2] = 99.0
    assert float(blocks[a_pages[1], 0, 0, 2, 0, 0]) == a_pages[1] + 1
    manager.commit(2, 1)
    # the original is private to sequence 1 again: no copy when it grows
    manager.reserve(1, 2)
    assert manager.pages(1)[:2] == a_pages[:2]
    manager.check_invariants()


def test_fork_shares_only_committed_pages():
    manager = PageManager(16, 4)
    manager.add_sequence(1)
    manager.reserve(1, 12)
    manager.commit(1, 5)
    manager.fork(1, 2)
    assert manager.length(2) == 5
    assert manager.pages(2) == manager.pages(1)[:2]
    assert len(manager.pages(1)) == 3
    with pytest.raises(ValueError, match="dst_seq"):
        manager.fork(2, 1)


# ---------------------------------------------------------------------------------------------
# prefix sharing
# ---------------------------------------------------------------------------------------------


def test_prefix_sharing_shares_verified_full_pages():
    manager = PageManager(32, 4)
    cache = torch.full((32, 4), -1, dtype=torch.int64)
    prompt = list(range(100, 140))

    assert manager.add_sequence(1, prompt[:10]) == 0
    manager.reserve(1, 10)
    write_tokens(manager, cache, 1, 0, prompt[:10])
    manager.commit(1, 10, prompt[:10])
    assert manager.prefix_pages == 2

    assert manager.add_sequence(2, prompt[:10]) == 8  # 2 full pages, 2 tokens left to compute
    assert manager.pages(2) == manager.pages(1)[:2] and manager.length(2) == 8
    assert read_tokens(manager, cache, 2) == prompt[:8]
    assert manager.add_sequence(3, prompt[:8]) == 4  # never the whole prompt
    assert manager.add_sequence(4, torch.tensor(prompt[:9])) == 8  # tensors work too
    other = prompt[:16]
    other[6] = 7
    assert manager.add_sequence(5, other) == 4  # page 1 differs
    other[0] = 7
    assert manager.add_sequence(6, other) == 0
    assert manager.add_sequence(7, []) == 0 and manager.add_sequence(8) == 0
    manager.check_invariants()

    # a commit without token ids ends registration for that sequence only
    manager.reserve(8, 8)
    write_tokens(manager, cache, 8, 0, prompt[:8])
    manager.commit(8, 4)
    manager.commit(8, 4, prompt[4:8])
    assert manager.prefix_pages == 2

    for seq in range(1, 9):
        manager.release(seq)
    assert manager.free_pages == 32 and manager.prefix_pages == 0
    assert manager.add_sequence(9, prompt[:10]) == 0  # nothing cached once every holder left


def test_duplicate_pages_switch_to_the_registered_page():
    manager = PageManager(16, 2)
    cache = torch.full((16, 2), -1, dtype=torch.int64)
    prompt = [5, 6, 7, 8, 9]
    # two sequences compute the same prompt in the same step (neither is cached yet)
    for seq in (1, 2):
        assert manager.add_sequence(seq, prompt) == 0
        manager.reserve(seq, len(prompt))
        write_tokens(manager, cache, seq, 0, prompt)
    assert manager.free_pages == 10
    manager.commit(1, 5, prompt)
    manager.commit(2, 5, prompt)  # its 2 full pages are already registered: switches, frees its own
    assert manager.free_pages == 12 and manager.prefix_pages == 2
    assert manager.pages(2)[:2] == manager.pages(1)[:2] and manager.pages(2)[2] != manager.pages(1)[2]
    assert read_tokens(manager, cache, 2) == prompt
    # the prefix stays cached while any holder lives
    manager.release(1)
    assert manager.add_sequence(3, prompt) == 4
    manager.check_invariants()


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


def test_export_shapes_padding_and_lengths():
    manager = PageManager(64, 2)
    for seq, (reserve, commit) in {1: (3, 3), 2: (34, 30), 3: (0, 0)}.items():
        manager.add_sequence(seq)
        manager.reserve(seq, reserve)
        manager.commit(seq, commit)
    table, lengths = manager.export([2, 1, 3, 1])
    assert table.dtype == torch.int32 and lengths.dtype == torch.int32
    assert table.shape == (4, 32)  # 17 pages round up to 32
    assert lengths.tolist() == [30, 3, 0, 3]
    for row, seq in enumerate([2, 1, 3, 1]):
        pages = manager.pages(seq)
        assert table[row, : len(pages)].tolist() == pages
        assert (table[row, len(pages) :] == 0).all()
    assert manager.export([1])[0].shape == (1, 16)
    assert manager.export([3])[0].shape == (1, 16)
    empty_table, empty_lengths = manager.export([])
    assert empty_table.shape == (0, 16) and empty_lengths.shape == (0,)
    wide, _ = manager.export([1, 2], width=64)
    assert wide.shape == (2, 64) and (wide[0, 2:] == 0).all()
    with pytest.raises(ValueError, match="width"):
        manager.export([2], width=16)  # 17 pages do not fit
    table, lengths = manager.export(torch.tensor([1, 2]), device="cpu")
    assert table.shape == (2, 32) and lengths.tolist() == [3, 30]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_export_to_cuda():
    manager = PageManager(8, 4)
    manager.add_sequence(1)
    manager.reserve(1, 5)
    table, lengths = manager.export([1], device="cuda")
    assert table.is_cuda and lengths.is_cuda and table.shape == (1, 16)


# ---------------------------------------------------------------------------------------------
# random operation sequences against a model
# ---------------------------------------------------------------------------------------------


class Model:
    """The manager's semantics on abstract pages (fresh integers, never reused)."""

    def __init__(self, num_pages, page_size):
        self.num_pages, self.page_size = num_pages, page_size
        self.seqs = {}  # id -> dict(pages, length, history, known)
        self.table = {}  # full token prefix (tuple, length a multiple of P) -> page
        self.next_page = 0

    def _new_page(self):
        self.next_page += 1
        return self.next_page

    def refcount(self):
        counts = {}
        for s in self.seqs.values():
            for p in s["pages"]:
                counts[p] = counts.get(p, 0) + 1
        return counts

    def free(self):
        return self.num_pages - len(self.refcount())

    def shared(self):
        return sum(1 for c in self.refcount().values() if c > 1)

    def _drop_dead_prefixes(self):
        live = self.refcount()
        self.table = {k: p for k, p in self.table.items() if p in live}

    def add(self, seq, prompt):
        P = self.page_size
        limit = (len(prompt) - 1) // P if prompt else 0
        pages = []
        while len(pages) < limit and tuple(prompt[: (len(pages) + 1) * P]) in self.table:
            pages.append(self.table[tuple(prompt[: (len(pages) + 1) * P])])
        cached = len(pages) * P
        self.seqs[seq] = {"pages": pages, "length": cached, "history": list(prompt[:cached]), "known": True}
        return cached

    def plan(self, seq, n):
        s, P = self.seqs[seq], self.page_size
        needed = math.ceil((s["length"] + n) / P)
        new = max(0, needed - len(s["pages"]))
        first = s["length"] // P
        end = min(len(s["pages"]), needed if n > 0 else first)
        counts = self.refcount()
        copies = [j for j in range(first, end) if counts[s["pages"][j]] > 1]
        return new, copies

    def reserve(self, seq, n):
        new, copies = self.plan(seq, n)
        if new + len(copies) > self.free():
            return False
        s = self.seqs[seq]
        for j in copies:
            s["pages"][j] = self._new_page()
        s["pages"].extend(self._new_page() for _ in range(new))
        return True

    def commit(self, seq, tokens, with_ids):
        s, P = self.seqs[seq], self.page_size
        if not tokens:
            return
        old_length = s["length"]
        s["history"].extend(tokens)
        s["length"] += len(tokens)
        if not with_ids:
            s["known"] = False
        elif s["known"]:
            for j in range(old_length // P, s["length"] // P):
                prefix = tuple(s["history"][: (j + 1) * P])
                if prefix in self.table:
                    s["pages"][j] = self.table[prefix]
                else:
                    self.table[prefix] = s["pages"][j]
        self._drop_dead_prefixes()

    def fork(self, src, dst):
        s = self.seqs[src]
        kept = math.ceil(s["length"] / self.page_size)
        self.seqs[dst] = {
            "pages": s["pages"][:kept],
            "length": s["length"],
            "history": list(s["history"]),
            "known": s["known"],
        }

    def release(self, seq):
        del self.seqs[seq]
        self._drop_dead_prefixes()


def check_against_model(manager: PageManager, model: Model, caches):
    manager.check_invariants()
    assert manager.free_pages == model.free()
    assert manager.used_pages == model.num_pages - model.free()
    assert manager.shared_pages == model.shared()
    assert manager.num_sequences == len(model.seqs)
    assert manager.prefix_pages == len(model.table)
    # the sharing structure matches exactly: model page <-> real page is a bijection
    real_of, model_of = {}, {}
    for seq, s in model.seqs.items():
        real = manager.pages(seq)
        assert len(real) == len(s["pages"]), f"sequence {seq}"
        assert manager.length(seq) == s["length"]
        for m, r in zip(s["pages"], real):
            assert real_of.setdefault(m, r) == r and model_of.setdefault(r, m) == m
        # every committed token reads back from every cache
        for cache in caches:
            assert read_tokens(manager, cache, seq) == s["history"], f"sequence {seq}"


STEMS = [
    [1, 2, 3] * 8,
    [1, 2, 3, 1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0, 1, 0, 1],
    [3, 3, 2, 2, 1, 1, 0, 0] * 3,
]


def random_prompt(rng: random.Random):
    length = rng.randint(0, 30)
    stem = rng.choice(STEMS)
    from_stem = rng.randint(0, 24)
    return [stem[i] if i < from_stem and i < 24 else rng.randrange(4) for i in range(length)]


@pytest.mark.parametrize("num_pages, page_size, seed", [(16, 1, 0), (24, 2, 1), (30, 3, 2), (40, 4, 3), (12, 8, 4)])
def test_random_operations_match_the_model(num_pages, page_size, seed):
    rng = random.Random(seed)
    # two caches: a plain pool and a strided view into a larger allocation
    plain = torch.full((num_pages, page_size), -1, dtype=torch.int64)
    backing = torch.full((num_pages, 2, page_size, 3), -1.0)
    strided = backing[:, 1, :, 0]
    caches = (plain, strided)
    manager = PageManager(num_pages, page_size, caches=caches)
    model = Model(num_pages, page_size)
    next_id = 0
    counts = {"cached": 0, "out_of_pages": 0, "copies": 0, "deduplicated": 0}

    def write(seq, tokens):
        start = manager.length(seq)
        for cache in caches:
            write_tokens(manager, cache, seq, start, tokens)

    def reserve(seq, n):
        new, copies = model.plan(seq, n)
        assert manager.pages_needed(seq, n) == new + len(copies)
        fits = new + len(copies) <= model.free()
        assert manager.can_reserve(seq, n) == fits
        if not fits:
            before = snapshot(manager, model.seqs)
            with pytest.raises(OutOfPagesError):
                manager.reserve(seq, n)
            assert snapshot(manager, model.seqs) == before
            counts["out_of_pages"] += 1
            return False
        manager.reserve(seq, n)
        assert model.reserve(seq, n)
        counts["copies"] += len(copies)
        return True

    def commit(seq, tokens, with_ids=True):
        write(seq, tokens)
        free_before = manager.free_pages
        manager.commit(seq, len(tokens), tokens if with_ids else None)
        model.commit(seq, tokens, with_ids)
        counts["deduplicated"] += manager.free_pages - free_before

    for _step in range(1500):
        op = rng.random()
        if manager.free_pages * 4 < num_pages and rng.random() < 0.3:
            op = 0.85  # under pressure, release more often
        if op < 0.25 or not model.seqs:
            seq, next_id = next_id, next_id + 1
            prompt = random_prompt(rng)
            cached = manager.add_sequence(seq, prompt)
            assert cached == model.add(seq, prompt)
            counts["cached"] += cached
            check_against_model(manager, model, caches)
            if reserve(seq, len(prompt) - cached):
                commit(seq, prompt[cached:])
            else:
                manager.release(seq)
                model.release(seq)
        elif op < 0.6:
            seq = rng.choice(sorted(model.seqs))
            n = rng.randint(1, 2 * page_size)
            extra = rng.randint(0, page_size) if rng.random() < 0.3 else 0
            if model.seqs[seq]["length"] + n + extra > 80:
                manager.release(seq)
                model.release(seq)
            elif reserve(seq, n + extra):
                commit(seq, [rng.randrange(4) for _ in range(n)], with_ids=rng.random() > 0.1)
        elif op < 0.75:
            src = rng.choice(sorted(model.seqs))
            dst, next_id = next_id, next_id + 1
            manager.fork(src, dst)
            model.fork(src, dst)
        elif op < 0.95:
            seq = rng.choice(sorted(model.seqs))
            manager.release(seq)
            model.release(seq)
        else:
            ids = [rng.choice(sorted(model.seqs)) for _ in range(rng.randint(0, 4))]
            table, lengths = manager.export(ids)
            widest = max([len(model.seqs[s]["pages"]) for s in ids], default=0)
            assert table.shape == (len(ids), 16 * max(1, math.ceil(widest / 16)))
            for row, seq in enumerate(ids):
                pages = manager.pages(seq)
                assert table[row].tolist() == pages + [0] * (table.shape[1] - len(pages))
                assert int(lengths[row]) == model.seqs[seq]["length"]
        check_against_model(manager, model, caches)

    for seq in sorted(model.seqs):
        manager.release(seq)
    manager.check_invariants()
    assert manager.free_pages == num_pages and manager.prefix_pages == 0
    assert counts["out_of_pages"] > 0 and counts["cached"] > 0 and counts["deduplicated"] > 0
    if page_size > 1:
        assert counts["copies"] > 0


# ---------------------------------------------------------------------------------------------
# caches the copy-on-write copies cannot write: refused at construction, and a reserve that would
# copy into one changes nothing
# ---------------------------------------------------------------------------------------------


def _inference_cache():
    with torch.inference_mode():
        return torch.zeros((6, 2, 4))


UNWRITABLE_CACHES = [
    ("expanded", lambda: torch.zeros((1, 2, 4)).expand(6, 2, 4), "broadcast"),
    ("expanded collection", lambda: torch.zeros((6, 2, 1, 2, 1, 4)).expand(6, 2, 3, 2, 1, 4), "broadcast"),
    ("pages overlapping", lambda: torch.zeros(16).as_strided((6, 2, 4), (1, 4, 1)), "self-overlapping"),
    ("requires grad", lambda: torch.zeros((6, 2, 4), requires_grad=True), "requires grad"),
    ("inference tensor", _inference_cache, "inference tensor"),
    ("meta", lambda: torch.zeros((6, 2, 4), device="meta"), "meta"),
]


@pytest.mark.parametrize("make,fragment", [c[1:] for c in UNWRITABLE_CACHES], ids=[c[0] for c in UNWRITABLE_CACHES])
def test_constructor_refuses_caches_it_cannot_write(make, fragment):
    good = torch.zeros((6, 2, 4))
    with pytest.raises(ValueError, match=rf"caches\[1\] .*{fragment}"):
        PageManager(6, 2, caches=(good, make()))


def test_constructor_accepts_views_of_one_allocation():
    blocks = torch.zeros((6, 2, 3, 2, 1, 4))  # collection [N, 2, L, P, Hk, D]
    interleaved = torch.zeros((6, 2, 2, 1, 4))  # [N, P, 2, Hk, D]
    caches = (blocks, blocks[:, 0, 1], blocks[:, 1, 1], interleaved[:, :, 0], interleaved[:, :, 1],
              torch.zeros((6, 2, 1, 8))[..., ::2], torch.zeros((2, 6, 2, 4)).transpose(0, 1)[:, 1])
    PageManager(6, 2, caches=caches)


@pytest.mark.parametrize("spoil", ["requires_grad", "resize"])
def test_failed_copy_on_write_reserve_changes_nothing(spoil):
    """A cache spoiled after construction: the reserve that must copy a shared page raises naming it
    before the manager moves the sequence to a new page (before, shared_pages 1 -> 0 and free_pages
    5 -> 4 while the copy then failed)."""
    cache = torch.arange(6 * 2 * 4, dtype=torch.float32).view(6, 2, 4)
    manager = PageManager(6, 2, caches=(cache,))
    manager.add_sequence(1)
    manager.reserve(1, 1)
    manager.commit(1, 1)
    manager.fork(1, 2)
    before, data = snapshot(manager, [1, 2]), cache.clone()
    if spoil == "requires_grad":
        cache.requires_grad_(True)
    else:
        cache.resize_(5, 2, 4)
    with pytest.raises(ValueError, match=r"caches\[0\]"):
        manager.reserve(2, 1)
    assert snapshot(manager, [1, 2]) == before
    assert torch.equal(cache.detach()[:5], data[:5])
    manager.check_invariants()
    if spoil == "requires_grad":  # usable again once the cache is
        cache.requires_grad_(False)
        manager.reserve(2, 1)
        assert manager.shared_pages == 0 and torch.equal(cache[manager.pages(2)[0]], cache[manager.pages(1)[0]])


# ---------------------------------------------------------------------------------------------
# page_manager_for: every cache class's pages, whatever dim its storage puts them in
# ---------------------------------------------------------------------------------------------


def _cache_objects(num_pages, page_size):
    from pagedkv import cache as kvc

    geometry = dict(num_kv_heads=2, head_dim=16)
    for dtype in (torch.float32, torch.float8_e4m3fn):
        yield kvc.PagedKVCacheCollection(num_pages, 2, page_size, dtype=dtype, **geometry)
        # blocks [2, N, ...]: with N = 2 the K/V dim has the page count, which the manager alone cannot tell
        yield kvc.PagedKVCacheFA3Fallback(num_pages, 2, page_size, dtype=dtype, **geometry)
        yield kvc.PagedKVCache(num_pages, page_size, dtype=dtype, num_layers=2, **geometry)
    yield kvc.PagedMLACache(num_pages, page_size, num_layers=2)


@pytest.mark.parametrize("num_pages, page_size", [(2, 2), (6, 4)])
def test_page_manager_for_copies_each_page_of_every_cache_class(num_pages, page_size):
    from pagedkv.serving import page_manager_for

    for kv_cache in _cache_objects(num_pages, page_size):
        name = type(kv_cache).__name__
        tensors = kv_cache.page_tensors()
        for i, t in enumerate(tensors):  # every byte of page p of tensor i holds i * 16 + p + 1
            assert t.size(0) == num_pages, name
            for p in range(num_pages):
                t[p].view(torch.uint8).fill_(i * 16 + p + 1)
        before = [t.clone() for t in tensors]
        manager = page_manager_for(kv_cache)
        manager.add_sequence(1)
        manager.reserve(1, page_size - 1)  # one page, partly full
        (src,) = manager.pages(1)
        manager.commit(1, page_size - 1)
        manager.fork(1, 2)
        manager.reserve(2, 1)  # writes into the shared page: a private copy
        (dst,) = manager.pages(2)
        assert dst != src, name
        for i, (t, old) in enumerate(zip(tensors, before)):
            expected = old.clone()
            expected[dst] = old[src]
            assert torch.equal(t.view(torch.uint8), expected.view(torch.uint8)), f"{name} tensor {i}"
