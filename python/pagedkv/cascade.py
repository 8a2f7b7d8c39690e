"""Cascade attention for batches that share a prompt prefix.

When many requests share their first pages (the page manager's prefix sharing stores a common system
prompt once and maps it into every request's lookup table), plain `flash_attn_paged` still reads those
pages once per request. `cascade_attention` reads them once for all queries instead:

1. the shared prefix: every query of the batch attends the prefix pages as one row (not causal: each
   query sits after the whole prefix), so each K/V tile is read once and used by all queries;
2. the rest: each request attends only its own pages (positions shifted by the prefix length);
3. the two partial attentions are combined exactly with their log-sum-exps (`merge_attn_states`).

The result equals `flash_attn_paged` over the whole sequences. The same log-sum-exp merge combines
partial attentions computed anywhere (other devices or machines holding other parts of the keys), which
is what context-parallel (ring) attention does.
"""

from __future__ import annotations

from typing import Optional

import torch

from .argument_checks import check_index_tensors, check_tensor
from .kv_formats import kv_format_row
from .ops import checks_enabled, flash_attn_paged, flash_attn_paged_lse, merge_attn_states

__all__ = ["cascade_attention"]


def _check_shared_prefix(lookup_table, cache_lengths, shared_pages, prefix_len):
    table = lookup_table.detach().to("cpu")
    lengths = cache_lengths.detach().to("cpu")
    if table.size(0) > 1 and not bool((table[:, :shared_pages] == table[:1, :shared_pages]).all()):
        rows = (table[:, :shared_pages] != table[:1, :shared_pages]).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(
            f"cascade_attention: lookup_table[:, :shared_pages] must be the same physical pages in every row "
            f"(shared_pages={shared_pages}); rows {rows[:8]} differ from row 0"
        )
    if lengths.numel() and int(lengths.min()) < prefix_len:
        raise ValueError(
            f"cascade_attention: every cache_lengths entry must be >= the shared prefix ({shared_pages} pages x "
            f"{prefix_len // shared_pages} tokens = {prefix_len}) so that each query sits after it, got "
            f"min {int(lengths.min())}"
        )


def cascade_attention(
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    shared_pages: int,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
    quant_group: int = 128,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    kv_format: Optional[str] = None,
) -> torch.Tensor:
    """`flash_attn_paged` for a batch whose rows share their first `shared_pages` logical pages.

    Same arguments as `flash_attn_paged` (no sliding window: a window would cut into the prefix), plus
    `shared_pages`: every row's `lookup_table[b, :shared_pages]` are the same physical pages and every
    `cache_lengths[b] >= shared_pages * P` (this step's queries come after the prefix). These two
    conditions are checked on the host on CPU always, on CUDA when checks are on
    (`pagedkv.set_checks(True)` / PAGEDKV_CHECK=1). No host synchronisation otherwise.
    Returns `[T, Hq, Dv]` in q's dtype; padding rows are zeros. Packed MLA rows (`kv_format`,
    `v_cache=None`) as for `flash_attn_paged`.
    """
    # The index tensors are read here (the prefix check, the offsets' end, the table's columns) before
    # any op sees them: checked as the ops check them, so that an error names the argument.
    op = "cascade_attention"
    kv_format_row(kv_format, op)
    check_tensor(op, "k_cache", k_cache, 4, "[N, P, Hk, D]")
    check_tensor(op, "q", q, 3, "[T, Hq, D]", device=k_cache.device, device_ref="k_cache")
    check_index_tensors(op, "input_row_offsets", input_row_offsets, "cache_lengths", cache_lengths, lookup_table,
                        k_cache.device, "k_cache")
    if not isinstance(shared_pages, int) or isinstance(shared_pages, bool):
        raise TypeError(f"cascade_attention: shared_pages must be an int, got {type(shared_pages).__name__}")
    if not 1 <= shared_pages <= lookup_table.size(1):
        raise ValueError(
            f"cascade_attention: shared_pages must be in [1, lookup_table.size(1)] (= {lookup_table.size(1)}), "
            f"got {shared_pages}"
        )
    prefix_len = shared_pages * k_cache.size(1)
    if k_cache.device.type == "cpu" or (checks_enabled() and not k_cache.is_meta):  # meta tensors hold no values
        _check_shared_prefix(lookup_table, cache_lengths, shared_pages, prefix_len)

    attn = dict(scale=scale, k_scales=k_scales, v_scales=v_scales, quant_group=quant_group, softcap=softcap,
                kv_format=kv_format)
    if q.size(0) == 0 or lookup_table.size(0) == 0:
        # No query, or no row (every query row is padding): nothing attends the prefix, and the prefix
        # part below would have no chunk to concatenate (T = 0) or no row 0 to take the pages from (B = 0).
        # The plain op gives the empty or all-zero result and checks the arguments.
        return flash_attn_paged(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table,
                                causal=causal, sinks=sinks, **attn)
    # 1. the prefix: all query rows as one row that sees every prefix key. A row holds at most
    #    prefix_len queries (its cache length prefix_len - n must not be negative), hence the chunks.
    prefix_table = lookup_table[:1, :shared_pages]
    outs, lses = [], []
    for first in range(0, q.size(0), prefix_len):
        n = min(prefix_len, q.size(0) - first)
        offsets = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        lengths = torch.tensor([prefix_len - n], dtype=torch.int32, device=q.device)
        out, lse = flash_attn_paged_lse(q[first:first + n], offsets, k_cache, v_cache, lengths, prefix_table,
                                        causal=False, **attn)
        outs.append(out)
        lses.append(lse)
    out_prefix = torch.cat(outs) if len(outs) != 1 else outs[0]
    lse_prefix = torch.cat(lses) if len(lses) != 1 else lses[0]
    # padding rows (at or after offsets[B]) must stay zeros: their prefix part is dropped
    rows = torch.arange(q.size(0), device=q.device).unsqueeze(1)
    lse_prefix = torch.where(rows < input_row_offsets[-1], lse_prefix, float("-inf"))

    # 2. each row's own pages, positions shifted by the prefix (the sink joins the softmax once, here)
    out_rest, lse_rest = flash_attn_paged_lse(
        q, input_row_offsets, k_cache, v_cache, cache_lengths - prefix_len, lookup_table[:, shared_pages:],
        causal=causal, sinks=sinks, **attn,
    )
    # 3. exact log-sum-exp merge
    out, _ = merge_attn_states(out_prefix, lse_prefix, out_rest, lse_rest)
    return out
