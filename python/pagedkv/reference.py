"""Plain-torch reference implementations of the pagedkv ops (see CONTRACT.md).

These functions define what the C/CUDA kernels must compute. They favour obviously-correct code over
speed: loops over batch rows, explicit gathers, one softmax per row. Attention can run in float64.

Shape symbols follow CONTRACT.md: B rows, T ragged tokens, Hq/Hk query/KV heads, D/Dv key/value head
size, P page size, N pages, G quantization group.
"""

from __future__ import annotations

import math

import torch

from .argument_checks import check_host_readable, check_index_tensors
from .dtypes import FLOAT_DTYPES, FP8_DTYPES, fp8_max, is_fp8, is_per_tensor_scale, num_scale_groups
from .kv_formats import DS_MLA_GROUP, LATENT_DIM, ROPE_DIM, PackedRow, packed_row

__all__ = [
    "FP8_DTYPES",
    "FLOAT_DTYPES",
    "fp8_max",
    "is_fp8",
    "num_scale_groups",
    "quantize_fp8",
    "dequantize_fp8",
    "pack_mla_rows",
    "unpack_mla_rows",
    "gather_rows",
    "contiguous_kv",
    "paged_store",
    "paged_load",
    "flash_attn_paged",
    "flash_attn_paged_lse",
    "merge_attn_states",
    "flash_attn_paged_sparse",
]


def _group_bounds(head_dim: int, quant_group: int):
    for g in range(num_scale_groups(head_dim, quant_group)):
        yield g, g * quant_group, min((g + 1) * quant_group, head_dim)


def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, group: int = 128, *, scale: torch.Tensor | None = None):
    """Quantize `x [..., D]` per group of `group` channels, or with one given per-tensor `scale`.

    Returns `(q [..., D] fp8_dtype, scales [..., ceil(D/G)] float32)` with, per group,
    `scale = amax / FP8_MAX` in float32 (1 when amax == 0) and
    `q = fp8(clamp(x / scale, -FP8_MAX, FP8_MAX))`, the division done in float32 and the
    conversion rounding to nearest even. With `scale` (a one-element float32 tensor, as
    `paged_store` takes a per-tensor scale): `q` from that scale for every element, and the
    scale itself (unchanged) in place of `scales`.
    """
    fmax = fp8_max(fp8_dtype)
    head_dim = x.shape[-1]
    x32 = x.to(torch.float32)
    if scale is not None:
        if not is_per_tensor_scale(scale):
            raise ValueError(f"scale must hold one element (shape [] or [1]), got shape {list(scale.shape)}")
        s = scale.to(device=x.device, dtype=torch.float32).reshape(())
        return (x32 / s).clamp(-fmax, fmax).to(fp8_dtype), scale
    q = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scales = torch.empty(
        (*x.shape[:-1], num_scale_groups(head_dim, group)), dtype=torch.float32, device=x.device
    )
    for g, lo, hi in _group_bounds(head_dim, group):
        chunk = x32[..., lo:hi]
        amax = chunk.abs().amax(dim=-1)
        scale = amax / torch.tensor(fmax, dtype=torch.float32, device=x.device)
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)
        scaled = (chunk / scale.unsqueeze(-1)).clamp(-fmax, fmax)
        q[..., lo:hi] = scaled.to(fp8_dtype)
        scales[..., g] = scale
    return q, scales


