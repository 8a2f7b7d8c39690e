"""Page manager: which physical pages of a paged KV cache each sequence owns.

A pool of ``num_pages`` pages of ``page_size`` tokens. Each sequence (an ``int`` id) holds an ordered
list of pages; page ``j`` of a sequence stores its tokens ``[j*P, (j+1)*P)``. Pages are reference
counted so sequences can share them:

- ``fork`` shares a sequence's pages with a new one (beam search, parallel sampling);
- ``add_sequence`` shares the cached pages of a prompt prefix that an earlier sequence computed
  and committed with its token ids (prefix caching; tokens are compared, not only hashes).

Writing into a shared page is copy-on-write: ``reserve`` gives the sequence a private copy of the
page and copies the page data in every tensor of ``caches`` with ``torch.ops.pagedkv.copy_pages``.

One step of a serving loop::

    manager.reserve(seq, n)                         # pages for n new tokens (OutOfPagesError)
    lookup_table, cache_lengths = manager.export(batch_seqs, device)
    ...  # paged_store / flash_attn_paged with lookup_table, cache_lengths
    manager.commit(seq, n, tokens)                  # the tokens are now in the cache

``commit`` may switch a sequence onto an already registered page holding the same prefix (and free
its own copy), so export again for the next step rather than reusing an old lookup table.

The bookkeeping lives in C (``csrc/core/pkv_page_manager.c``). A manager is not thread-safe: use it
from one thread (calls from several Python threads are serialised by the GIL; a concurrent call
that still overlaps is refused with a RuntimeError rather than corrupting state).

Errors: unknown sequence -> ``KeyError``; bad argument -> ``ValueError`` naming it; no free pages ->
``OutOfPagesError``. A call that raises changes nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Union

import torch

from . import _C  # loading the library registers torch.ops.pagedkv (copy_pages among them)
from .ops import _same_device

__all__ = ["OutOfPagesError", "PageManager", "copy_pages"]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

TokenIds = Union[Sequence[int], torch.Tensor]


class OutOfPagesError(RuntimeError):
    """Not enough free pages for a reserve; the manager is unchanged."""


def copy_pages(pool: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """pool[dst_pages[i]] = pool[src_pages[i]] along dim 0, in place (any strides, any dtype).

    src_pages, dst_pages: int32 [C] on pool's device, values in [0, pool.size(0)), dst entries
    distinct and not in src. Bad input raises RuntimeError naming the argument, nothing written.
    Index values are checked on the host (a small device-to-host copy on CUDA).
    """
    torch.ops.pagedkv.copy_pages(pool, src_pages, dst_pages)


@torch.library.register_fake("pagedkv::copy_pages")
def _copy_pages_fake(pool, src_pages, dst_pages):
    # A call mixing meta and real tensors dispatches here (Meta outranks CPU): check devices like the core,
    # or a copy with meta index lists silently copies nothing.
    _same_device("copy_pages", "pool", pool, src_pages=src_pages, dst_pages=dst_pages)
    return None


def _integer(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool")  # noqa: TRY004 (the API raises ValueError)
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not low <= number <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {number}")
    return number


def _seq_id(value, name: str = "seq_id") -> int:
    return _integer(name, value, _INT64_MIN, _INT64_MAX)


def _count(name: str, value) -> int:
    return _integer(name, value, 0, _INT32_MAX)


def _token_list(name: str, tokens: TokenIds) -> list[int]:
    """Token ids as a list of Python ints in int32 range."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {tokens.dim()}-D {tokens.dtype}")
        values = tokens.tolist()
    else:
        if isinstance(tokens, (str, bytes)):
            raise ValueError(f"{name} must be a sequence of integers, got {type(tokens).__name__}")  # noqa: TRY004
        try:
            values = [operator.index(t) for t in tokens]
        except TypeError:
            raise ValueError(f"{name} must be a sequence of integers") from None
        if any(isinstance(t, bool) for t in tokens):
            raise ValueError(f"{name} must be a sequence of integers, got a bool")
    if values and (min(values) < _INT32_MIN or max(values) > _INT32_MAX):
        raise ValueError(f"{name}: token ids must fit in int32, got values in [{min(values)}, {max(values)}]")
    return values


