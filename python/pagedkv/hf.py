"""pagedkv inside Hugging Face transformers: an attention implementation, a paged cache, and
continuous batching, for models loaded with ``from_pretrained`` (no model code to write)::

    import pagedkv.hf                                      # registers attn_implementation="pagedkv"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pagedkv")
    out = model.generate(**inputs, past_key_values=pagedkv.hf.PagedCache(model))

Four ways the attention implementation runs, told apart per call:

1. **paged** (``PagedCache``): K/V of every layer live in pagedkv pages (any float or FP8 dtype).
   ``PagedCache.update`` only hands the new K/V through; the attention call stores them with
   ``paged_store`` (padding tokens are not stored, so rows keep no holes) and attends with
   ``flash_attn_paged`` over the pages.
2. **ragged** (``generate_batch``): the same cache driven by pagedkv's continuous-batching server;
   the HF model runs one packed ``[1, T]`` forward per step over decode and prefill rows together.
3. **contiguous** (any other transformers cache, or none): the K/V tensors transformers hands over
   are read in place as pages (no copy) and attended with ``flash_attn_paged``.

The attention mask is transformers' 2-D padding mask (the mask function registered with the
implementation is the one flash attention uses), so rows may be padded on either side.
Beam search, assisted decoding and cache cropping need page copies this cache does not do yet;
``PagedCache`` refuses them with an error instead of returning wrong tokens.

4. **varlen** (transformers' own ``generate_batch``, 5.x): its scheduler and paged cache, whose
   per-step packed K/V (``cu_seq_lens_q/k``) are attended with ``flash_attn_paged``. Its manager
   only knows sdpa, paged|eager and flash, so ``register`` makes it leave "pagedkv" models as they
   are. ``pagedkv.hf.generate_batch`` is continuous batching on pagedkv's own page manager and
   cache instead (no gather of the K/V into a packed copy per layer and step).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import threading
import warnings
from collections.abc import Sequence

import torch

from . import ops
from .cache import PagedKVCacheCollection, _check_cache_dtype, _check_positive_int

__all__ = [
    "IMPLEMENTATION",
    "MIN_VERSION",
    "TESTED_VERSIONS",
    "PagedCache",
    "TransformersPagedModel",
    "attention_forward",
    "check_transformers_version",
    "generate_batch",
    "register",
    "transformers_continuous_batching_supported",
]

IMPLEMENTATION = "pagedkv"
# The hooks used here: AttentionInterface / AttentionMaskInterface (4.54+) and Cache made of
# per-layer objects (CacheLayerMixin, 4.56+); 4.57 is the oldest line tested.
MIN_VERSION = (4, 57)
# Release lines the test suite runs against (see tests/test_hf.py and README).
TESTED_VERSIONS = ("4.57.6", "5.24.0")

# Pages in a PagedCache grow by this factor when a step needs more (amortised copies).
POOL_GROWTH = 2


def _version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) from a version string: "5.24.0.dev0" -> (5, 24, 0), "4.57.0rc1" -> (4, 57, 0)."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def check_transformers_version(version: str | None = None) -> str:
    """The installed transformers version, or a RuntimeError naming it when it lacks the hooks."""
    try:
        import transformers
    except ImportError as error:
        raise RuntimeError(
            "pagedkv.hf needs transformers (pip install 'transformers>=4.57'); it is not installed"
        ) from error
    version = transformers.__version__ if version is None else version
    if _version_tuple(version) < MIN_VERSION:
        raise RuntimeError(
            f"pagedkv.hf needs transformers >= {'.'.join(map(str, MIN_VERSION))} (AttentionInterface, "
            f"AttentionMaskInterface and per-layer Cache objects); installed transformers {version}: "
            "pip install -U 'transformers>=4.57'"
        )
    hooks = {
        "modeling_utils": ("AttentionInterface",),
        "masking_utils": ("AttentionMaskInterface", "flash_attention_mask"),
        "cache_utils": ("Cache", "CacheLayerMixin"),
    }
    missing = []
    for module_name, names in hooks.items():
        try:
            module = importlib.import_module(f"transformers.{module_name}")
        except ImportError:
            missing.append(f"transformers.{module_name}")
            continue
        missing += [name for name in names if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"pagedkv.hf: transformers {version} lacks {', '.join(missing)}")
    return version


def register() -> None:
    """Register ``attn_implementation="pagedkv"`` (attention and mask functions). Idempotent."""
    check_transformers_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    _accept_in_transformers_continuous_batching()
    # The flash attention mask function gives None (no padding) or the 2-D [B, kv_len] padding
    # mask: exactly what the ragged layout below needs, and no [B, 1, q, kv] float mask is built.
    AttentionMaskInterface.register(IMPLEMENTATION, flash_attention_mask)


def transformers_continuous_batching_supported() -> bool:
    """Whether the installed transformers' own ``generate_batch`` runs "pagedkv" models (5.x, whose
    continuous-batching manager ``register`` adapts; 4.57's needs its own paged implementations)."""
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:
        return False
    switch = getattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)
    return bool(getattr(switch, "_pagedkv_accepts", False))


