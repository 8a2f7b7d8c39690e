"""Typed Python front of the torch ops in CONTRACT.md, plus their fake
(meta) kernels so the ops trace under torch.compile.

Shapes: B rows this step, T ragged token rows, Hq/Hk query/KV heads, D/Dv
key/value head size, N pages of P tokens, G channels per FP8 scale.

`kv_format` (CONTRACT v1.2, every op but merge_attn_states): None for a plain cache, or a packed
MLA row in a uint8 cache `[N, P, 1, row_bytes]` with no v_cache (pagedkv.kv_formats):
"fp8_ds_mla" (656-byte rows: e4m3 latent [0, 512), four float32 scales, one per 128 latent channels,
[512, 528), 64 bfloat16 rope [528, 656); no k_scales) or "fp8_rope" (640-byte rows: e4m3 latent,
64 bfloat16 rope; k_scales is the latent's one per-tensor scale). Logical key D = 576 =
concat(latent * scale, rope), logical value Dv = 512 = the dequantized latent.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _C  # noqa: F401  (loading the library registers torch.ops.pagedkv)
from .kv_formats import KEY_DIM, KV_FORMATS, LATENT_DIM, kv_format_row

_ops = torch.ops.pagedkv

__all__ = [
    "paged_store",
    "paged_load",
    "flash_attn_paged",
    "flash_attn_paged_lse",
    "merge_attn_states",
    "flash_attn_paged_sparse",
    "set_checks",
    "checks_enabled",
    "set_kernel_options",
    "kernel_options",
]


def paged_store(
    key: torch.Tensor,
    value: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    input_row_offsets: torch.Tensor,
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
    quant_group: int = 128,
    *,
    kv_format: Optional[str] = None,
) -> None:
    """Write this step's new K/V rows into their pages (in place).

    key [T, Hk, D], value [T, Hk, Dv] or None (K-only cache), float32/float16/bfloat16.
    k_cache [N, P, Hk, D], v_cache [N, P, Hk, Dv] or None: any strides with stride(-1) == 1.
    input_row_offsets int32 [B+1], cache_lengths int32 [B], lookup_table int32 [B, max_pages].
    Row offsets[b] + i goes to position cache_lengths[b] + i of sequence b. FP8 caches need
    float32 scales [N, P, Hk, ceil(D/G)]; each (token, head, group) gets scale amax / FP8_MAX.
    Or a per-tensor scale (one float32 element, shape [] or [1], finite and > 0): only read, the
    codes are fp8(clamp(x / s)). K and V choose independently.
    kv_format "fp8_ds_mla" / "fp8_rope": key [T, 1, 576], value and v_cache None, k_cache the packed
    uint8 rows; per 128 latent channels scale = amax / 448 written into the row (fp8_ds_mla) or the
    per-tensor k_scales only read (fp8_rope); the rope rounded to bfloat16.
    Bad input raises RuntimeError naming the argument, with nothing written.
    """
    _check_scalars("paged_store", quant_group=quant_group)
    kv_format_row(kv_format, "paged_store")
    _ops.paged_store(
        key, value, k_cache, v_cache, input_row_offsets, cache_lengths, lookup_table, k_scales, v_scales, quant_group,
        kv_format,
    )


def paged_load(
    cache: torch.Tensor,
    lookup_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scales: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    quant_group: int = 128,
    *,
    kv_format: Optional[str] = None,
) -> torch.Tensor:
    """Gather tokens [0, seq_lens[b]) of every row into a new [sum(seq_lens), Hk, D] tensor.

    cache [N, P, Hk, D]; lookup_table int32 [B, max_pages]; seq_lens int32 [B]. FP8 caches are
    dequantized with scales [N, P, Hk, ceil(D/G)] or one per-tensor scale ([] or [1]). out_dtype
    defaults to the cache dtype, or float32 for FP8 caches. Reads the total length on the host (a
    sync on CUDA); use torch.ops.pagedkv.paged_load with a preallocated out inside CUDA graphs.
    A packed cache (kv_format, uint8 rows [N, P, 1, 656 or 640]) gives the logical keys
    [sum(seq_lens), 1, 576] (float32 by default); fp8_rope's per-tensor scale is `scales`.
    """
    _check_scalars("paged_load", quant_group=quant_group)
    packed = kv_format_row(kv_format, "paged_load") is not None
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"paged_load: out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise ValueError(f"paged_load: out_dtype must be torch.float32, torch.float16 or torch.bfloat16 (None: the "
                         f"cache dtype, float32 for FP8 and packed caches), got {out_dtype}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise TypeError(f"paged_load: seq_lens must be a 1-D int32 tensor, got {_describe(seq_lens)}")
    if seq_lens.is_meta:  # torch's own error ("Cannot copy out of meta tensor") named nothing
        raise ValueError("paged_load: seq_lens must hold values (the output is sized from them), got a meta tensor; "
                         "torch.ops.pagedkv.paged_load takes a preallocated out")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        raise TypeError(f"paged_load: cache must be a 4-D [N, P, Hk, D] tensor, got {_describe(cache)}")
    if out_dtype is None:
        fp8 = cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        out_dtype = torch.float32 if fp8 or packed else cache.dtype
    # The output is sized from seq_lens, so they are validated before allocating (one host sync).
    offsets = torch.zeros(seq_lens.numel() + 1, dtype=torch.int64, device=seq_lens.device)
    torch.cumsum(seq_lens, 0, dtype=torch.int64, out=offsets[1:])
    if seq_lens.numel():
        low, high, total = torch.stack([seq_lens.min().long(), seq_lens.max().long(), offsets[-1]]).tolist()
    else:
        low = high = total = 0
    if low < 0:
        raise ValueError(f"paged_load: seq_lens must be >= 0, got {low}")
    if isinstance(lookup_table, torch.Tensor) and lookup_table.dim() == 2:
        capacity = lookup_table.size(1) * cache.size(1)
        if high > capacity:
            raise ValueError(
                f"paged_load: seq_lens must be <= {capacity} (lookup_table holds {lookup_table.size(1)} pages of "
                f"{cache.size(1)} tokens), got {high}"
            )
    if total > 2**31 - 1:
        raise ValueError(f"paged_load: sum(seq_lens) must fit int32 row offsets, got {total}")
    offsets = offsets.to(torch.int32)
    # An unknown kv_format gets the plain shape: the op rejects it, naming kv_format.
    out = torch.empty((total, cache.size(-2), KEY_DIM if packed else cache.size(-1)), dtype=out_dtype,
                      device=cache.device)
    _ops.paged_load(cache, scales, lookup_table, seq_lens, offsets, out, quant_group, kv_format)
    return out


def flash_attn_paged(
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
    quant_group: int = 128,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    *,
    kv_format: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of ragged queries over paged K/V (store first, then attend).

    q [T, Hq, D] float32/float16/bfloat16 -> [T, Hq, Dv] in q's dtype. Query row
    offsets[b] + i sits at position cache_lengths[b] + i; causal masking is bottom-right
    aligned, window_left >= 0 also hides keys before p - window_left, softcap > 0 applies
    softcap * tanh(s / softcap). sinks float32 [Hq] (attention sinks, e.g. gpt-oss): exp(sinks[h])
    joins head h's softmax denominator and adds no value. Queries that see no key and padding rows
    give zeros. With out= the result is written into a preallocated tensor. FP8 k_scales / v_scales:
    per token [N, P, Hk, ceil(D/G)] or one per-tensor scale ([] or [1]), each tensor its own choice.
    A packed MLA cache (kv_format "fp8_ds_mla" / "fp8_rope", v_cache None): q [T, Hq, 576] over the
    logical keys, output [T, Hq, 512]; scale defaults to 1/sqrt(576).
    """
    _check_scalars("flash_attn_paged", causal, scale=scale, quant_group=quant_group, window_left=window_left,
                   softcap=softcap)
    kv_format_row(kv_format, "flash_attn_paged")
    args = (q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal,
            k_scales, v_scales, quant_group, window_left, softcap, sinks, kv_format)
    if out is None:
        return _ops.flash_attn_paged(*args)
    _ops.flash_attn_paged.out(*args, out=out)
    return out