def _token_dim(cache: torch.Tensor) -> int:
    """Where a cache tensor keeps the tokens of a page: dim 3 of a collection (blocks or scales
    ``[N, 2|1, L, P, Hk, D]``, also the continuous-batching layout), dim 1 of a pool ``[N, P, ...]``."""
    return 3 if cache.dim() == 6 else 1


def _overlaps_itself(cache: torch.Tensor) -> bool:
    """Whether two indices of the view may share an element: a broadcast (stride 0) dim, or strides
    that do not nest (each stride at least the extent of the smaller ones, as slicing, permuting and
    views of a contiguous tensor give). Conservative: a non-nesting view is refused even if disjoint."""
    extent = 1  # elements spanned by the dims taken so far, smallest stride first
    for stride, size in sorted((cache.stride(d), cache.size(d)) for d in range(cache.dim()) if cache.size(d) > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def _check_cache_shape(i: int, cache: torch.Tensor, num_pages: int, page_size: int) -> None:
    if cache.dim() < 2 or cache.size(0) != num_pages:
        raise ValueError(
            f"caches[{i}] must have the page dim first with num_pages={num_pages} entries and a token "
            f"dim, got shape {tuple(cache.shape)}"
        )
    token_dim = _token_dim(cache)
    if cache.size(token_dim) != page_size:
        raise ValueError(
            f"caches[{i}] holds pages of {cache.size(token_dim)} tokens (dim {token_dim} of shape "
            f"{tuple(cache.shape)}), but page_size={page_size}: the manager's pages must be the caches' pages"
        )


def _check_cache(i: int, cache: torch.Tensor) -> None:
    """A cache the copy-on-write copies can write, checked before any state changes (a copy that
    failed after the manager moved a sequence to a new page would leave it pointing at garbage)."""
    if cache.device.type == "meta":
        raise ValueError(f"caches[{i}] is a meta tensor (no data to copy); pass the cache tensor itself")
    if cache.numel() and _overlaps_itself(cache):
        raise ValueError(
            f"caches[{i}] must not be a broadcast (expanded) or self-overlapping view (shape {tuple(cache.shape)}, "
            f"strides {cache.stride()}): copying one of its pages would write another's elements"
        )
    if cache.requires_grad:
        raise ValueError(f"caches[{i}] requires grad: copy-on-write copies write it in place; pass a tensor without grad")
    if cache.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"caches[{i}] is an inference tensor, which cannot be written outside torch.inference_mode(); "
            f"create it outside inference mode or reserve inside it"
        )


def _key_error(error: KeyError) -> KeyError:
    # pybind's KeyError carries the core's message ("seq_id: sequence 5 is not in ...").
    return KeyError(error.args[0] if error.args else "unknown sequence")