def _accept_in_transformers_continuous_batching() -> None:
    """Let transformers' own ``generate_batch`` run a model whose implementation is "pagedkv".

    Its manager (5.x) switches a model to an implementation it knows (sdpa, paged|eager, flash)
    or raises; for "pagedkv" models the switch is skipped and nothing else changes, so its
    scheduler and paged cache hand each step's packed varlen batch (cu_seq_lens_q/k, no mask)
    to ``attention_forward``. Models with any other implementation go through unchanged.
    """
    try:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    except ImportError:  # this transformers has no continuous batching of that shape
        return
    switch = getattr(ContinuousBatchingManager, "switch_to_cb_friendly_attn", None)
    if switch is None or getattr(switch, "_pagedkv_accepts", False):
        return

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if getattr(model.config, "_attn_implementation", None) == IMPLEMENTATION:
            return None
        return switch(self, model, *args, **kwargs)

    switch_to_cb_friendly_attn._pagedkv_accepts = True
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn


# --------------------------------------------------------------------------------------------
# Packing a padded [B, S] batch into pagedkv's ragged rows
# --------------------------------------------------------------------------------------------


class _Rows:
    """Which of the B*S positions of a padded batch are real tokens, as ragged rows.

    keep: bool [B, S] (None: all kept). flat: int64 indices of the kept positions in row-major
    order (None: all), counts: int32 [B] kept per row, offsets: int32 [B+1] (their cumsum).
    """

    def __init__(self, keep: torch.Tensor | None, batch: int, length: int, device: torch.device):
        self.batch, self.length = batch, length
        if keep is None:
            self.flat = None
            self.counts = torch.full((batch,), length, dtype=torch.int32, device=device)
        else:
            self.flat = keep.reshape(-1).nonzero().squeeze(1)
            self.counts = keep.sum(dim=1, dtype=torch.int32)
        self.offsets = torch.zeros(batch + 1, dtype=torch.int32, device=device)
        torch.cumsum(self.counts, 0, dtype=torch.int32, out=self.offsets[1:])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, S, D] (transformers' layout) -> [T, H, D] of the kept positions."""
        rows = x.transpose(1, 2).reshape(self.batch * self.length, x.size(1), x.size(3))
        return rows if self.flat is None else rows.index_select(0, self.flat)

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [B, S, H, D]; positions that were not kept get zeros."""
        if self.flat is None:
            return out.view(self.batch, self.length, out.size(1), out.size(2))
        full = out.new_zeros((self.batch * self.length, out.size(1), out.size(2)))
        full.index_copy_(0, self.flat, out)
        return full.view(self.batch, self.length, out.size(1), out.size(2))


def _padding_mask(attention_mask, batch: int, kv_length: int, device) -> torch.Tensor | None:
    """transformers' mask for this call as bool [B, kv_length] (True = real token), or None."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            f"pagedkv attention: attention_mask must be a 2-D [batch, kv_len] padding mask (what the mask function "
            f"registered for attn_implementation='pagedkv' builds), got {shape}; custom 4-D masks are not supported"
        )
    if attention_mask.size(0) != batch or attention_mask.size(1) < kv_length:
        raise ValueError(
            f"pagedkv attention: attention_mask must be [{batch}, >= {kv_length}], got {tuple(attention_mask.shape)}"
        )
    mask = attention_mask[:, -kv_length:].to(device=device, dtype=torch.bool)
    return None if bool(mask.all()) else mask


def _kernel_options(module, scaling, sliding_window, softcap, is_causal, dropout):
    if dropout and getattr(module, "training", False):
        raise ValueError("pagedkv attention is for inference: dropout must be 0 (call model.eval())")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    # transformers' masks keep key j for query i when i - j < sliding_window.
    window_left = -1 if not sliding_window else int(sliding_window) - 1
    return {
        "scale": None if scaling is None else float(scaling),
        "causal": causal,
        "window_left": window_left,
        "softcap": float(softcap) if softcap else 0.0,
    }


# --------------------------------------------------------------------------------------------
# The attention function registered as "pagedkv"
# --------------------------------------------------------------------------------------------

