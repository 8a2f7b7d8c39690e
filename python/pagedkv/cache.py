"""KV cache objects for the four layouts of CONTRACT.md, plus per-step batch metadata.

Each cache class is a thin holder of torch tensors. It hands per-layer strided views
`[N, P, Hk, D]` to the ops in `pagedkv.ops`; no data is copied between layouts.

| class                       | storage                                   | per-layer K view                 |
|-----------------------------|-------------------------------------------|----------------------------------|
| `PagedKVCacheCollection`    | blocks `[N, 2|1, L, P, Hk, D]`            | `blocks[:, 0, layer]`            |
| `PagedKVCacheFA3Fallback`   | blocks `[2|1, N, P, Hk, D]`, tables `[L, B, max_pages]` | `blocks[0]`        |
| `PagedKVCache`              | one `[N, P, Hk, D]` pool per K/V and layer | `k_pools[layer]`                |
| `ContinuousBatchingKVCache` | blocks `[slots, 2|1, L, max_len, Hk, D]`  | `blocks[:, 0, layer]` (P = max_len) |
| `PagedMLACache`             | one uint8 `[N, P, 1, 656|640]` pool per layer (packed MLA rows) | `k_pools[layer]` |

FP8 caches (float8_e4m3fn, float8_e5m2) carry float32 scales with the same leading shape and
`ceil(D / quant_group)` as the last dimension, or with `per_tensor_scales=True` one float32 scale per
layer and K/V (`tensor_scales [L, 2|1]`, ones until set, e.g. to calibrated `k_scale` / `v_scale`
values): the ops' per-tensor form (CONTRACT v1.2), which paged_store only reads. `PagedMLACache`
holds DeepSeek MLA keys in the packed rows of a `kv_format` (CONTRACT v1.2, pagedkv.kv_formats).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from . import host_alloc
from .argument_checks import check_host_readable
from .dtypes import FLOAT_DTYPES, FP8_DTYPES, is_fp8, is_per_tensor_scale, num_scale_groups
from .kv_formats import DS_MLA_GROUP, KEY_DIM, LATENT_DIM, packed_row

__all__ = [
    "CACHE_DTYPES",
    "KVCacheBatch",
    "PagedKVCacheCollection",
    "PagedKVCacheFA3Fallback",
    "PagedKVCache",
    "ContinuousBatchingKVCache",
    "PagedMLACache",
]

CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def _ops():
    # Imported lazily: the ops module loads the compiled extension.
    from . import ops

    return ops


def _check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_index(name: str, value, size: int, error: type[Exception] = ValueError) -> int:
    """value as an index in [0, size): an int (not a bool), never Python's negative indexing."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < size:
        raise error(f"{name} must be in [0, {size}), got {value}")
    return value


def _check_cache_dtype(dtype, name: str = "dtype") -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__}")
    if dtype not in CACHE_DTYPES:
        names = ", ".join(str(d) for d in CACHE_DTYPES)
        raise ValueError(f"{name} must be one of {names}, got {dtype}")
    return dtype


# Devices the ops have kernels for.
CACHE_DEVICE_TYPES = ("cpu", "cuda")


def _check_device(device) -> torch.device:
    """The cache's device as torch.device; an unknown, unsupported or absent device raises ValueError."""
    allowed = f"one of {', '.join(CACHE_DEVICE_TYPES)} (a torch.device, a string like 'cuda:0' or a CUDA index)"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be {allowed}, got {type(device).__name__}")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be {allowed}, got {device!r}") from None
    if resolved.type not in CACHE_DEVICE_TYPES:
        raise ValueError(f"device must be one of {', '.join(CACHE_DEVICE_TYPES)} (pagedkv has kernels for those), "
                         f"got {resolved}")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if resolved.index is None else resolved.index
        if index >= count:
            raise ValueError(f"device {resolved} is not available: this process sees {count} CUDA device(s)")
    return resolved