def dequantize_fp8(
    q: torch.Tensor, scales: torch.Tensor, group: int = 128, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8`: `float(q) * s` for `q [..., D]`, `scales [..., ceil(D/G)]` or one
    per-tensor scale (shape [] or [1]).

    The product is formed in float32 (float64 when `out_dtype` is float64, where it is exact) and
    then converted to `out_dtype`.
    """
    compute = torch.float64 if out_dtype == torch.float64 else torch.float32
    head_dim = q.shape[-1]
    if is_per_tensor_scale(scales):
        return (q.to(compute) * scales.to(device=q.device, dtype=compute).reshape(())).to(out_dtype)
    if scales.shape[-1] != num_scale_groups(head_dim, group):
        raise ValueError(
            f"scales must have ceil(D/G) = {num_scale_groups(head_dim, group)} groups, "
            f"got {scales.shape[-1]}"
        )
    index = torch.arange(head_dim, device=q.device) // group
    expanded = scales.to(compute).index_select(-1, index)
    return (q.to(compute) * expanded).to(out_dtype)


def _row_bytes(values: torch.Tensor) -> torch.Tensor:
    """The bytes of `values [..., C]` (native, little-endian here): uint8 [..., C * element size]."""
    return values.contiguous().view(torch.uint8)


def _row_part(rows: torch.Tensor, start: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    """`count` values of `dtype` stored at byte `start` of each row of `rows` uint8 [..., row_bytes]."""
    size = torch.empty((), dtype=dtype).element_size()
    return rows[..., start : start + count * size].contiguous().view(dtype)


def _latent_scale(layout: PackedRow, scale: torch.Tensor | None) -> torch.Tensor | None:
    if layout.per_tensor_scale and (scale is None or not is_per_tensor_scale(scale)):
        raise ValueError(f"{layout.name} needs the per-tensor scale of the latent (one float32 element), got {scale!r}")
    if not layout.per_tensor_scale and scale is not None:
        raise ValueError(f"{layout.name} keeps its scales in the rows: scale must be None")
    return scale


def pack_mla_rows(key: torch.Tensor, kv_format: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Pack logical MLA keys `key [..., 576]` into `kv_format`'s uint8 rows `[..., row_bytes]`, as
    `paged_store` writes them (CONTRACT v1.2): the latent `key[..., :512]` quantized to e4m3 by
    `quantize_fp8` (fp8_ds_mla: per 128 channels `scale = amax / 448` stored after the latent;
    fp8_rope: with the given per-tensor `scale`, which is not stored), the rope `key[..., 512:]`
    rounded to bfloat16 (nearest even)."""
    layout = packed_row(kv_format)
    scale = _latent_scale(layout, scale)
    latent, rope = key[..., :LATENT_DIM], key[..., LATENT_DIM:]
    rows = torch.zeros((*key.shape[:-1], layout.row_bytes), dtype=torch.uint8, device=key.device)
    codes, scales = quantize_fp8(latent, torch.float8_e4m3fn, DS_MLA_GROUP, scale=scale)
    rows[..., :LATENT_DIM] = _row_bytes(codes)
    if not layout.per_tensor_scale:
        rows[..., layout.scales_offset : layout.rope_offset] = _row_bytes(scales)
    rows[..., layout.rope_offset :] = _row_bytes(rope.to(torch.bfloat16))
    return rows


def unpack_mla_rows(
    rows: torch.Tensor, kv_format: str, scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Logical keys `[..., 576]` of packed rows `rows uint8 [..., row_bytes]` (any producer's):
    `concat(float(latent) * its scale, rope)`, the product formed as `dequantize_fp8` forms it, in
    `out_dtype`. fp8_rope takes the per-tensor `scale`; fp8_ds_mla reads the four scales in the rows."""
    layout = packed_row(kv_format)
    scale = _latent_scale(layout, scale)
    codes = _row_part(rows, 0, torch.float8_e4m3fn, LATENT_DIM)
    if layout.per_tensor_scale:
        scales = scale
    else:
        scales = _row_part(rows, layout.scales_offset, torch.float32, LATENT_DIM // DS_MLA_GROUP)
    latent = dequantize_fp8(codes, scales, DS_MLA_GROUP, out_dtype)
    rope = _row_part(rows, layout.rope_offset, torch.bfloat16, ROPE_DIM)
    return torch.cat([latent, rope.to(out_dtype)], dim=-1)


def _logical_cache(k_cache, v_cache, k_scales, v_scales, kv_format: str, dtype: torch.dtype):
    """A packed cache as the plain caches the reference attends over: `(keys [N, P, 1, 576],
    values [N, P, 1, 512])` in `dtype` (every row unpacked; rows never read may hold anything)."""
    if v_cache is not None or v_scales is not None:
        raise ValueError(f"kv_format {kv_format!r} keeps K and V in one row: v_cache and v_scales must be None")
    keys = unpack_mla_rows(k_cache, kv_format, k_scales, dtype)
    return keys, keys[..., :LATENT_DIM]


def _scales_at(scales: torch.Tensor, *index) -> torch.Tensor:
    """The scales of the cache entries `index` selects: per-token scales indexed like the cache,
    or the per-tensor scale itself."""
    return scales if is_per_tensor_scale(scales) else scales[index]


def _to_list(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.detach().cpu().reshape(-1).tolist()]


def _positions_to_slots(lookup_row: torch.Tensor, positions: torch.Tensor, page_size: int):
    """Map logical positions of one sequence to (page, slot) index tensors (int64)."""
    pages = lookup_row.to(torch.int64)[positions // page_size]
    return pages, positions % page_size


def gather_rows(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    lookup_table: torch.Tensor,
    lengths,
    *,
    quant_group: int = 128,
    out_dtype: torch.dtype | None = None,
    kv_format: str | None = None,
) -> list[torch.Tensor]:
    """Gather logical tokens `[0, lengths[b])` of every row from a paged `cache [N, P, Hk, D]`.

    Returns a list of B tensors `[lengths[b], Hk, D]` in `out_dtype` (default: the cache dtype for
    float caches, float32 for FP8 caches, which are dequantized with `scales`). A packed cache
    (`kv_format`) gives its logical keys `[lengths[b], 1, 576]` (`unpack_mla_rows`).
    """
    page_size = cache.shape[1]
    if out_dtype is None:
        out_dtype = torch.float32 if is_fp8(cache.dtype) or kv_format is not None else cache.dtype
    if is_fp8(cache.dtype) and scales is None:
        raise ValueError("gather_rows: scales are required for an FP8 cache")
    rows = []
    for b, length in enumerate(_to_list(torch.as_tensor(lengths))):
        positions = torch.arange(length, device=cache.device)
        pages, slots = _positions_to_slots(lookup_table[b], positions, page_size)
        values = cache[pages, slots]
        if kv_format is not None:
            values = unpack_mla_rows(values, kv_format, scales, out_dtype)
        elif is_fp8(cache.dtype):
            values = dequantize_fp8(values, _scales_at(scales, pages, slots), quant_group, out_dtype)
        else:
            values = values.to(out_dtype)
        rows.append(values)
    return rows


def contiguous_kv(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    lookup_table: torch.Tensor,
    lengths,
    *,
    quant_group: int = 128,
    out_dtype: torch.dtype | None = None,
    padded: bool = False,
):
    """Gather a paged cache into contiguous memory (e.g. to feed torch SDPA as a peer).

    `padded=False`: returns `(values [sum(lengths), Hk, D], row_offsets int32 [B+1])`.
    `padded=True`: returns `(values [B, Hk, max(lengths), D], lengths int32 [B])`, zero-padded, in
    the head-major layout SDPA expects.
    """
    rows = gather_rows(
        cache, scales, lookup_table, lengths, quant_group=quant_group, out_dtype=out_dtype
    )
    lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.int32)
    if not padded:
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(lens, 0)
        if rows:
            values = torch.cat(rows, 0)
        else:
            values = cache.new_empty((0, *cache.shape[2:]), dtype=out_dtype or cache.dtype)
        return values, offsets.to(cache.device)
    max_len = int(lens.max()) if len(rows) else 0
    dtype = rows[0].dtype if rows else (out_dtype or cache.dtype)
    values = torch.zeros(
        (len(rows), cache.shape[2], max_len, cache.shape[3]), dtype=dtype, device=cache.device
    )
    for b, r in enumerate(rows):
        values[b, :, : r.shape[0]] = r.transpose(0, 1)
    return values, lens.to(cache.device)


def _check_indices(op, offsets, lengths, lookup_table, cache, lengths_name="cache_lengths",
                   offsets_name="input_row_offsets", offsets_sizes="B+1"):
    """The index tensors as the ops check them (type, rank, int32, the cache's device, B), with values
    to read on the host: errors name the argument, as the ops' do."""
    device = cache.device if isinstance(cache, torch.Tensor) else None
    check_index_tensors(op, offsets_name, offsets, lengths_name, lengths, lookup_table, device, "the cache",
                        offsets_sizes=offsets_sizes)
    check_host_readable(op, **{offsets_name: offsets, lengths_name: lengths, "lookup_table": lookup_table})


def _row_spans(input_row_offsets: torch.Tensor) -> list[tuple[int, int]]:
    offsets = _to_list(input_row_offsets)
    return list(zip(offsets[:-1], offsets[1:]))


def _store_one(src, cache, scales, lookup_row, start_pos, quant_group, kv_format=None):
    # src [n, Hk, D]; writes logical positions [start_pos, start_pos + n).
    n = src.shape[0]
    if n == 0:
        return
    positions = torch.arange(start_pos, start_pos + n, device=cache.device)
    pages, slots = _positions_to_slots(lookup_row, positions, cache.shape[1])
    if kv_format is not None:
        cache[pages, slots] = pack_mla_rows(src, kv_format, scales)
    elif is_fp8(cache.dtype) and is_per_tensor_scale(scales):
        cache[pages, slots] = quantize_fp8(src, cache.dtype, quant_group, scale=scales)[0]
    elif is_fp8(cache.dtype):
        q, s = quantize_fp8(src, cache.dtype, quant_group)
        cache[pages, slots] = q
        scales[pages, slots] = s
    else:
        cache[pages, slots] = src.to(cache.dtype)


def paged_store(
    key: torch.Tensor,
    value: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    quant_group: int = 128,
    kv_format: str | None = None,
) -> None:
    """Write the new tokens of every row into the paged caches (in place).

    key [T, Hk, D], value [T, Hk, Dv] or None (K-only caches), k_cache [N, P, Hk, D],
    v_cache [N, P, Hk, Dv] or None, input_row_offsets int32 [B+1], cache_lengths int32 [B],
    lookup_table int32 [B, max_pages], k_scales/v_scales float32 [N, P, Hk, ceil(D/G)] or one
    per-tensor scale (shape [] or [1]) (FP8 only).

    Row `offsets[b] + i` goes to position `cache_lengths[b] + i` of sequence b. FP8 caches get the
    per-(token, head, group) quantization of `quantize_fp8` and its scales, or with a per-tensor
    scale `s` the codes `fp8(clamp(x / s))` and no scale written. A packed cache (`kv_format`,
    key [T, 1, 576], no value) gets the rows of `pack_mla_rows` (fp8_rope: `k_scales` is its scale).
    """
    _check_indices("paged_store", input_row_offsets, cache_lengths, lookup_table, k_cache)
    if packed_row(kv_format) is not None and (value is not None or v_cache is not None or v_scales is not None):
        raise ValueError(f"kv_format {kv_format!r} stores keys only: value, v_cache and v_scales must be None")
    if (value is None) != (v_cache is None):
        raise ValueError("value must be None if and only if v_cache is None")
    if is_fp8(k_cache.dtype) and k_scales is None:
        raise ValueError("k_scales is required for an FP8 k_cache")
    if v_cache is not None and is_fp8(v_cache.dtype) and v_scales is None:
        raise ValueError("v_scales is required for an FP8 v_cache")
    lengths = _to_list(cache_lengths)
    for b, (start, end) in enumerate(_row_spans(input_row_offsets)):
        _store_one(key[start:end], k_cache, k_scales, lookup_table[b], lengths[b], quant_group, kv_format)
        if v_cache is not None:
            _store_one(value[start:end], v_cache, v_scales, lookup_table[b], lengths[b], quant_group)


def paged_load(
    cache: torch.Tensor,
    scales: torch.Tensor | None,
    lookup_table: torch.Tensor,
    seq_lens: torch.Tensor,
    output_row_offsets: torch.Tensor,
    out: torch.Tensor,
    quant_group: int = 128,
    kv_format: str | None = None,
) -> None:
    """Gather tokens `[0, seq_lens[b])` of each row into `out[output_row_offsets[b] + t]` (in place).

    cache [N, P, Hk, D], scales float32 [N, P, Hk, ceil(D/G)] or None, lookup_table int32
    [B, max_pages], seq_lens int32 [B], output_row_offsets int32 [B] or [B+1] (only the first B
    entries are read), out [T_out, Hk, D]. FP8 entries are dequantized as `float(q) * s`; a packed
    cache (`kv_format`) gives its logical keys, out [T_out, 1, 576].
    """
    _check_indices("paged_load", output_row_offsets, seq_lens, lookup_table, cache, "seq_lens", "output_row_offsets",
                   "B or B+1")
    packed_row(kv_format)
    offsets = _to_list(output_row_offsets)
    rows = gather_rows(
        cache, scales, lookup_table, seq_lens, quant_group=quant_group, out_dtype=out.dtype, kv_format=kv_format
    )
    for b, row in enumerate(rows):
        out[offsets[b] : offsets[b] + row.shape[0]] = row


def flash_attn_paged(
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    quant_group: int = 128,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    kv_format: str | None = None,
) -> torch.Tensor:
    """Attention of ragged queries over paged K/V; returns `[T, Hq, Dv]` in q's dtype.

    q [T, Hq, D], input_row_offsets int32 [B+1], k_cache [N, P, Hk, D], v_cache [N, P, Hk, Dv],
    cache_lengths int32 [B] (tokens before this step; the step's own K/V are already stored),
    lookup_table int32 [B, max_pages], sinks float32 [Hq] or None.

    Query row `offsets[b] + i` sits at `p = cache_lengths[b] + i` and, when causal, sees key j iff
    `j <= p` (and `j >= p - window_left` when window_left >= 0). Scores are `scale * q.k`
    (scale defaults to 1/sqrt(D)), soft-capped as `softcap * tanh(s / softcap)` when softcap > 0.
    A sink logit `sinks[h]` adds `exp(sinks[h])` to head h's softmax denominator and no value.
    Everything is computed in `compute_dtype`. Rows seeing no key and padding rows give zeros.
    A packed cache (`kv_format`, v_cache None) is attended over its logical keys and values.
    """
    out, _ = flash_attn_paged_lse(
        q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal,
        k_scales, v_scales, quant_group, window_left, softcap, sinks, compute_dtype=compute_dtype,
        kv_format=kv_format,
    )
    return out


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor | None):
    """Probabilities and log-sum-exp of `scores [..., K]` (-inf: hidden), a sink logit `[...]` joining
    the denominator. Returns `(probs [..., K], lse [...])`; a row with no visible key and no sink has
    zero probabilities and lse -inf; with a sink its lse is the sink. A NaN score (or +inf: the sum
    becomes NaN) makes the whole row NaN, as in the kernels: it is never dropped to zeros."""
    row_max = scores.amax(dim=-1)
    if sink is not None:
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max.unsqueeze(-1))
    denom = weights.sum(dim=-1)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    seen = (denom > 0) | torch.isnan(denom)  # denom 0: no visible key; NaN: the row is NaN, not zeros
    probs = torch.where(seen.unsqueeze(-1), weights / denom.clamp_min(1e-300).unsqueeze(-1), torch.zeros_like(weights))
    return probs, row_max + torch.log(denom)


def _attend_visible(probs: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`probs @ values` ([Hq, n, keys] @ [Hq, keys, Dv]) where each query row sums only the keys it
    sees: a masked key's probability is 0, but 0 * NaN (or inf) in a non-finite value of a key another
    row sees would still poison the product, so such values are kept out row by row."""
    if bool(torch.isfinite(values).all()):
        return probs @ values
    out = probs.new_zeros(probs.shape[:2] + values.shape[-1:])
    for i in range(probs.shape[1]):
        keys = visible[i].nonzero().flatten()
        out[:, i] = (probs[:, i, keys].unsqueeze(1) @ values[:, keys]).squeeze(1)
    return out


def _softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def flash_attn_paged_lse(
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    quant_group: int = 128,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    kv_format: str | None = None,
):
    """`flash_attn_paged` that also returns `lse [T, Hq]` float32: the natural log of each row's
    softmax denominator (sink included), -inf where a row sees no key and has no sink, and on
    padding rows."""
    _check_indices("flash_attn_paged", input_row_offsets, cache_lengths, lookup_table, k_cache)
    if packed_row(kv_format) is not None:
        k_cache, v_cache = _logical_cache(k_cache, v_cache, k_scales, v_scales, kv_format, compute_dtype)
        k_scales = v_scales = None
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq ({num_q_heads}) must be a multiple of Hk ({num_kv_heads})")
    group_size = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    out = torch.zeros(
        (num_tokens, num_q_heads, v_cache.shape[-1]), dtype=compute_dtype, device=q.device
    )
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=compute_dtype, device=q.device)
    sink = None if sinks is None else sinks.to(compute_dtype).view(num_q_heads, 1)
    lengths = _to_list(cache_lengths)
    for b, (start, end) in enumerate(_row_spans(input_row_offsets)):
        num_new = end - start
        if num_new == 0:
            continue
        num_keys = lengths[b] + num_new
        keys = gather_rows(
            k_cache, k_scales, lookup_table[b : b + 1], [num_keys],
            quant_group=quant_group, out_dtype=compute_dtype,
        )[0]
        values = gather_rows(
            v_cache, v_scales, lookup_table[b : b + 1], [num_keys],
            quant_group=quant_group, out_dtype=compute_dtype,
        )[0]
        # [num_keys, Hk, D] -> [Hq, num_keys, D]
        keys = keys.repeat_interleave(group_size, dim=1).transpose(0, 1)
        values = values.repeat_interleave(group_size, dim=1).transpose(0, 1)
        query_pos = lengths[b] + torch.arange(num_new, device=q.device).unsqueeze(1)
        key_pos = torch.arange(num_keys, device=q.device).unsqueeze(0)
        visible = torch.ones((num_new, num_keys), dtype=torch.bool, device=q.device)
        if causal:
            visible &= key_pos <= query_pos
        if window_left >= 0:
            visible &= key_pos >= query_pos - window_left
        # Keys no query of the row can see (e.g. evicted by a sliding window) may hold garbage:
        # keep them out of the products entirely.
        never_visible = ~visible.any(dim=0)
        keys = keys.masked_fill(never_visible[None, :, None], 0)
        values = values.masked_fill(never_visible[None, :, None], 0)
        queries = q[start:end].to(compute_dtype).transpose(0, 1)  # [Hq, n, D]
        scores = _softcapped(scale * (queries @ keys.transpose(1, 2)), softcap)  # [Hq, n, num_keys]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs, row_lse = _softmax_with_sink(scores, None if sink is None else sink.expand(-1, num_new))
        out[start:end] = _attend_visible(probs, values, visible).transpose(0, 1)
        lse[start:end] = row_lse.transpose(0, 1)
    return out.to(q.dtype), lse.to(torch.float32)


def merge_attn_states(out_a, lse_a, out_b, lse_b, compute_dtype: torch.dtype = torch.float64):
    """Combine two partial attentions over disjoint key sets: `out [T, H, Dv]`, `lse [T, H]`.

    `lse = logaddexp(lse_a, lse_b)`, `out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b`; where both
    parts are -inf the result is `lse = -inf`, `out = 0`; a part with weight 0 never contributes (not even
    a NaN of its out). Returns `(out in out_a's dtype, lse float32)`.
    """
    la, lb = lse_a.to(compute_dtype), lse_b.to(compute_dtype)
    lse = torch.logaddexp(la, lb)
    empty = lse == float("-inf")
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    wa = torch.where(empty, torch.zeros_like(lse), torch.exp(la - safe)).unsqueeze(-1)
    wb = torch.where(empty, torch.zeros_like(lse), torch.exp(lb - safe)).unsqueeze(-1)
    # a part with weight 0 saw no key: its out is meaningless (maybe never written) and is left out
    part_a = torch.where(wa != 0, wa * out_a.to(compute_dtype), torch.zeros((), dtype=compute_dtype))
    part_b = torch.where(wb != 0, wb * out_b.to(compute_dtype), torch.zeros((), dtype=compute_dtype))
    return (part_a + part_b).to(out_a.dtype), lse.to(torch.float32)


def flash_attn_paged_sparse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    quant_group: int = 128,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    kv_format: str | None = None,
) -> torch.Tensor:
    """Attention of each query row over the tokens it lists: `q [T, Hq, D]`, `indices [T, Hk or 1, K]`
    int32, each entry an encoded token `page * P + slot` or -1 (no token). Query head h reads the list
    of KV head `h // (Hq // Hk)` (or the shared list). No mask besides the list; duplicates count as
    listed. A row with no token outputs zeros. Returns `[T, Hq, Dv]` in q's dtype. A packed cache
    (`kv_format`, v_cache None) is attended over its logical keys and values."""
    if kv_format is not None:
        k_cache, v_cache = _logical_cache(k_cache, v_cache, k_scales, v_scales, kv_format, compute_dtype)
        k_scales = v_scales = None
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads = k_cache.shape[:3]
    group_size = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    flat = indices.to(torch.int64)
    bad = (flat < -1) | (flat >= num_pages * page_size)
    if bool(bad.any()):
        raise ValueError(f"indices must be -1 or in [0, {num_pages * page_size}), got {int(flat[bad][0])}")
    out = torch.zeros((num_tokens, num_q_heads, v_cache.shape[-1]), dtype=compute_dtype, device=q.device)
    for t in range(num_tokens):
        for h in range(num_q_heads):
            kv = h // group_size
            listed = flat[t, kv if flat.shape[1] == num_kv_heads else 0]
            listed = listed[listed >= 0]
            if listed.numel() == 0:
                continue
            pages, slots = listed // page_size, listed % page_size
            keys = k_cache[pages, slots, kv].to(compute_dtype)
            values = v_cache[pages, slots, kv].to(compute_dtype)
            if is_fp8(k_cache.dtype):
                keys = dequantize_fp8(k_cache[pages, slots, kv], _scales_at(k_scales, pages, slots, kv), quant_group,
                                      compute_dtype)
            if is_fp8(v_cache.dtype):
                values = dequantize_fp8(v_cache[pages, slots, kv], _scales_at(v_scales, pages, slots, kv),
                                        quant_group, compute_dtype)
            scores = _softcapped(scale * (keys @ q[t, h].to(compute_dtype)), softcap)
            sink = None if sinks is None else sinks[h].to(compute_dtype)
            probs, _ = _softmax_with_sink(scores, sink)
            out[t, h] = probs @ values
    return out.to(q.dtype)