# update() of a PagedCache layer leaves the new K/V here; the attention call of the same layer
# (same thread, right after) finds them by identity. Anything else is contiguous K/V.
_pending = threading.local()


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Sq, D]
    key: torch.Tensor,  # [B, Hk, Sk, D]
    value: torch.Tensor,  # [B, Hk, Sk, Dv]
    attention_mask: torch.Tensor | None,  # None or bool [B, >= Sk]
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: returns ([B, Sq, Hq, Dv], None). Queries at padding
    positions get zeros (transformers never reads them). A keyword that would change the result
    and is not implemented (attention sinks, head masks, position biases, sparse indices, ...)
    raises NotImplementedError naming it; see ``_refuse_unsupported_keywords``."""
    sinks = _pop_sinks(kwargs, query.size(1))
    _refuse_unsupported_keywords(kwargs)
    options = _kernel_options(module, scaling, sliding_window, softcap, is_causal, dropout)
    if sinks is not None:
        options["sinks"] = sinks
    step = getattr(_pending, "step", None)
    if step is not None and step[0] is key:
        _pending.step = None
        layer = step[1]
        if attention_mask is None and layer.owner.ragged is None:  # ragged steps restart positions per row
            _refuse_packed_position_ids(kwargs.get("position_ids"), query.size(0))
        return layer.owner.attend(layer.layer_idx, query, key, value, attention_mask, options), None
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        return _attend_varlen(query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], options), None
    if attention_mask is None:
        _refuse_packed_position_ids(kwargs.get("position_ids"), query.size(0))
    return _attend_contiguous(query, key, value, attention_mask, options), None


# Keywords that transformers' attention calls pass (audited on 4.57.6 and 5.24.0: the model files'
# attention_interface(...) calls, what their **kwargs carry from generate, chunked prefill and
# continuous batching, and the keys of TransformersKwargs / FlashAttentionKwargs that a model's
# forward hands down to every layer) and that leave the attention output as pagedkv computes it:
# output switches of the model (hidden states, router logits), loss bookkeeping, bookkeeping of the
# cache or of the scheduler (the K/V handed over are already the ones to attend), lengths that
# cu_seq_lens_q/k already give, the sequence index of Mamba layers, and flash-attention options
# without a numerical effect. position_ids are read in the contiguous path (packed sequences, see
# _refuse_packed_position_ids).
_KEYWORDS_WITHOUT_EFFECT = frozenset({
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "use_cache",
    "cache_position", "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
    "seq_idx", "logits_indices", "logits_processor_args", "read_index", "write_index", "deterministic",
})
# Keywords that change the result, with the model feature they carry; pagedkv does not implement
# them, so a call that gives one (not None / False) is refused instead of silently dropping it.
_UNSUPPORTED_KEYWORDS = {
    "head_mask": "head masking (a per-head factor on the attention probabilities)",
    "position_bias": "an additive attention bias (e.g. T5-style relative position buckets)",
    "indices": "sparse attention over indexer-selected tokens (e.g. DeepSeek sparse attention)",
    "block_indices": "block-sparse attention over selected key blocks",
    "block_table": "transformers' paged attention reading K/V through its block table",
    "output_attentions": "returning the attention weights (use attn_implementation='eager' for them)",
}


# Attention sinks: gpt-oss passes its per-head sink logits as s_aux (other models as sinks); they join
# each head's softmax denominator, which is flash_attn_paged's `sinks`.
_SINK_KEYWORDS = ("s_aux", "sinks")


def _pop_sinks(kwargs: dict, num_q_heads: int):
    """Removes the sink keywords from kwargs; returns the sinks as float32 [Hq] (or None)."""
    given = {name: kwargs.pop(name) for name in _SINK_KEYWORDS if name in kwargs}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"pagedkv attention got attention sinks twice ({' and '.join(given)}); pass one")
    name, sinks = next(iter(given.items()))
    if not isinstance(sinks, torch.Tensor) or sinks.numel() != num_q_heads:
        raise ValueError(
            f"pagedkv attention: {name} (attention sinks) must be a tensor of one logit per query head "
            f"({num_q_heads}), got {tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}"
        )
    return sinks.detach().reshape(num_q_heads).to(torch.float32).contiguous()


def _refuse_unsupported_keywords(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name in _KEYWORDS_WITHOUT_EFFECT or value is None or value is False:
            continue
        feature = _UNSUPPORTED_KEYWORDS.get(name)
        if feature is not None:
            raise NotImplementedError(
                f"pagedkv attention does not implement {name}, which this model passes for {feature}; "
                "load it with another attn_implementation (e.g. 'eager' or 'sdpa')"
            )
        raise NotImplementedError(
            f"pagedkv attention got keyword {name}={type(value).__name__}, which it does not implement and "
            f"cannot tell to be without effect on the result; supported keywords: dropout, scaling, "
            f"sliding_window, softcap, is_causal, {', '.join(sorted(_KEYWORDS_WITHOUT_EFFECT))}"
        )


def _refuse_packed_position_ids(position_ids, batch: int) -> None:
    """Without a mask, flash attention (whose mask function "pagedkv" shares) reads position_ids
    that restart inside a batch-1 row as several packed sequences, each attending only to itself;
    the contiguous path would attend across them, so such a call is refused."""
    if not isinstance(position_ids, torch.Tensor) or batch != 1 or position_ids.dim() != 2:
        return
    if position_ids.size(-1) < 2:
        return
    consecutive = torch.arange(position_ids.size(-1), device=position_ids.device) + position_ids.min()
    if bool((position_ids != consecutive).any()):
        raise NotImplementedError(
            "pagedkv attention: position_ids restart within the row (packed sequences without an attention "
            "mask); pass cu_seq_lens_q/cu_seq_lens_k for packed sequences, or an attention_mask"
        )


def _attend_varlen(query, key, value, cu_seq_lens_q, cu_seq_lens_k, options) -> torch.Tensor:
    """Packed sequences (transformers' continuous batching, flash-style varlen calls): query
    [1, Hq, Tq, D], key/value [1, Hk, Tk, D]; sequence b owns queries cu_q[b]:cu_q[b+1], which are
    the last of its keys cu_k[b]:cu_k[b+1]. The keys are read in place as one-token pages."""
    if query.size(0) != 1 or key.size(0) != 1:
        raise ValueError(f"pagedkv attention: packed (cu_seq_lens) calls need batch 1, got {query.size(0)}")
    device = query.device
    cu_q = cu_seq_lens_q.to(device=device, dtype=torch.int32)
    cu_k = cu_seq_lens_k.to(device=device, dtype=torch.int64)
    key_counts = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    cache_lengths = key_counts - (cu_q[1:] - cu_q[:-1])
    k_cache, _ = _token_pages(key)
    v_cache, _ = _token_pages(value)
    width = max(int(key_counts.max()) if key_counts.numel() else 1, 1)
    positions = torch.arange(width, device=device, dtype=torch.int64)
    # Entries past a row's keys are never read; clamp them to a valid page anyway.
    lookup = (cu_k[:-1, None] + positions).clamp(max=max(key.size(2) - 1, 0)).to(torch.int32)
    out = ops.flash_attn_paged(query[0].transpose(0, 1), cu_q, k_cache, v_cache, cache_lengths, lookup, **options)
    return out.unsqueeze(0)


def _attend_contiguous(query, key, value, attention_mask, options) -> torch.Tensor:
    """Attention over K/V that transformers keeps itself: the tensors are read as pages in place."""
    batch, _, q_len, _ = query.shape
    kv_len = key.size(2)
    if q_len > kv_len:
        raise ValueError(f"pagedkv attention: more queries ({q_len}) than keys ({kv_len})")
    keep = _padding_mask(attention_mask, batch, kv_len, query.device)
    if keep is None:
        # Continuous-batching layout: row b is one page of kv_len tokens, [B, Sk, Hk, D] strided.
        k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)
        lookup = torch.arange(batch, dtype=torch.int32, device=query.device).unsqueeze(1)
        key_counts = torch.full((batch,), kv_len, dtype=torch.int32, device=query.device)
    else:
        # Pages of one token each, so that a row's kept keys (any padding) are listed in order.
        k_cache, row_distance = _token_pages(key)
        v_cache, v_row_distance = _token_pages(value)
        if v_row_distance != row_distance:  # differently strided K and V: one page table needs one layout
            k_cache, row_distance = _token_pages(key.contiguous())
            v_cache, _ = _token_pages(value.contiguous())
        columns = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices  # kept columns first
        key_counts = keep.sum(dim=1, dtype=torch.int32)
        rows = torch.arange(batch, device=query.device).unsqueeze(1) * row_distance
        lookup = (rows + columns[:, : max(int(key_counts.max()), 1)]).to(torch.int32)
    queries = _Rows(None if keep is None else keep[:, kv_len - q_len :], batch, q_len, query.device)
    cache_lengths = key_counts - queries.counts
    out = ops.flash_attn_paged(
        queries.pack(query), queries.offsets, k_cache, v_cache, cache_lengths, lookup, **options
    )
    return queries.unpack(out)


def _token_pages(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [B, H, S, D] as pages of one token [N, 1, H, D] over the same memory; returns the view and
    the page-id distance between rows (token (b, s) is page b * distance + s)."""
    batch, heads, length, dim = x.shape
    if x.stride(3) != 1 or x.stride(2) == 0 or x.stride(0) % x.stride(2) != 0:
        x = x.contiguous()
    token_stride = x.stride(2)
    distance = x.stride(0) // token_stride if batch > 1 else length
    # Every page's heads must lie inside x: page ids end at the last token of the last row.
    num_pages = (batch - 1) * distance + length
    view = x.as_strided((num_pages, 1, heads, dim), (token_stride, token_stride, x.stride(1), 1))
    return view, distance


# --------------------------------------------------------------------------------------------
# PagedCache: a transformers Cache whose K/V live in pagedkv pages
# --------------------------------------------------------------------------------------------


def _transformers_cache_classes():
    check_transformers_version()
    from transformers.cache_utils import Cache, CacheLayerMixin

    return Cache, CacheLayerMixin


def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return config


def _model_dims(config) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a decoder config; a config without them, or whose query
    heads are not a multiple of its KV heads, raises ValueError naming the field."""
    for name in ("num_hidden_layers", "num_attention_heads"):
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model config: {name} must be a positive int (a decoder-only transformers config), "
                             f"got {value!r} in {type(config).__name__}")
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv_heads != 0:
        raise ValueError(f"model config: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


class _Pool:
    """The pages of a PagedCache: a PagedKVCacheCollection plus each row's page list, growing
    by copying into a larger collection when a step needs more pages than are free."""

    def __init__(self, num_layers, num_kv_heads, head_dim, page_size, dtype, device, num_pages, quant_group):
        self.geometry = (num_layers, page_size, num_kv_heads, head_dim)
        self.options = {"dtype": dtype, "device": device, "quant_group": quant_group}
        self.collection = PagedKVCacheCollection(num_pages, *self.geometry, **self.options)
        self.row_pages: list[list[int]] = []
        self.next_free = 0
        self.lookup_table: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        return self.geometry[1]

    def reserve(self, row_lengths: Sequence[int]) -> torch.Tensor:
        """Pages for rows of the given lengths (tokens after this step); returns lookup_table."""
        page_size = self.page_size
        while len(self.row_pages) < len(row_lengths):
            self.row_pages.append([])
        wanted = [max(0, -(-length // page_size) - len(pages)) for length, pages in zip(row_lengths, self.row_pages)]
        if self.lookup_table is not None and not any(wanted):
            return self.lookup_table
        needed = self.next_free + sum(wanted)
        if needed > self.collection.num_pages:
            self._grow(max(needed, POOL_GROWTH * self.collection.num_pages))
        for pages, count in zip(self.row_pages, wanted):
            pages.extend(range(self.next_free, self.next_free + count))
            self.next_free += count
        width = max(1, max(len(p) for p in self.row_pages))
        table = torch.zeros((len(self.row_pages), width), dtype=torch.int32)
        for row, pages in enumerate(self.row_pages):
            table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.lookup_table = table.to(self.collection.device)
        return self.lookup_table

    def _grow(self, num_pages: int) -> None:
        old = self.collection
        new = PagedKVCacheCollection(num_pages, *self.geometry, **self.options)
        new.blocks[: old.num_pages].copy_(old.blocks)
        if old.scales is not None:
            new.scales[: old.num_pages].copy_(old.scales)
        self.collection = new


def _make_layer_class(CacheLayerMixin):
    class PagedLayer(CacheLayerMixin):
        """One decoder layer of a PagedCache. Keeps no tensors: the pages are the owner's."""

        is_compileable = False
        is_sliding = False
        is_croppable = False

        def __init__(self, owner, layer_idx: int):
            super().__init__()
            self.owner, self.layer_idx = owner, layer_idx
            self.seen = 0  # positions transformers has given this layer (padding included)
            self.lengths: torch.Tensor | None = None  # int32 [B]: tokens stored per row
            self.is_initialized = True

        def lazy_initialization(self, *args, **kwargs) -> None:
            return None

        def update(self, key_states, value_states, *args, **kwargs):
            # The attention call right after stores and attends; see attention_forward.
            left = getattr(_pending, "step", None)
            if left is not None and left[1].owner is self.owner and left[1].layer_idx < self.layer_idx:
                # An earlier layer of this forward never reached attention_forward: another
                # implementation would attend over this step's K/V alone, silently wrong.
                _pending.step = None
                raise RuntimeError(
                    f"pagedkv.hf.PagedCache: layer {left[1].layer_idx} did not attend with attn_implementation="
                    f"'{IMPLEMENTATION}'; a PagedCache works only with it (model.set_attn_implementation('pagedkv'))"
                )
            _pending.step = (key_states, self)
            return key_states, value_states

        def get_seq_length(self, *args) -> int:
            return self.seen

        def get_max_length(self) -> int:
            return -1

        def get_max_cache_shape(self) -> int:
            return -1

        def get_mask_sizes(self, query, *args) -> tuple[int, int]:
            # query: the query length (5.x) or the cache_position tensor (4.57)
            query_length = query if isinstance(query, int) else int(query.shape[0])
            return self.seen + query_length, 0

        def reset(self) -> None:
            self.seen, self.lengths = 0, None

        def _refuse(self, what: str):
            raise NotImplementedError(
                f"pagedkv.hf.PagedCache does not support {what} (beam search, assisted decoding and cache "
                "cropping need page copies); use greedy or sampled generate, or transformers' DynamicCache"
            )

        def reorder_cache(self, beam_idx) -> None:
            self._refuse("reorder_cache")

        def crop(self, max_length: int) -> None:
            self._refuse("crop")

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._refuse("batch_repeat_interleave")

        def batch_select_indices(self, indices) -> None:
            self._refuse("batch_select_indices")

    return PagedLayer


class _RaggedStep:
    """A continuous-batching step: ragged rows already laid out by the page manager."""

    def __init__(self, input_row_offsets, cache_lengths, lookup_table):
        self.input_row_offsets = input_row_offsets
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table


def PagedCache(
    model_or_config,
    *,
    page_size: int = 16,
    kv_dtype: torch.dtype | None = None,
    num_pages: int | None = None,
    quant_group: int = 128,
    collection: PagedKVCacheCollection | None = None,
):
    """A transformers ``Cache`` for ``model.generate`` whose K/V live in pagedkv pages.

    model_or_config: the model (or its config) the cache is for. page_size: tokens per page.
    kv_dtype: cache dtype (default: the model's dtype; float8_e4m3fn / float8_e5m2 quantize
    per token, head and ``quant_group`` channels). num_pages: initial pool (default: enough for
    the first step; the pool doubles when full). collection: use these pages instead (ragged mode).
    The model must use ``attn_implementation="pagedkv"``.
    """
    Cache, CacheLayerMixin = _transformers_cache_classes()
    cls = _paged_cache_class(Cache, CacheLayerMixin)
    return cls(model_or_config, page_size, kv_dtype, num_pages, quant_group, collection)


_CACHE_CLASSES: dict = {}


def _check_paged_cache_arguments(page_size, kv_dtype, num_pages, quant_group, collection, dims) -> None:
    """PagedCache's arguments, checked when it is made (not at the first forward): TypeError or
    ValueError naming the argument and what it may be."""
    _check_positive_int("page_size", page_size)
    if kv_dtype is not None:
        _check_cache_dtype(kv_dtype, "kv_dtype")
    if num_pages is not None:
        _check_positive_int("num_pages", num_pages)
    _check_positive_int("quant_group", quant_group)
    if collection is None:
        return
    if not isinstance(collection, PagedKVCacheCollection):
        raise TypeError(f"collection must be a pagedkv PagedKVCacheCollection or None, got {type(collection).__name__}")
    num_layers, num_kv_heads, head_dim = dims
    expected = {"page_size": page_size, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
                "head_dim": head_dim, "quant_group": quant_group}
    if kv_dtype is not None:
        expected["dtype"] = kv_dtype
    for name, value in expected.items():
        if getattr(collection, name) != value:
            raise ValueError(f"collection.{name} is {getattr(collection, name)}, but this PagedCache needs {value} "
                             f"({'the model' if name in ('num_layers', 'num_kv_heads', 'head_dim') else name})")
    if collection.k_only:
        raise ValueError("collection must hold K and V (k_only=False): transformers models attend over both")


def _paged_cache_class(Cache, CacheLayerMixin):
    if Cache in _CACHE_CLASSES:
        return _CACHE_CLASSES[Cache]
    PagedLayer = _make_layer_class(CacheLayerMixin)

    class PagedKVTransformersCache(Cache):
        """See ``pagedkv.hf.PagedCache``."""

        def __init__(self, model_or_config, page_size, kv_dtype, num_pages, quant_group, collection):
            config = _text_config(model_or_config)
            implementation = getattr(config, "_attn_implementation", None)
            if implementation not in (None, IMPLEMENTATION):
                raise ValueError(
                    f"PagedCache needs a model loaded with attn_implementation='{IMPLEMENTATION}', "
                    f"got '{implementation}'"
                )
            self.num_layers, self.num_kv_heads, self.head_dim = _model_dims(config)
            _check_paged_cache_arguments(page_size, kv_dtype, num_pages, quant_group, collection,
                                         (self.num_layers, self.num_kv_heads, self.head_dim))
            super().__init__(layers=[PagedLayer(self, i) for i in range(self.num_layers)])
            self.page_size, self.kv_dtype, self.quant_group = page_size, kv_dtype, quant_group
            self.initial_pages = num_pages
            self.pool: _Pool | None = None
            self.collection = collection
            self.ragged: _RaggedStep | None = None
            self._step_key = None
            self._step = None

        # -- bookkeeping shared by all layers of one forward ------------------------------

        @property
        def kv_collection(self) -> PagedKVCacheCollection | None:
            """The pagedkv collection holding the pages (None before the first step)."""
            return self.collection if self.pool is None else self.pool.collection

        def _ensure_pool(self, key: torch.Tensor, rows: int, tokens: int) -> _Pool:
            if self.pool is None:
                dtype = self.kv_dtype or key.dtype
                pages = self.initial_pages or max(1, rows * -(-tokens // self.page_size))
                self.pool = _Pool(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, dtype,
                                  key.device, pages, self.quant_group)
            return self.pool

        def _batch_step(self, layer, key, attention_mask):
            """Rows of this forward for `layer`: what is stored where. Computed once per forward
            (the first layer to arrive) and shared by the others."""
            batch, _, q_len, _ = key.shape
            step_key = (layer.seen, q_len, batch, attention_mask.data_ptr() if attention_mask is not None else 0)
            if self._step_key == step_key and self._step is not None:
                return self._step
            keep = _padding_mask(attention_mask, batch, layer.seen + q_len, key.device)
            new = _Rows(None if keep is None else keep[:, -q_len:], batch, q_len, key.device)
            stored_before = layer.lengths if layer.lengths is not None else torch.zeros_like(new.counts)
            pool = self._ensure_pool(key, batch, layer.seen + q_len)
            lookup = pool.reserve((stored_before + new.counts).tolist())
            self._step_key, self._step = step_key, (new, stored_before, lookup)
            return self._step

        def attend(self, layer_idx, query, key, value, attention_mask, options) -> torch.Tensor:
            layer = self.layers[layer_idx]
            if self.ragged is not None:
                return self._attend_ragged(layer_idx, query, key, value, options)
            if query.size(2) != key.size(2):
                raise ValueError("PagedCache: query and key lengths differ for this step")
            new, stored_before, lookup = self._batch_step(layer, key, attention_mask)
            collection = self.pool.collection
            collection.store(layer_idx, new.pack(key), new.pack(value), new.offsets, stored_before, lookup)
            out = collection.attention(layer_idx, new.pack(query), new.offsets, stored_before, lookup, **options)
            layer.lengths = stored_before + new.counts
            layer.seen += key.size(2)
            return new.unpack(out)

        def _attend_ragged(self, layer_idx, query, key, value, options) -> torch.Tensor:
            # query [1, Hq, T, D], key/value [1, Hk, T, D]: the packed rows of this step
            step, collection = self.ragged, self.collection
            q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
            collection.store(layer_idx, k, v, step.input_row_offsets, step.cache_lengths, step.lookup_table)
            out = collection.attention(layer_idx, q, step.input_row_offsets, step.cache_lengths,
                                       step.lookup_table, **options)
            return out.unsqueeze(0)

        # -- transformers' Cache API that a paged cache answers differently ----------------

        @property
        def is_compileable(self) -> bool:
            return False

        @property
        def max_batch_size(self) -> int:
            return -1

        @property
        def max_cache_len(self) -> int:
            return -1

        def get_max_cache_shape(self, layer_idx: int = 0) -> int:
            return -1

    _CACHE_CLASSES[Cache] = PagedKVTransformersCache
    return PagedKVTransformersCache


# --------------------------------------------------------------------------------------------
# Continuous batching: pagedkv's server over a transformers model
# --------------------------------------------------------------------------------------------


def _cache_argument(model) -> str:
    """The name this transformers version's forward takes the cache under."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class TransformersPagedModel:
    """A transformers causal LM behind the model interface of ``pagedkv.demo``'s server:
    ``model(tokens, positions, input_row_offsets, cache_lengths, lookup_table) -> logits [B, V]``.

    Each call is one packed forward (``input_ids [1, T]``) whose attention layers store into and
    read from ``kv_cache`` (a ``PagedKVCacheCollection``) with the given page table.
    """

    def __init__(self, model, kv_cache: PagedKVCacheCollection):
        config = _text_config(model)
        if getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
            raise ValueError(
                f"TransformersPagedModel needs attn_implementation='{IMPLEMENTATION}', "
                f"got '{getattr(config, '_attn_implementation', None)}' (load the model with it or call "
                f"model.set_attn_implementation('{IMPLEMENTATION}'))"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.cache = PagedCache(model, page_size=kv_cache.page_size, collection=kv_cache)
        self.cache_argument = _cache_argument(model)

    @torch.inference_mode()
    def __call__(self, tokens, positions, input_row_offsets, cache_lengths, lookup_table) -> torch.Tensor:
        num_rows = cache_lengths.shape[0]
        last_rows = input_row_offsets[1 : num_rows + 1].long() - 1  # [B]
        self.cache.ragged = _RaggedStep(input_row_offsets, cache_lengths, lookup_table)
        try:
            output = self.model(
                input_ids=tokens.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=True,
                logits_to_keep=last_rows,
                **{self.cache_argument: self.cache},
            )
        finally:
            self.cache.ragged = None
        return output.logits[0].float()  # [B, vocab]


def generate_batch(
    model,
    inputs: Sequence[Sequence[int]],
    max_new_tokens: int | None = None,
    *,
    generation_config=None,
    eos_token_id: int | Sequence[int] | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    kv_dtype: torch.dtype | None = None,
    max_prefill_tokens: int = 512,
    max_running: int = 16,
    progress: bool = False,
) -> list[list[int]]:
    """Greedy continuous batching of ``inputs`` (token id lists) with a transformers model on
    pagedkv's page manager, cache and kernels; returns the generated ids of each input (ending
    with the EOS token when one stopped it).

    max_new_tokens / eos_token_id default to ``generation_config`` (a transformers
    GenerationConfig, as for transformers' own ``generate_batch``), then to the model's
    ``generation_config``, then to 32 / none (``eos_token_id=[]``: never stop early). Sampling is
    not supported (``do_sample`` must be False).

    Requests are admitted while their prefill fits ``max_prefill_tokens`` and pages are free;
    decode and prefill rows share each forward; a request that runs out of pages is preempted
    and recomputed later; full pages of a shared prompt prefix are computed once.
    """
    from .demo import ContinuousBatchingServer, ProgressBar, Request, page_manager_for

    if not inputs:
        return []
    for source in (generation_config, getattr(model, "generation_config", None)):
        if source is None:
            continue
        if source is generation_config and getattr(source, "do_sample", False):
            raise ValueError("generate_batch: generation_config.do_sample must be False (greedy decoding only)")
        if max_new_tokens is None:
            max_new_tokens = getattr(source, "max_new_tokens", None)
        if eos_token_id is None:
            eos_token_id = getattr(source, "eos_token_id", None)
    max_new_tokens = 32 if max_new_tokens is None else max_new_tokens
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    prompts = [[int(t) for t in ids] for ids in inputs]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"inputs[{i}] is empty: every request needs at least one prompt token")
    config = _text_config(model)
    num_layers, num_kv_heads, head_dim = _model_dims(config)
    stop_ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    longest = max(len(p) for p in prompts) + max_new_tokens
    if num_pages is None:
        num_pages = min(len(prompts), max_running) * math.ceil(longest / page_size) + 1
    device = next(model.parameters()).device
    dtype = kv_dtype or next(model.parameters()).dtype
    collection = PagedKVCacheCollection(num_pages, num_layers, page_size, num_kv_heads, head_dim,
                                        dtype=dtype, device=device)
    manager = page_manager_for(collection)
    server = ContinuousBatchingServer(TransformersPagedModel(model, collection), manager, stop_ids, device,
                                      max_prefill_tokens=max_prefill_tokens, max_running=max_running)
    requests = [Request(request_id=i, arrival_step=0, message="", prompt=p, max_new_tokens=max_new_tokens)
                for i, p in enumerate(prompts)]
    for request in requests:
        server.submit(request)
    bar = ProgressBar(len(requests), enabled=progress)
    while server.has_work():
        server.step()
        bar.update(len(server.finished), len(requests), f"running {len(server.running)}")
    bar.close()
    return [r.generated for r in requests]


def _warn_if_untested(version: str) -> None:
    newest = max(_version_tuple(v) for v in TESTED_VERSIONS)
    if _version_tuple(version)[:2] > newest[:2]:
        warnings.warn(
            f"pagedkv.hf was tested with transformers {', '.join(TESTED_VERSIONS)}; installed {version}",
            stacklevel=3,
        )


_warn_if_untested(check_transformers_version())
register()
