"""The page pool of a PagedCache: one set of page tensors per layer (``_LayerPages``), sized at the
layer's first store, and the rows' pages with reference counts, copy on write and a free list
(``_Pool``), grown by POOL_GROWTH when a step needs more pages."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import host_alloc, ops
from ..dtypes import is_fp8, num_scale_groups
from ..page_manager import copy_pages

# Pages in a PagedCache grow by this factor when a step needs more (amortised copies).
POOL_GROWTH = 2


class _LayerPages:
    """One layer's pages, sized from what the layer stores: K [N, P, Hk, Dk] and V [N, P, Hk, Dv]
    (MLA layers store K and V of different widths), with float32 scales for FP8 dtypes."""

    def __init__(self, num_pages, page_size, num_heads, k_dim, v_dim, dtype, device, quant_group):
        self.quant_group = quant_group
        self.k, self.k_scales = self._pages(num_pages, page_size, num_heads, k_dim, dtype, device)
        self.v, self.v_scales = self._pages(num_pages, page_size, num_heads, v_dim, dtype, device)

    def _pages(self, num_pages, page_size, num_heads, dim, dtype, device):
        pages = host_alloc.zeros((num_pages, page_size, num_heads, dim), dtype=dtype, device=device)
        scales = None
        if is_fp8(dtype):
            groups = num_scale_groups(dim, self.quant_group)
            scales = torch.ones((num_pages, page_size, num_heads, groups), dtype=torch.float32, device=device)
        return pages, scales

    @property
    def num_pages(self) -> int:
        return self.k.size(0)

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the pages, page dim first: K, V and their scales where FP8."""
        return tuple(t for t in (self.k, self.v, self.k_scales, self.v_scales) if t is not None)

    def grow(self, num_pages: int) -> None:
        """Copies the pages into num_pages larger tensors (page ids stay)."""
        for name in ("k", "v", "k_scales", "v_scales"):
            old = getattr(self, name)
            if old is None:
                continue
            new = (torch.zeros if name in ("k", "v") else torch.ones)(
                (num_pages, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[: old.size(0)].copy_(old)
            setattr(self, name, new)

    def shrink(self, num_pages: int) -> None:
        """Keeps pages [0, num_pages) in tensors of that size (a rolled-back step had grown them)."""
        for name in ("k", "v", "k_scales", "v_scales"):
            old = getattr(self, name)
            if old is not None:
                setattr(self, name, old[:num_pages].clone())

    def store(self, key, value, offsets, cache_lengths, lookup) -> None:
        ops.paged_store(key, value, self.k, self.v, offsets, cache_lengths, lookup, self.k_scales, self.v_scales,
                        self.quant_group)

    def attend(self, query, offsets, cache_lengths, lookup, options) -> torch.Tensor:
        return ops.flash_attn_paged(query, offsets, self.k, self.v, cache_lengths, lookup, k_scales=self.k_scales,
                                    v_scales=self.v_scales, quant_group=self.quant_group, **options)

    def gather(self, lookup, lengths, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [0, lengths[b]) of every row: K [sum, Hk, Dk] and V [sum, Hk, Dv] in dtype."""
        return tuple(ops.paged_load(pages, lookup, lengths, scales=scales, out_dtype=dtype,
                                    quant_group=self.quant_group)
                     for pages, scales in ((self.k, self.k_scales), (self.v, self.v_scales)))


class _Pool:
    """The pages of a PagedCache: each row's page list (shared by all layers) and each layer's
    pages, made at the layer's first store with its shapes; all grow together when a step needs
    more pages than are free.

    Rows may share pages (beam search gives several rows one history): each page has a reference
    count (the row page lists that hold it), a row about to write into a page another row holds
    first copies it to a page of its own (copy on write, see ``reserve``), and a page no row holds
    any more goes to the free list, taken before new pages are cut from the pool."""

    def __init__(self, page_size, dtype, device, num_pages, quant_group):
        self.page_size, self.dtype, self.device, self.quant_group = page_size, dtype, device, quant_group
        self.num_pages = num_pages
        self.layers: dict[int, _LayerPages] = {}
        self.row_pages: list[list[int]] = []
        self.next_free = 0  # pages [next_free, num_pages) were never handed out
        self.refs: list[int] = []  # refs[page]: how many row page lists hold page (page < next_free)
        self.free: list[int] = []  # pages below next_free that no row holds
        self.lookup_table: torch.Tensor | None = None

    def layer(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> _LayerPages:
        """Layer layer_idx's pages; made at its first store from key [.., Hk, Dk] / value [.., Hk, Dv]."""
        pages = self.layers.get(layer_idx)
        if pages is None:
            if key.size(-2) != value.size(-2):
                raise ValueError(f"PagedCache: layer {layer_idx} stores K with {key.size(-2)} heads and V with "
                                 f"{value.size(-2)}; a paged layer needs one head count for both")
            pages = _LayerPages(self.num_pages, self.page_size, key.size(-2), key.size(-1), value.size(-1),
                                self.dtype, self.device, self.quant_group)
            self.layers[layer_idx] = pages
        return pages

    def reserve(self, row_lengths: Sequence[int], stored_before: Sequence[int]) -> torch.Tensor:
        """Pages for rows that hold stored_before[b] tokens and will hold row_lengths[b] after this
        step; a page the step writes that another row also holds is copied first. Returns lookup_table."""
        while len(self.row_pages) < len(row_lengths):
            self.row_pages.append([])
        page_size = self.page_size
        wanted = [max(0, -(-length // page_size) - len(pages)) for length, pages in zip(row_lengths, self.row_pages)]
        shared = self._shared_pages_written(stored_before, row_lengths)
        if self.lookup_table is not None and not any(wanted) and not shared:
            return self.lookup_table
        fresh = self._take(sum(wanted) + len(shared))
        if shared:
            self._copy_on_write(shared, fresh[: len(shared)])
            fresh = fresh[len(shared):]
        for pages, count in zip(self.row_pages, wanted):
            pages.extend(fresh[:count])
            fresh = fresh[count:]
        return self._build_lookup_table()

    def _shared_pages_written(self, stored_before, row_lengths) -> list[tuple[int, int]]:
        """(row, index in its page list) of each page a row writes in this step (tokens
        [stored_before, row_length)) that other rows hold too. The last of a page's holders to be
        listed keeps it (the others get copies), so no page is copied for nobody."""
        shared, holders = [], {}
        for row, (before, after) in enumerate(zip(stored_before, row_lengths)):
            if after <= before:  # a row that stores nothing this step (a padding hole) writes no page
                continue
            pages = self.row_pages[row]
            for index in range(before // self.page_size, min(len(pages), -(-after // self.page_size))):
                page = pages[index]
                count = holders.get(page, self.refs[page])
                if count > 1:
                    shared.append((row, index))
                    holders[page] = count - 1
        return shared

    def _copy_on_write(self, shared: list[tuple[int, int]], fresh: list[int]) -> None:
        """Gives each (row, index) of shared the page of fresh in its place, holding a copy of
        the shared page in every layer, so the row's writes leave the other rows' page as it is."""
        sources = [self.row_pages[row][index] for row, index in shared]
        src = torch.tensor(sources, dtype=torch.int32, device=self.device)
        dst = torch.tensor(fresh, dtype=torch.int32, device=self.device)
        for layer in self.layers.values():
            for tensor in layer.page_tensors():
                copy_pages(tensor, src, dst)
        for (row, index), old, new in zip(shared, sources, fresh):
            self.row_pages[row][index] = new
            self.refs[old] -= 1  # still >= 1: the page was shared

    def _take(self, count: int) -> list[int]:
        """count pages no row holds, each with one reference: free pages first, then pages never
        handed out (the pool grows when those run out)."""
        taken = [self.free.pop() for _ in range(min(count, len(self.free)))]
        new = count - len(taken)
        if self.next_free + new > self.num_pages:
            self._grow(max(self.next_free + new, POOL_GROWTH * self.num_pages))
        taken.extend(range(self.next_free, self.next_free + new))
        self.next_free += new
        self.refs.extend([0] * new)
        for page in taken:
            self.refs[page] = 1
        return taken

    def _release(self, pages: Sequence[int]) -> None:
        """One reference less on each of pages; those no row holds any more become free."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    def select_rows(self, sources: Sequence[int]) -> None:
        """Row i becomes a copy of old row sources[i] (any order, repeats allowed): page lists are
        copied and their pages gain a reference each; pages only dropped rows held become free."""
        rows = [list(self.row_pages[source]) for source in sources]
        for pages in rows:
            for page in pages:
                self.refs[page] += 1
        for pages in self.row_pages:
            self._release(pages)
        self.row_pages = rows
        self._build_lookup_table()

    def truncate_rows(self, row_lengths: Sequence[int]) -> None:
        """Each row keeps the pages its first row_lengths[b] tokens lie in; the rest are released."""
        for pages, length in zip(self.row_pages, row_lengths):
            keep = -(-length // self.page_size)
            self._release(pages[keep:])
            del pages[keep:]
        self._build_lookup_table()

    def _build_lookup_table(self) -> torch.Tensor:
        width = max(1, max((len(p) for p in self.row_pages), default=0))
        table = torch.zeros((len(self.row_pages), width), dtype=torch.int32)
        for row, pages in enumerate(self.row_pages):
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.lookup_table = table.to(self.device)
        return self.lookup_table

    def snapshot(self) -> tuple:
        """The bookkeeping a forward step may change (see PagedCache._begin_step):
        restore(snapshot) undoes its reservations, copies on write and growth."""
        return (self.num_pages, frozenset(self.layers), [list(pages) for pages in self.row_pages], self.next_free,
                list(self.refs), list(self.free), self.lookup_table)

    def restore(self, state: tuple) -> None:
        """Back to a snapshot (taken over, not copied): pages taken since are no row's again, layers made since are dropped
        and grown page tensors cut back. K/V written since lie only in pages the snapshot's rows do
        not hold or past the rows' stored lengths (a shared page is copied before it is written)."""
        num_pages, layers, self.row_pages, self.next_free, self.refs, self.free, self.lookup_table = state
        for layer_idx in set(self.layers) - layers:
            del self.layers[layer_idx]
        if self.num_pages != num_pages:
            for pages in self.layers.values():
                pages.shrink(num_pages)
            self.num_pages = num_pages

    def forget_rows(self) -> None:
        """No rows any more (a reset cache): every page is free for the next batch's rows."""
        self.row_pages, self.next_free, self.lookup_table = [], 0, None
        self.refs, self.free = [], []

    def _grow(self, num_pages: int) -> None:
        for pages in self.layers.values():
            pages.grow(num_pages)
        self.num_pages = num_pages