def _check_int32_tensor(name: str, value, ndim: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {value.dtype}")
    if value.dim() not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dims, got {value.dim()}")
    return value


_INT32_MAX = 2**31 - 1


class KVCacheBatch:
    """Per-step metadata: which rows are in the batch, how long they are, where their pages are.

    input_row_offsets int32 [B+1], cache_lengths int32 [B], lookup_table int32 [B, max_pages]
    (or [L, B, max_pages] for per-layer tables). Accessor names follow Modular MAX's KV cache
    types. Values are validated on construction (this reads the tensors on the host once).
    """

    def __init__(self, input_row_offsets, cache_lengths, lookup_table):
        _check_int32_tensor("input_row_offsets", input_row_offsets, (1,))
        _check_int32_tensor("cache_lengths", cache_lengths, (1,))
        _check_int32_tensor("lookup_table", lookup_table, (2, 3))
        batch_size = cache_lengths.shape[0]
        if input_row_offsets.shape[0] != batch_size + 1:
            raise ValueError(
                f"input_row_offsets must have B+1 = {batch_size + 1} entries "
                f"(B from cache_lengths), got {input_row_offsets.shape[0]}"
            )
        if lookup_table.shape[-2] != batch_size:
            raise ValueError(
                f"lookup_table must have B = {batch_size} rows, got {lookup_table.shape[-2]}"
            )
        devices = {t.device for t in (input_row_offsets, cache_lengths, lookup_table)}
        if len(devices) != 1:
            raise ValueError(
                "input_row_offsets, cache_lengths and lookup_table must be on one device, "
                f"got {sorted(str(d) for d in devices)}"
            )
        check_host_readable("KVCacheBatch", input_row_offsets=input_row_offsets, cache_lengths=cache_lengths,
                            lookup_table=lookup_table)
        offsets = [int(v) for v in input_row_offsets.cpu().tolist()]
        lengths = [int(v) for v in cache_lengths.cpu().tolist()]
        if offsets[0] != 0:
            raise ValueError(f"input_row_offsets[0] must be 0, got {offsets[0]}")
        for b in range(batch_size):
            if offsets[b + 1] < offsets[b]:
                raise ValueError(
                    f"input_row_offsets must be non-decreasing, got {offsets[b + 1]} after "
                    f"{offsets[b]} at index {b + 1}"
                )
            if lengths[b] < 0:
                raise ValueError(f"cache_lengths[{b}] must be >= 0, got {lengths[b]}")
            # seq_lens() is int32: a longer row would wrap to a negative length there.
            new_tokens = offsets[b + 1] - offsets[b]
            if lengths[b] + new_tokens > _INT32_MAX:
                raise ValueError(
                    f"cache_lengths[{b}] + new tokens must be <= {_INT32_MAX} (int32 seq_lens), "
                    f"got {lengths[b]} + {new_tokens}"
                )
        self.input_row_offsets = input_row_offsets
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self._offsets = offsets
        self._lengths = lengths

    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    @property
    def device(self) -> torch.device:
        return self.cache_lengths.device

    def _check_row(self, batch_idx) -> int:
        # Python's negative indexing would make num_new_tokens(-1) offsets[0] - offsets[-1] (minus
        # the total), silently; rows are numbered [0, B) only.
        return _check_index("batch_idx", batch_idx, self.batch_size, IndexError)

    def cache_length(self, batch_idx: int) -> int:
        """Tokens already cached for row `batch_idx` before this step."""
        return self._lengths[self._check_row(batch_idx)]

    def num_new_tokens(self, batch_idx: int) -> int:
        b = self._check_row(batch_idx)
        return self._offsets[b + 1] - self._offsets[b]

    def max_prompt_length(self) -> int:
        """Largest number of new tokens in one row (0 for an empty batch)."""
        return max((self.num_new_tokens(b) for b in range(self.batch_size)), default=0)

    def max_context_length(self) -> int:
        """Largest cache_length + new tokens over the rows (0 for an empty batch)."""
        return max(
            (self._lengths[b] + self.num_new_tokens(b) for b in range(self.batch_size)), default=0
        )

    def empty_cache(self) -> bool:
        """True when no row has cached tokens (a pure prefill step)."""
        return all(length == 0 for length in self._lengths)

    def total_tokens(self) -> int:
        """offsets[B]: ragged rows in use; rows past it are padding."""
        return self._offsets[-1]

    def seq_lens(self) -> torch.Tensor:
        """int32 [B]: cache_lengths + new tokens, the lengths after this step's store."""
        new = self.input_row_offsets[1:] - self.input_row_offsets[:-1]
        return (self.cache_lengths + new).to(torch.int32)

    def __repr__(self) -> str:
        return (
            f"KVCacheBatch(batch_size={self.batch_size}, cache_lengths={self._lengths}, "
            f"input_row_offsets={self._offsets})"
        )


class _PagedCacheBase:
    """Shared method bodies; subclasses provide the per-layer views and the per-layer table."""

    num_layers: int
    head_dim: int
    quant_group: int
    k_only: bool
    dtype: torch.dtype

    tensor_scales: torch.Tensor | None = None  # float32 [L, 2|1]: per-tensor scales of (layer, K/V)
    kv_format: str | None = None  # a packed row format (PagedMLACache), passed to every op

    def _init_geometry(self, num_layers, num_kv_heads, head_dim, dtype, k_only, quant_group, per_tensor_scales=False):
        self.num_layers = _check_positive_int("num_layers", num_layers)
        self.num_kv_heads = _check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = _check_positive_int("head_dim", head_dim)
        self.dtype = _check_cache_dtype(dtype)
        if not isinstance(k_only, bool):
            raise TypeError(f"k_only must be a bool, got {type(k_only).__name__}")
        self.k_only = k_only
        self.quant_group = _check_positive_int("quant_group", quant_group)
        self.num_kv = 1 if k_only else 2
        self.num_groups = num_scale_groups(head_dim, quant_group)
        if not isinstance(per_tensor_scales, bool):
            raise TypeError(f"per_tensor_scales must be a bool, got {type(per_tensor_scales).__name__}")
        if per_tensor_scales and not is_fp8(self.dtype):
            raise ValueError(f"per_tensor_scales needs an FP8 dtype, got {self.dtype}")
        self.per_tensor_scales = per_tensor_scales

    def _init_tensor_scales(self, device) -> None:
        if self.per_tensor_scales:
            self.tensor_scales = torch.ones((self.num_layers, self.num_kv), dtype=torch.float32, device=device)

    def _tensor_scale(self, layer: int, kv: int) -> torch.Tensor | None:
        """Layer `layer`'s per-tensor scale of K (kv 0) or V (1), a 0-D view; None without them."""
        return None if self.tensor_scales is None else self.tensor_scales[self._check_layer(layer), kv]

    def _check_layer(self, layer) -> int:
        return _check_index("layer", layer, self.num_layers)

    def _table(self, layer: int, lookup_table: torch.Tensor) -> torch.Tensor:
        return lookup_table

    # Views, overridden per layout.
    def k_cache(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def v_cache(self, layer: int) -> torch.Tensor | None:
        raise NotImplementedError

    def k_scales(self, layer: int) -> torch.Tensor | None:
        raise NotImplementedError

    def v_scales(self, layer: int) -> torch.Tensor | None:
        raise NotImplementedError

    def store(self, layer, key, value, input_row_offsets, cache_lengths, lookup_table) -> None:
        """Write key [T, Hk, D] / value [T, Hk, D] (None for K-only) of this step into `layer`."""
        self._check_layer(layer)
        if self.k_only and value is not None:
            raise ValueError("value must be None for a K-only cache")
        if not self.k_only and value is None:
            raise ValueError("value must be a tensor for a K/V cache (k_only=False)")
        _ops().paged_store(
            key,
            value,
            self.k_cache(layer),
            self.v_cache(layer),
            input_row_offsets,
            cache_lengths,
            self._table(layer, lookup_table),
            self.k_scales(layer),
            self.v_scales(layer),
            self.quant_group,
            kv_format=self.kv_format,
        )

    def _value_views(self, layer: int, v_head_dim: int | None):
        if not self.k_only:
            if v_head_dim not in (None, self.head_dim):
                raise ValueError("v_head_dim is only for K-only caches")
            return self.v_cache(layer), self.v_scales(layer)
        # K-only (MLA): V is the first v_head_dim channels of K.
        dv = self.head_dim if v_head_dim is None else v_head_dim
        if not 1 <= dv <= self.head_dim:
            raise ValueError(f"v_head_dim must be in [1, {self.head_dim}], got {dv}")
        k_scales = self.k_scales(layer)
        v_scales = None
        if is_per_tensor_scale(k_scales):
            v_scales = k_scales
        elif k_scales is not None:
            if dv != self.head_dim and dv % self.quant_group != 0:
                raise ValueError(
                    f"v_head_dim ({dv}) must be a multiple of quant_group ({self.quant_group}) "
                    "for an FP8 K-only cache"
                )
            v_scales = k_scales[..., : num_scale_groups(dv, self.quant_group)]
        return self.k_cache(layer)[..., :dv], v_scales

    def attention(
        self,
        layer,
        q,
        input_row_offsets,
        cache_lengths,
        lookup_table,
        *,
        scale=None,
        causal=True,
        window_left=-1,
        softcap=0.0,
        v_head_dim=None,
        sinks=None,
    ) -> torch.Tensor:
        """Attention of q [T, Hq, D] over `layer`; returns [T, Hq, Dv] in q's dtype.

        Call after `store` of this step's K/V. For K-only (MLA) caches V is the first
        `v_head_dim` (default D) channels of K. `sinks` float32 [Hq]: attention sinks.
        """
        self._check_layer(layer)
        v_cache, v_scales = self._value_views(layer, v_head_dim)
        return _ops().flash_attn_paged(
            q,
            input_row_offsets,
            self.k_cache(layer),
            v_cache,
            cache_lengths,
            self._table(layer, lookup_table),
            scale,
            causal,
            self.k_scales(layer),
            v_scales,
            self.quant_group,
            window_left,
            softcap,
            sinks,
            kv_format=self.kv_format,
        )

    def load(self, layer, lookup_table, seq_lens, *, which="k", out_dtype=None) -> torch.Tensor:
        """Gather tokens [0, seq_lens[b]) of every row: returns [sum(seq_lens), Hk, D].

        `which` is "k" or "v". `out_dtype` defaults to the cache dtype, float32 for FP8 caches.
        """
        self._check_layer(layer)
        if which == "k":
            cache, scales = self.k_cache(layer), self.k_scales(layer)
        elif which == "v":
            if self.k_only:
                raise ValueError("which='v' is not available for a K-only cache")
            cache, scales = self.v_cache(layer), self.v_scales(layer)
        else:
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")
        if out_dtype is None:
            out_dtype = torch.float32 if is_fp8(self.dtype) or self.kv_format is not None else self.dtype
        return _ops().paged_load(
            cache,
            self._table(layer, lookup_table),
            seq_lens,
            scales=scales,
            out_dtype=out_dtype,
            quant_group=self.quant_group,
            kv_format=self.kv_format,
        )


class _BlockCache(_PagedCacheBase):
    """A cache held in one `blocks` tensor (and, for FP8, one `scales` tensor of the same leading shape).

    The constructor is PagedKVCacheCollection's and PagedKVCacheFA3Fallback's; a subclass gives its
    layout as the blocks' leading dims (`_lead_dims`) and its per-layer views.
    """

    blocks: torch.Tensor
    scales: torch.Tensor | None

    def __init__(
        self,
        num_pages,
        num_layers,
        page_size,
        num_kv_heads,
        head_dim,
        *,
        dtype=torch.bfloat16,
        device="cpu",
        k_only=False,
        quant_group=128,
        per_tensor_scales=False,
    ):
        self.num_pages = _check_positive_int("num_pages", num_pages)
        self.page_size = _check_positive_int("page_size", page_size)
        self._init_geometry(num_layers, num_kv_heads, head_dim, dtype, k_only, quant_group, per_tensor_scales)
        self._init_blocks(device)

    def _lead_dims(self) -> tuple[int, ...]:
        """The blocks' dims before D."""
        raise NotImplementedError

    def _init_blocks(self, device) -> None:
        """`blocks` [*lead, D] and, for FP8, float32 `scales` [*lead, groups] (ones) on `device`, or the
        per-tensor `tensor_scales`; lead is the layout's `_lead_dims()`."""
        lead = self._lead_dims()
        device = _check_device(device)
        self.blocks = host_alloc.zeros((*lead, self.head_dim), dtype=self.dtype, device=device)
        self.scales = None
        self._init_tensor_scales(device)
        if is_fp8(self.dtype) and not self.per_tensor_scales:
            self.scales = torch.ones((*lead, self.num_groups), dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.blocks.device


class _LayerMajorBlocks(_BlockCache):
    """Blocks `[pages, 2|1, L, page_size, Hk, D]`: layer l's K view is `blocks[:, 0, l]`
    (PagedKVCacheCollection, and ContinuousBatchingKVCache with a slot per page)."""

    def _lead_dims(self):
        return (self.num_pages, self.num_kv, self.num_layers, self.page_size, self.num_kv_heads)

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the pages, page dim first (a page manager's copy-on-write copies)."""
        return (self.blocks,) + (() if self.scales is None else (self.scales,))

    def k_cache(self, layer):
        return self.blocks[:, 0, self._check_layer(layer)]

    def v_cache(self, layer):
        return None if self.k_only else self.blocks[:, 1, self._check_layer(layer)]

    def k_scales(self, layer):
        return self._tensor_scale(layer, 0) if self.scales is None else self.scales[:, 0, self._check_layer(layer)]

    def v_scales(self, layer):
        if self.k_only:
            return None
        return self._tensor_scale(layer, 1) if self.scales is None else self.scales[:, 1, self._check_layer(layer)]


class PagedKVCacheCollection(_LayerMajorBlocks):
    """All layers in one tensor: blocks `[N, 2|1, L, P, Hk, D]` (1 for K-only/MLA caches).

    Layer l's K view is `blocks[:, 0, l]` `[N, P, Hk, D]` with page stride `2*L*P*Hk*D`.
    """


class PagedKVCacheFA3Fallback(_BlockCache):
    """One page pool shared by all layers: blocks `[2|1, N, P, Hk, D]`.

    Each layer has its own page table; methods take either the per-layer table `[B, max_pages]`
    or the stacked tables `[L, B, max_pages]` (then `table[layer]` is used).
    """

    def _lead_dims(self):
        return (self.num_kv, self.num_pages, self.page_size, self.num_kv_heads)

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the pages, page dim first: the K and V planes of blocks (and scales), whose
        dim 0 is K/V, not the page."""
        return tuple(self.blocks) + (() if self.scales is None else tuple(self.scales))

    def _table(self, layer, lookup_table):
        if not isinstance(lookup_table, torch.Tensor):
            raise TypeError(
                f"lookup_table must be a torch.Tensor, got {type(lookup_table).__name__}"
            )
        if lookup_table.dim() == 3:
            if lookup_table.shape[0] != self.num_layers:
                raise ValueError(
                    f"lookup_table [L, B, max_pages] must have L = {self.num_layers}, "
                    f"got {lookup_table.shape[0]}"
                )
            return lookup_table[layer]
        return lookup_table

    def k_cache(self, layer):
        self._check_layer(layer)
        return self.blocks[0]

    def v_cache(self, layer):
        self._check_layer(layer)
        return None if self.k_only else self.blocks[1]

    def k_scales(self, layer):
        self._check_layer(layer)
        return self._tensor_scale(layer, 0) if self.scales is None else self.scales[0]

    def v_scales(self, layer):
        self._check_layer(layer)
        if self.k_only:
            return None
        return self._tensor_scale(layer, 1) if self.scales is None else self.scales[1]


class PagedKVCache(_PagedCacheBase):
    """Separate K and V pools `[N, P, Hk, D]` (the vLLM/FlashAttention layout), one per layer.

    One layer by default; `num_layers` gives a list of independent pools (like vLLM's per-layer
    `kv_caches`).
    """

    def __init__(
        self,
        num_pages,
        page_size,
        num_kv_heads,
        head_dim,
        *,
        dtype=torch.bfloat16,
        device="cpu",
        k_only=False,
        quant_group=128,
        num_layers=1,
        per_tensor_scales=False,
    ):
        self.num_pages = _check_positive_int("num_pages", num_pages)
        self.page_size = _check_positive_int("page_size", page_size)
        self._init_geometry(num_layers, num_kv_heads, head_dim, dtype, k_only, quant_group, per_tensor_scales)
        device = _check_device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        scale_shape = (*shape[:-1], self.num_groups)

        def pools(make, shape, dtype, count):
            return [make(shape, dtype=dtype, device=device) for _ in range(count)]

        self.k_pools = pools(host_alloc.zeros, shape, dtype, num_layers)
        self.v_pools = None if k_only else pools(host_alloc.zeros, shape, dtype, num_layers)
        self.k_scale_pools = self.v_scale_pools = None
        self._init_tensor_scales(device)
        if is_fp8(dtype) and not per_tensor_scales:
            self.k_scale_pools = pools(torch.ones, scale_shape, torch.float32, num_layers)
            if not k_only:
                self.v_scale_pools = pools(torch.ones, scale_shape, torch.float32, num_layers)

    @property
    def device(self) -> torch.device:
        return self.k_pools[0].device

    def page_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding the pages, page dim first: every layer's pools and scale pools."""
        pools = (self.k_pools, self.v_pools, self.k_scale_pools, self.v_scale_pools)
        return tuple(t for group in pools if group is not None for t in group)

    def k_cache(self, layer=0):
        return self.k_pools[self._check_layer(layer)]

    def v_cache(self, layer=0):
        return None if self.v_pools is None else self.v_pools[self._check_layer(layer)]

    def k_scales(self, layer=0):
        pools = self.k_scale_pools
        return self._tensor_scale(layer, 0) if pools is None else pools[self._check_layer(layer)]

    def v_scales(self, layer=0):
        pools = self.v_scale_pools
        if self.v_pools is None:
            return None
        return self._tensor_scale(layer, 1) if pools is None else pools[self._check_layer(layer)]


class ContinuousBatchingKVCache(_LayerMajorBlocks):
    """One contiguous slot per sequence: blocks `[slots, 2|1, L, max_len, Hk, D]`.

    Layer l's K view is `blocks[:, 0, l]` `[slots, max_len, Hk, D]`, i.e. a paged cache with
    `P = max_len`, and the lookup table is `[B, 1]` holding each row's slot
    (see `lookup_table(slots)`).
    """

    def __init__(
        self,
        num_slots,
        num_layers,
        max_seq_len,
        num_kv_heads,
        head_dim,
        *,
        dtype=torch.bfloat16,
        device="cpu",
        k_only=False,
        quant_group=128,
        per_tensor_scales=False,
    ):
        self.num_slots = _check_positive_int("num_slots", num_slots)
        self.max_seq_len = _check_positive_int("max_seq_len", max_seq_len)
        self.num_pages, self.page_size = self.num_slots, self.max_seq_len
        self._init_geometry(num_layers, num_kv_heads, head_dim, dtype, k_only, quant_group, per_tensor_scales)
        self._init_blocks(device)

    def lookup_table(self, slots) -> torch.Tensor:
        """int32 [B, 1] table for rows living in `slots` (a sequence of ints or a 1-D tensor)."""
        # Validated as given, before the int32 conversion, which would wrap an int64 slot of 2^32 + 1 to
        # 1, truncate 1.7 to 1 and take True as 1: silently another row's slot.
        if isinstance(slots, torch.Tensor):
            if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
                raise TypeError(f"slots must hold integers, got a {slots.dtype} tensor")
            check_host_readable("ContinuousBatchingKVCache.lookup_table", slots=slots)
            slots = slots.reshape(-1).tolist()
        elif not isinstance(slots, Sequence) or isinstance(slots, (str, bytes)):
            raise TypeError(f"slots must be a sequence of ints or a 1-D integer tensor, got {type(slots).__name__}")
        values = []
        for b, slot in enumerate(slots):
            if isinstance(slot, bool):
                raise TypeError(f"slots[{b}] must be an int, got bool")
            try:
                slot = operator.index(slot)
            except TypeError:
                raise TypeError(f"slots[{b}] must be an int, got {type(slot).__name__}") from None
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slots[{b}] must be in [0, {self.num_slots}), got {slot}")
            values.append(slot)
        return torch.tensor(values, dtype=torch.int32).reshape(-1, 1).to(self.device)


class PagedMLACache(PagedKVCache):
    """DeepSeek MLA keys in packed FP8 rows (CONTRACT v1.2 `kv_format`): separate pools as
    `PagedKVCache`, one uint8 K pool `[N, P, 1, row_bytes]` per layer and no V pools or per-token
    scales: 656-byte rows for "fp8_ds_mla" (scales inside the rows) or
    640-byte rows for "fp8_rope" with one float32 scale per layer (`tensor_scales [L, 1]`, ones until
    set, e.g. to a calibrated value; paged_store only reads it).

    `store` takes the logical key `[T, 1, 576]` (latent then rope) and no value; `attention` takes
    `q [T, Hq, 576]` and returns `[T, Hq, 512]` (V is the latent); `load` gives the logical keys.
    A page manager copies pages of every pool: `PageManager(num_pages, page_size, caches=cache.k_pools)`.
    """

    k_only = True
    num_kv = 1
    num_kv_heads = 1
    head_dim = KEY_DIM
    v_head_dim = LATENT_DIM
    quant_group = DS_MLA_GROUP
    dtype = torch.uint8

    def __init__(self, num_pages, page_size, *, kv_format="fp8_ds_mla", num_layers=1, device="cpu"):
        self.num_pages = _check_positive_int("num_pages", num_pages)
        self.page_size = _check_positive_int("page_size", page_size)
        self.num_layers = _check_positive_int("num_layers", num_layers)
        layout = packed_row(kv_format)
        if layout is None:
            raise ValueError("kv_format must be 'fp8_ds_mla' or 'fp8_rope', got None")
        self.kv_format = kv_format
        self.per_tensor_scales = layout.per_tensor_scale
        device = _check_device(device)
        shape = (num_pages, page_size, 1, layout.row_bytes)
        self.k_pools = [host_alloc.zeros(shape, dtype=torch.uint8, device=device) for _ in range(num_layers)]
        self.v_pools = self.k_scale_pools = self.v_scale_pools = None
        self._init_tensor_scales(device)

    def _value_views(self, layer, v_head_dim):
        if v_head_dim not in (None, LATENT_DIM):
            raise ValueError(f"v_head_dim of a {self.kv_format} cache is {LATENT_DIM}, got {v_head_dim}")
        return None, None