def flash_attn_paged_lse(
    q: torch.Tensor,
    input_row_offsets: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    cache_lengths: torch.Tensor,
    lookup_table: torch.Tensor,
    scale: Optional[float] = None,
    causal: bool = True,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
    quant_group: int = 128,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    *,
    kv_format: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_attn_paged` that also returns the log-sum-exp: `(out [T, Hq, Dv], lse [T, Hq] float32)`.

    lse is the natural log of each row's softmax denominator over the scaled, soft-capped scores it
    sees (the sink term included); -inf where a row sees no key and has no sink, and on padding rows.
    Two results over disjoint key sets combine exactly with `merge_attn_states`.
    """
    # named as the core names this op's errors
    _check_scalars("flash_attn_paged", causal, scale=scale, quant_group=quant_group, window_left=window_left,
                   softcap=softcap)
    kv_format_row(kv_format, "flash_attn_paged")
    return _ops.flash_attn_paged_lse(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale,
                                     causal, k_scales, v_scales, quant_group, window_left, softcap, sinks, kv_format)


def merge_attn_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets into the attention over their union.

    out_a/out_b [T, H, Dv] (same float dtype), lse_a/lse_b float32 [T, H] (as `flash_attn_paged_lse`
    returns them). Returns `(out, lse)` with `lse = logaddexp(lse_a, lse_b)` and
    `out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b`; a part whose lse is -inf saw no key and
    contributes nothing; both -inf give zeros and -inf.
    """
    return _ops.merge_attn_states(out_a, lse_a, out_b, lse_b)


def flash_attn_paged_sparse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    indices: torch.Tensor,
    scale: Optional[float] = None,
    k_scales: Optional[torch.Tensor] = None,
    v_scales: Optional[torch.Tensor] = None,
    quant_group: int = 128,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    *,
    kv_format: Optional[str] = None,
) -> torch.Tensor:
    """Sparse (top-k) attention over the paged cache: query row t attends only over the tokens it lists.

    q [T, Hq, D]; indices int32 [T, Hk, K] (one list per KV head) or [T, 1, K] (shared by all heads), each
    entry an encoded token `page * P + slot` or -1 (no token); duplicates count as listed; no causal mask
    or window. A row with no token outputs zeros. K-only (MLA) caches: pass `v_cache=k_cache[..., :Dv]`;
    packed MLA rows: v_cache None and kv_format (q [T, Hq, 576], output [T, Hq, 512]).
    Entries < -1 or >= N * P raise an index error (on CUDA when checks are on; skipped otherwise).
    Returns [T, Hq, Dv] in q's dtype.
    """
    _check_scalars("flash_attn_paged_sparse", scale=scale, quant_group=quant_group, softcap=softcap)
    kv_format_row(kv_format, "flash_attn_paged_sparse")
    return _ops.flash_attn_paged_sparse(q, k_cache, v_cache, indices, scale, k_scales, v_scales, quant_group,
                                        softcap, sinks, kv_format)


def set_checks(enabled: bool) -> None:
    """Check CUDA calls' index values on the host (same as PAGEDKV_CHECK=1). CPU always checks."""
    _C.set_checks(bool(enabled))


def checks_enabled() -> bool:
    return bool(_C.checks_enabled())


# Kernel options (the core's pkv_settings, csrc/core/pkv_settings.h): name -> its values by name (the
# int the core stores is the position; cuda_loader's start at -1), or bool / int.
# docs/install.md (Kernel options) lists them with their environment variables and defaults.
_KERNEL_OPTIONS = {
    "checks": bool,
    "cpu_decode": ("auto", "packed", "fma"),
    "cuda_loader": ("auto", "cp.async", "tma-pages", "tma-gather4"),
    "cuda_splits": int,
    "cuda_sparse_kernel": ("auto", "portable"),
    "cuda_fp8_store_rows": bool,
    "cuda_prefill_wgmma": bool,
}
_FIRST_CODE = {"cuda_loader": -1}


def kernel_options() -> dict:
    """The process-wide kernel options, by name (see `set_kernel_options`)."""
    raw = _C.kernel_settings()
    options = {}
    for name, kind in _KERNEL_OPTIONS.items():
        value = raw[name]
        options[name] = kind[value - _FIRST_CODE.get(name, 0)] if isinstance(kind, tuple) else kind(value)
    return options


def set_kernel_options(**options) -> dict:
    """Change process-wide kernel options; returns the previous values of all of them, so
    `set_kernel_options(**previous)` puts them back. A call made after this one uses the new values
    (kernels read them once per call). Unknown names and bad values raise ValueError, nothing changed.

    checks: check CUDA calls' index values on the host (a sync; CPU always checks). Initial value
        from PAGEDKV_CHECK=1.
    cpu_decode: "auto" (the fastest decode path an item fits), "packed" (the packed tiles for decode
        too), "fma" (the direct decode on float32 FMAs where the bf16 dot products would run).
    cuda_loader: "auto", "cp.async", "tma-pages" or "tma-gather4": the K/V loader forced on CUDA.
    cuda_splits: 0 (the plan's rule) or n >= 1 split-KV CTAs forced on CUDA. Initial value from
        PAGEDKV_CUDA_SPLITS=n.
    cuda_sparse_kernel: "auto" or "portable" (flash_attn_paged_sparse's portable kernel always).
    cuda_fp8_store_rows: opt-in, compiled and not yet run on a GPU: paged_store into FP8 caches with a
        warp per token row over all heads and the hardware conversion (csrc/cuda/README.md).
    cuda_prefill_wgmma: opt-in, compiled and not yet run on a GPU: prefill-like calls (many query rows
        per KV head) at head size 64 or 128 on Hopper's warpgroup MMA (sm_90a builds on cc 9.x devices;
        elsewhere the default kernel runs) (csrc/cuda/README.md). Initial value from
        PAGEDKV_CUDA_PREFILL_WGMMA=1.
    """
    previous = kernel_options()
    changes = {}
    for name, value in options.items():
        kind = _KERNEL_OPTIONS.get(name)
        if kind is None:
            raise ValueError(f"pagedkv: no kernel option named {name!r} (options: {', '.join(_KERNEL_OPTIONS)})")
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(f"pagedkv: {name} must be one of {', '.join(map(repr, kind))}, got {value!r}")
            changes[name] = kind.index(value) + _FIRST_CODE.get(name, 0)
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"pagedkv: {name} must be {'True or False' if kind is bool else 'an int'}, got {value!r}")
        else:
            changes[name] = int(value)
    _C.set_kernel_settings(changes)
    return previous


def _check_scalars(op, causal=True, **numbers) -> None:
    """Refuse the scalars torch's schema parser takes silently: Python's bool is an int (and a float
    there), so window_left=True meant a window of one key, softcap=True a cap of 1.0, scale=True a
    scale of 1; and it reads causal=None as False (non-causal attention, where the default is True)."""
    if causal not in (True, False):  # None too; numpy bools, 0 and 1 equal one of them
        raise TypeError(f"{op}: causal must be True or False, got {causal!r}")
    for name, value in numbers.items():
        if isinstance(value, bool):
            kind = "an int" if name in ("quant_group", "window_left") else "a float"
            raise TypeError(f"{op}: {name} must be {kind}, got {value!r}")


# What paged_load (and flash attention) write: the float dtypes of `out`.
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dim()}-D {str(x.dtype).replace('torch.', '')} tensor"
    return type(x).__name__


# ---- fake kernels: shapes and dtypes only, for torch.compile / meta tensors ----
#
# The dispatcher also sends a call that mixes meta tensors with real ones here (Meta outranks
# CPU), so the fakes check devices like the core does; otherwise such a call would silently
# write nothing.


def _same_device(op, reference_name, reference, **tensors):
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise RuntimeError(
                f"{op}: {name} must be on the same device as {reference_name} ({reference.device}), got {t.device}"
            )


@torch.library.register_fake("pagedkv::paged_store")
def _paged_store_fake(key, value, k_cache, v_cache, input_row_offsets, cache_lengths, lookup_table,
                      k_scales=None, v_scales=None, quant_group=128, kv_format=None):
    _same_device("paged_store", "k_cache", k_cache, key=key, value=value, v_cache=v_cache,
                 input_row_offsets=input_row_offsets, cache_lengths=cache_lengths, lookup_table=lookup_table,
                 k_scales=k_scales, v_scales=v_scales)
    return None


@torch.library.register_fake("pagedkv::_vllm_cpu_fp8_values")
def _vllm_cpu_fp8_values_fake(x, scale, fp8_dtype):
    # a meta scale with a CPU x lands here: without the check the caller got uninitialised CPU memory
    _same_device("_vllm_cpu_fp8_values", "x", x, scale=scale)
    return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)


@torch.library.register_fake("pagedkv::paged_load")
def _paged_load_fake(cache, scales, lookup_table, seq_lens, output_row_offsets, out, quant_group=128,
                     kv_format=None):
    _same_device("paged_load", "cache", cache, scales=scales, lookup_table=lookup_table, seq_lens=seq_lens,
                 output_row_offsets=output_row_offsets, out=out)
    return None


def _attn_fake_checks(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, k_scales, v_scales,
                      sinks, out=None):
    _same_device("flash_attn_paged", "k_cache", k_cache, q=q, input_row_offsets=input_row_offsets,
                 v_cache=v_cache, cache_lengths=cache_lengths, lookup_table=lookup_table, k_scales=k_scales,
                 v_scales=v_scales, sinks=sinks, out=out)


def _value_dim(op, v_cache, kv_format):
    """Dv of an attention output: the latent of a packed format, else v_cache's last dim."""
    if kv_format in KV_FORMATS:
        return LATENT_DIM
    if v_cache is None:
        raise RuntimeError(f"{op}: v_cache must be a tensor unless kv_format names a packed format, got None")
    return v_cache.size(-1)


@torch.library.register_fake("pagedkv::flash_attn_paged")
def _flash_attn_paged_fake(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale=None,
                           causal=True, k_scales=None, v_scales=None, quant_group=128, window_left=-1, softcap=0.0,
                           sinks=None, kv_format=None):
    _attn_fake_checks(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, k_scales, v_scales, sinks)
    return q.new_empty((q.size(0), q.size(1), _value_dim("flash_attn_paged", v_cache, kv_format)))


@torch.library.register_fake("pagedkv::flash_attn_paged.out")
def _flash_attn_paged_out_fake(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale=None,
                               causal=True, k_scales=None, v_scales=None, quant_group=128, window_left=-1,
                               softcap=0.0, sinks=None, kv_format=None, *, out):
    _attn_fake_checks(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, k_scales, v_scales, sinks,
                      out)
    return None


@torch.library.register_fake("pagedkv::flash_attn_paged_lse")
def _flash_attn_paged_lse_fake(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale=None,
                               causal=True, k_scales=None, v_scales=None, quant_group=128, window_left=-1,
                               softcap=0.0, sinks=None, kv_format=None):
    _attn_fake_checks(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, k_scales, v_scales, sinks)
    return (q.new_empty((q.size(0), q.size(1), _value_dim("flash_attn_paged_lse", v_cache, kv_format))),
            q.new_empty((q.size(0), q.size(1)), dtype=torch.float32))


@torch.library.register_fake("pagedkv::merge_attn_states")
def _merge_attn_states_fake(out_a, lse_a, out_b, lse_b):
    _same_device("merge_attn_states", "out_a", out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), lse_a.new_empty(
        (out_a.size(0), out_a.size(1)), dtype=torch.float32)


@torch.library.register_fake("pagedkv::flash_attn_paged_sparse")
def _flash_attn_paged_sparse_fake(q, k_cache, v_cache, indices, scale=None, k_scales=None, v_scales=None,
                                  quant_group=128, softcap=0.0, sinks=None, kv_format=None):
    _same_device("flash_attn_paged_sparse", "k_cache", k_cache, q=q, v_cache=v_cache, indices=indices,
                 k_scales=k_scales, v_scales=v_scales, sinks=sinks)
    return q.new_empty((q.size(0), q.size(1), _value_dim("flash_attn_paged_sparse", v_cache, kv_format)))
