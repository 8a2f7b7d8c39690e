"""The attention function registered with transformers as attn_implementation="pagedkv".

Each call is told apart (see ``pagedkv.hf``): K/V a ``PagedCache`` layer just handed over (paged or
ragged: its owner stores and attends), packed varlen sequences (``cu_seq_lens_q/k``), or K/V that
transformers keeps itself (contiguous, read in place as pages).
"""

from __future__ import annotations

import threading

import torch

from .. import ops
from .compat import (
    CAUSAL_FROM_MODULE,
    IMPLEMENTATION,
    WINDOW_FROM_CONFIG,
    _refuse_unsupported_keywords,
    check_transformers_version,
)
from .mask import PaddingMask, refuse_foreign_mask, refuse_keys_past_mask
from .mask import attention_mask as padding_mask_function


def register() -> None:
    """Register ``attn_implementation="pagedkv"`` (attention and mask functions). Idempotent."""
    check_transformers_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    _accept_in_transformers_continuous_batching()
    _refuse_architectures_without_attention_interface()
    AttentionMaskInterface.register(IMPLEMENTATION, padding_mask_function)


def _refuse_architectures_without_attention_interface() -> None:
    """Makes "pagedkv" fail at model construction (and at set_attn_implementation), naming the
    architecture, for models whose class says it does not call attention through transformers'
    AttentionInterface (``_supports_attention_backend = False``: falcon, stablelm, bert, Mamba
    hybrids, ...; such a model either looks the name up in its own table, a bare KeyError:
    'pagedkv', or silently runs another attention). Other implementations go through unchanged.
    Models that do call the attention interface but cannot be served (their code reads the
    attention mask as the 4-D eager mask) are refused by what they do, at their first forward
    (``pagedkv.hf.mask``)."""
    from transformers import PreTrainedModel

    check = PreTrainedModel.get_correct_attn_implementation
    if getattr(check, "_pagedkv_refuses", False):
        return

    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        if requested_attention == IMPLEMENTATION:
            message = refused_architecture_message(type(self))
            if message is not None:
                raise ValueError(message)
        return check(self, requested_attention, *args, **kwargs)

    get_correct_attn_implementation._pagedkv_refuses = True
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def refused_architecture_message(model_class) -> str | None:
    """Why attn_implementation="pagedkv" cannot run model_class, known when it is built, or None:
    the class says it does not call the attention interface."""
    if not model_class._supports_attention_backend:
        return unsupported_architecture_message(model_class)
    return None


def unsupported_architecture_message(model_class) -> str:
    model_type = getattr(getattr(model_class, "config_class", None), "model_type", "?")
    return (
        f"attn_implementation='{IMPLEMENTATION}' cannot run {model_class.__name__} (model_type '{model_type}'): "
        "its attention does not go through transformers' AttentionInterface (the class sets "
        "_supports_attention_backend = False), so pagedkv would not be called; load it with "
        "attn_implementation='eager' or 'sdpa'"
    )


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
    if type(module).__name__ in CAUSAL_FROM_MODULE:  # see compat.CAUSAL_FROM_MODULE
        causal = bool(getattr(module, "is_causal", True)) and not getattr(module, "is_cross_attention", False)
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

# The default of attention_forward's sliding_window: told apart from an explicit None (a layer
# without a window), see _window_not_passed.
_NOT_PASSED = object()


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Sq, D]
    key: torch.Tensor,  # [B, Hk, Sk, D]
    value: torch.Tensor,  # [B, Hk, Sk, Dv]
    attention_mask: PaddingMask | torch.Tensor | None,  # the mask function's, or None or bool [B, >= Sk]
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = _NOT_PASSED,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: returns ([B, Sq, Hq, Dv], None). Queries at padding
    positions get zeros (transformers never reads them). A keyword that would change the result
    and is not implemented (attention sinks, head masks, position biases, sparse indices, ...)
    raises NotImplementedError naming it; see ``_refuse_unsupported_keywords``. A mask that the
    "pagedkv" mask function did not build (a model's own 4-D eager mask) raises
    UnsupportedModelError naming the model (see ``pagedkv.hf.mask``)."""
    # The K/V a PagedCache layer's update just handed over (taken first, so a refused call leaves
    # nothing pending for the next one).
    step = getattr(_pending, "step", None)
    _pending.step = None
    # The keys this call attends: the given ones, after those a PagedCache layer holds already.
    keys = key.size(2)
    if step is not None and step[0] is key and step[2] is value:
        keys += step[1].seen
    attention_mask, written = _mask_of_call(attention_mask, keys, module)
    sinks = _pop_sinks(kwargs, query.size(1))
    if sliding_window is _NOT_PASSED:
        sliding_window = _window_not_passed(module)
    _refuse_unsupported_keywords(kwargs)
    options = _kernel_options(module, scaling, sliding_window, softcap, is_causal, dropout)
    if sinks is not None:
        options["sinks"] = sinks
    if step is not None:
        key_cached, layer, value_cached = step
        if key_cached is key and value_cached is value:
            if attention_mask is None and layer.owner.ragged is None:  # ragged steps restart positions per row
                _refuse_packed_position_ids(kwargs.get("position_ids"), query.size(0))
            return layer.owner.attend(layer.layer_idx, query, key, value, attention_mask, options), None
        # The layer's attention reads other K/V than it cached (MLA latents expanded to K/V,
        # DiffLlama's V halves side by side): its PagedCache keeps what it caches as storage from
        # now on (see start_gathering); this first step attends over the K/V as they come.
        layer.owner.start_gathering(layer, key_cached, value_cached)
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        return _attend_varlen(query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], options), None
    if attention_mask is None:
        _refuse_packed_position_ids(kwargs.get("position_ids"), query.size(0))
    key, value = _written_keys_only(key, value, written)
    return _attend_contiguous(query, key, value, attention_mask, options), None


def _window_not_passed(module):
    """The sliding window of a layer whose model passes no sliding_window keyword: the module's
    own `sliding_window` attribute (Qwen2-MoE in 5.x keeps it there), or config.sliding_window for
    the classes in compat.WINDOW_FROM_CONFIG (Phi-MoE in 5.x: only its mask function windows).
    Anything else has no window (what eager does with such a layer's causal mask)."""
    window = getattr(module, "sliding_window", None)
    if window is None and type(module).__name__ in WINDOW_FROM_CONFIG:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return window


def _mask_of_call(attention_mask, keys: int, module):
    """(the padding mask as bool [B, n] or None, the keys written n or None) of an attention call's
    mask: a PaddingMask of the "pagedkv" mask function, None, or a 2-D tensor (a caller's own
    padding mask). Any other mask, and more keys than a PaddingMask was built for, are refused
    (pagedkv.hf.mask)."""
    if isinstance(attention_mask, PaddingMask):
        if keys > attention_mask.keys:
            refuse_keys_past_mask(attention_mask, keys, module)
        return attention_mask.keep, attention_mask.width
    if attention_mask is None:
        return None, None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        return attention_mask, attention_mask.size(1)
    refuse_foreign_mask(attention_mask, module)


def _written_keys_only(key, value, written):
    """K/V of a cache that preallocates (StaticCache: [B, Hk, max_cache_len, D], tokens written
    from row 0 on) cut to the rows written so far, which the mask's width gives (see
    ``mask.attention_mask``; None: every key). Any other K/V are returned as they are."""
    if written is None or written >= key.size(2):
        return key, value
    return key[:, :, :written], value[:, :, :written]


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