class PageManager:
    """Pages of a paged KV cache pool, shared between sequences by reference counting.

    caches: tensors whose dim 0 is the page dim (size num_pages), e.g. a collection's blocks
    ``[N, 2, L, P, Hk, D]`` and its scales (6-D: tokens at dim 3), or separate K and V pools
    ``[N, P, Hk, D]`` (any other rank: tokens at dim 1); views are fine. Their page size must be
    ``page_size``. Copy-on-write copies are applied to each of them.
    """

    def __init__(self, num_pages: int, page_size: int, *, caches: Sequence[torch.Tensor] = ()):
        num_pages = _integer("num_pages", num_pages, 1, _INT32_MAX - 1)
        page_size = _integer("page_size", page_size, 1, _INT32_MAX)
        if isinstance(caches, torch.Tensor):
            raise ValueError("caches must be a sequence of tensors, got a single tensor (wrap it in a tuple)")  # noqa: TRY004
        caches = tuple(caches)
        for i, cache in enumerate(caches):
            if not isinstance(cache, torch.Tensor):
                raise ValueError(f"caches[{i}] must be a torch.Tensor, got {type(cache).__name__}")  # noqa: TRY004
            _check_cache_shape(i, cache, num_pages, page_size)
            _check_cache(i, cache)
        self._native = _C.PageManager(num_pages, page_size)
        self._num_pages = num_pages
        self._page_size = page_size
        self._caches = caches

    # ---- counters ----

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def free_pages(self) -> int:
        """Pages on the free list."""
        return self._native.free_pages

    @property
    def used_pages(self) -> int:
        """Pages held by at least one sequence (free_pages + used_pages == num_pages)."""
        return self._native.used_pages

    @property
    def shared_pages(self) -> int:
        """Pages held by two or more sequences (or slots)."""
        return self._native.shared_pages

    @property
    def num_sequences(self) -> int:
        return int(self._native.stats()["num_sequences"])

    @property
    def prefix_pages(self) -> int:
        """Pages registered for prefix sharing."""
        return int(self._native.stats()["prefix_pages"])

    @property
    def caches(self) -> tuple[torch.Tensor, ...]:
        return self._caches

    def __contains__(self, seq_id) -> bool:
        return self._native.contains(_seq_id(seq_id))

    def __repr__(self) -> str:
        s = self._native.stats()
        return (
            f"PageManager(num_pages={self._num_pages}, page_size={self._page_size}, free={s['free_pages']}, "
            f"shared={s['shared_pages']}, sequences={s['num_sequences']}, prefix_pages={s['prefix_pages']})"
        )

    # ---- sequences ----

    def add_sequence(self, seq_id: int, prompt_tokens: TokenIds | None = None) -> int:
        """Create a sequence; returns how many prompt tokens are already cached.

        The leading full pages of ``prompt_tokens`` that are cached (committed with token ids by
        a live sequence) are shared. The count is a multiple of page_size and less than
        ``len(prompt_tokens)``, so at least one prompt token is computed; the sequence's length
        starts at that count. Reserve and commit the rest of the prompt (with its token ids, so
        its pages can be shared in turn). ValueError if seq_id is already in use.
        """
        seq_id = _seq_id(seq_id)
        tokens = [] if prompt_tokens is None else _token_list("prompt_tokens", prompt_tokens)
        try:
            return self._native.add_sequence(seq_id, tokens)
        except KeyError as error:
            raise _key_error(error) from None

    def reserve(self, seq_id: int, num_new_tokens: int) -> None:
        """Make room for num_new_tokens more tokens after the sequence's length.

        Allocates pages only when the capacity is short. A shared page that the new tokens would
        write into is replaced by a private copy, and its data is copied in every cache. Raises
        OutOfPagesError (nothing changed) when the free pages do not suffice, ValueError (nothing
        changed) when a cache cannot be written any more (e.g. it was made to require grad).
        """
        seq_id = _seq_id(seq_id)
        num_new_tokens = _count("num_new_tokens", num_new_tokens)
        try:
            # Caches that copies will write are checked again before the manager changes: a tensor's
            # flags and shape can change after construction, and a copy that fails after the native
            # reserve cannot be undone.
            if self._caches and self._native.copies_needed(seq_id, num_new_tokens):
                for i, cache in enumerate(self._caches):
                    _check_cache_shape(i, cache, self._num_pages, self._page_size)
                    _check_cache(i, cache)
            src, dst = self._native.reserve(seq_id, num_new_tokens)
        except _C.PageManagerOutOfPagesError as error:
            raise OutOfPagesError(str(error)) from None
        except KeyError as error:
            raise _key_error(error) from None
        if src:
            self._copy(src, dst)

    def can_reserve(self, seq_id: int, num_new_tokens: int) -> bool:
        """Whether reserve(seq_id, num_new_tokens) would succeed now."""
        seq_id = _seq_id(seq_id)
        num_new_tokens = _count("num_new_tokens", num_new_tokens)
        try:
            return self._native.pages_needed(seq_id, num_new_tokens) <= self._native.free_pages
        except KeyError as error:
            raise _key_error(error) from None

    def pages_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Free pages that reserve(seq_id, num_new_tokens) would take (new pages and copies)."""
        seq_id = _seq_id(seq_id)
        num_new_tokens = _count("num_new_tokens", num_new_tokens)
        try:
            return self._native.pages_needed(seq_id, num_new_tokens)
        except KeyError as error:
            raise _key_error(error) from None

    def commit(self, seq_id: int, num_new_tokens: int, tokens: TokenIds | None = None) -> None:
        """Advance the sequence's length by num_new_tokens (within what was reserved).

        With ``tokens`` (num_new_tokens ids), pages that become full are registered for prefix
        sharing, or switched to the registered page of the same prefix. A commit without tokens
        ends registration for this sequence (its later pages cannot be matched).
        """
        seq_id = _seq_id(seq_id)
        num_new_tokens = _count("num_new_tokens", num_new_tokens)
        token_list = None
        if tokens is not None:
            token_list = _token_list("tokens", tokens)
            if len(token_list) != num_new_tokens:
                raise ValueError(f"tokens: got {len(token_list)} token ids for num_new_tokens={num_new_tokens}")
        try:
            self._native.commit(seq_id, num_new_tokens, token_list)
        except KeyError as error:
            raise _key_error(error) from None

    def release(self, seq_id: int) -> None:
        """Drop the sequence; pages nobody else holds return to the free list."""
        seq_id = _seq_id(seq_id)
        try:
            self._native.release(seq_id)
        except KeyError as error:
            raise _key_error(error) from None

    def fork(self, src_seq: int, dst_seq: int) -> None:
        """Create dst_seq sharing src_seq's pages (those holding its tokens) at the same length."""
        src_seq = _seq_id(src_seq, "src_seq")
        dst_seq = _seq_id(dst_seq, "dst_seq")
        try:
            self._native.fork(src_seq, dst_seq)
        except KeyError as error:
            raise _key_error(error) from None

    def length(self, seq_id: int) -> int:
        """Committed tokens of the sequence."""
        seq_id = _seq_id(seq_id)
        try:
            return self._native.length(seq_id)
        except KeyError as error:
            raise _key_error(error) from None

    def pages(self, seq_id: int) -> list[int]:
        """The sequence's pages in logical order, including pages reserved past its length."""
        seq_id = _seq_id(seq_id)
        try:
            return self._native.pages(seq_id)
        except KeyError as error:
            raise _key_error(error) from None

    # ---- export ----

    def export(
        self, seq_ids: Sequence[int], device=None, *, width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """lookup_table int32 [B, W] and cache_lengths int32 [B] for the sequences, in order.

        W is the largest page count among them rounded up to a multiple of 16 (at least 16), so
        vectorised loads of up to 16 entries stay in bounds; entries past a sequence's pages are
        0 (a valid page). ``width`` asks for a larger fixed W (a multiple of 16, e.g. to keep
        shapes static for CUDA graphs). Ids may repeat.
        """
        if isinstance(seq_ids, torch.Tensor):
            seq_ids = seq_ids.tolist()
        ids = [_seq_id(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        try:
            needed = self._native.export_width(ids)
        except KeyError as error:
            raise _key_error(error) from None
        if width is not None:
            width = _integer("width", width, 0, _INT32_MAX)
            if width % 16 != 0 or width < needed:
                raise ValueError(f"width must be a multiple of 16 and at least {needed}, got {width}")
            needed = width
        lookup_table = torch.empty((len(ids), needed), dtype=torch.int32)
        cache_lengths = torch.empty((len(ids),), dtype=torch.int32)
        self._native.export_into(ids, needed, lookup_table.numpy(), cache_lengths.numpy())
        if device is not None and torch.device(device) != lookup_table.device:
            lookup_table = lookup_table.to(device)
            cache_lengths = cache_lengths.to(device)
        return lookup_table, cache_lengths

    def check_invariants(self) -> None:
        """Raise RuntimeError if the manager's bookkeeping is inconsistent (it never should be)."""
        self._native.check_invariants()

    # ---- internals ----

    def _copy(self, src: list[int], dst: list[int]) -> None:
        indices = {}
        for cache in self._caches:
            if cache.device not in indices:
                indices[cache.device] = (
                    torch.tensor(src, dtype=torch.int32, device=cache.device),
                    torch.tensor(dst, dtype=torch.int32, device=cache.device),
                )
            src_pages, dst_pages = indices[cache.device]
            torch.ops.pagedkv.copy_pages(cache, src_pages, dst_pages)
