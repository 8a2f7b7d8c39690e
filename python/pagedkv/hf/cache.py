"""PagedCache: a transformers ``Cache`` whose K/V live in pagedkv pages (a
``PagedKVCacheCollection`` that grows when a step needs more pages)."""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence

import torch

from ..cache import PagedKVCacheCollection, _check_cache_dtype, _check_positive_int
from .attention import _padding_mask, _pending, _Rows
from .compat import IMPLEMENTATION, PAGED_CACHE_REFUSED, check_transformers_version, refusal
from .pool import _LayerPages, _Pool


# pagedkv.hf needs transformers: its import says what is missing (check_transformers_version) before
# the classes below subclass transformers' Cache and CacheLayerMixin.
check_transformers_version()
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402


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


class PagedLayer(CacheLayerMixin):
    """One decoder layer of a PagedCache. Keeps no tensors: the pages are the owner's."""

    is_compileable = False
    is_sliding = False
    is_croppable = True  # PagedCache.crop; assisted decoding asks the layers

    def __init__(self, owner, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.seen = 0  # positions transformers has given this layer (padding included)
        self.lengths: torch.Tensor | None = None  # int32 [B]: tokens stored per row
        # True when the layer's attention does not read what it caches (DeepSeek's MLA in
        # transformers 5.x caches latents and expands them to K/V after update): then update
        # stores every position and returns the layer's whole history read back from its pages.
        self.gathers = False
        self.is_initialized = True

    def lazy_initialization(self, *args, **kwargs) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        if self.gathers:  # see PagedCache.start_gathering
            return self.owner.store_and_gather(self, key_states, value_states)
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
        _pending.step = (key_states, self, value_states)
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
        self.owner._roll_back_step()
        self.seen, self.lengths, self.gathers = 0, None, False
        self.owner._kept = None
        # the next forward may be a batch of another size: the rows' page lists go (their pages stay
        # allocated and are handed out again), or the old row count would stay in the lookup table
        if self.owner.pool is not None:
            self.owner.pool.forget_rows()

    # All layers share the rows' page lists, so rows are reordered and cut for the whole
    # cache at once (PagedCache.reorder_cache, crop, ...), never one layer alone.
    def _whole_cache_only(self, what: str):
        raise NotImplementedError(
            f"pagedkv.hf.PagedCache: the layers share their rows' pages; call {what} on the PagedCache "
            f"(it does every layer), not on layer {self.layer_idx} alone"
        )

    def reorder_cache(self, beam_idx) -> None:
        self._whole_cache_only("reorder_cache")

    def crop(self, *args) -> None:
        self._whole_cache_only("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._whole_cache_only("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self._whole_cache_only("batch_select_indices")


class _ForwardStep:
    """A forward of a PagedCache in progress: what it started from, and each layer's new state."""

    def __init__(self, cache):
        self.pool_state = None if cache.pool is None else cache.pool.snapshot()
        self.gathers = [layer.gathers for layer in cache.layers]
        self.last_layer = -1  # the highest layer index that joined
        # (positions, query length, batch, mask address) -> (new rows, stored before, lookup table,
        # padding mask): see PagedCache._batch_step
        self.rows: dict = {}
        self.updates: dict[int, tuple] = {}  # layer index -> (positions seen, stored lengths) once it stored


class _RaggedStep:
    """A continuous-batching step: ragged rows already laid out by the page manager."""

    def __init__(self, input_row_offsets, cache_lengths, lookup_table):
        self.input_row_offsets = input_row_offsets
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table




def _crop_argument(Cache) -> str:
    """The name of Cache.crop's argument, which says how transformers reads it: "tokens_to_remove"
    (5.x: minus the positions to remove) or "max_length" (4.57: positions to keep, or minus those
    to remove)."""
    parameters = list(inspect.signature(Cache.crop).parameters)
    return parameters[1] if len(parameters) > 1 else "max_length"




def _integer_argument(name: str, value) -> int:
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _positions_to_remove(name: str, value, held: int) -> int:
    """How many positions crop(value) removes from a cache holding `held`; name: transformers'
    name for the argument (see _crop_argument)."""
    value = _integer_argument(name, value)
    if name == "tokens_to_remove":
        if value > 0:
            raise ValueError(f"PagedCache.crop: {name} must be <= 0 (minus the number of positions to remove), "
                             f"got {value}")
        removed = -value
    else:
        removed = -value if value < 0 else max(0, held - value)
    if removed > held:
        raise ValueError(f"PagedCache.crop: {name}={value} removes {removed} positions, but the cache holds {held}")
    return removed


def _row_indices(name: str, value, rows: int) -> list[int]:
    """value (a 1-D integer tensor or a sequence of ints; a bool tensor of one entry per row) as a
    list of row numbers in [0, rows); rows 0 (an empty cache) checks only the type."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one entry per row), got shape {tuple(value.shape)}")
        if value.dtype == torch.bool:
            if rows and value.numel() != rows:
                raise ValueError(f"{name}: a bool mask needs one entry per row ({rows}), got {value.numel()}")
            value = value.nonzero().squeeze(1)
        elif value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must hold integers, got {value.dtype}")
        indices = value.tolist()
    elif isinstance(value, Sequence) and not isinstance(value, str):
        indices = [_integer_argument(f"{name}[{i}]", v) for i, v in enumerate(value)]
    else:
        raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got {type(value).__name__}")
    if rows and not indices:
        raise ValueError(f"{name} selects no row; the cache holds {rows}")
    for i, index in enumerate(indices):
        if rows and not 0 <= index < rows:
            raise ValueError(f"{name}[{i}] is {index}, not a row of the cache (rows 0..{rows - 1})")
    return indices


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


# Layer kinds of config.layer_types whose cache layer holds K/V (the rest hold recurrent or
# convolution states, which a PagedCache layer does not keep).
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def _refuse_layers_without_attention(config) -> None:
    """Hybrid models (Mamba, linear attention, short convolutions: LFM2, MiniMax, Zamba, ...) keep
    per-layer states a PagedCache does not hold: refused when the cache is made."""
    kinds = set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES
    if kinds:
        raise ValueError(
            f"PagedCache cannot hold {type(config).__name__}: its layer_types include {', '.join(sorted(kinds))}, "
            "layers whose cache is a recurrent or convolution state, not pages of K/V; use transformers' own "
            "cache with attn_implementation='pagedkv'"
        )


def _refuse_unservable_models(model_or_config) -> None:
    """Models whose layers a PagedCache cannot hold (compat.PAGED_CACHE_REFUSED: mllama's
    cross-attention layers, ...; and any config listing cross_attention_layers): refused when the
    cache is made, with the reason, instead of failing or differing inside the model."""
    config = getattr(model_or_config, "config", model_or_config)
    configs = [config, _text_config(config)]
    for candidate in configs:
        model_type = getattr(candidate, "model_type", None)
        reason = refusal(PAGED_CACHE_REFUSED, model_type)
        if reason is None and getattr(candidate, "cross_attention_layers", None):
            reason = "its cross-attention layers (cross_attention_layers) read keys and values a PagedCache does not hold"
        if reason is None and _shares_kv_across_layers(candidate):
            reason = ("its last layers reuse the keys and values another layer's cache update returned "
                      "(num_kv_shared_layers / kv_sharing_modes), which are that layer's whole history with "
                      "transformers' caches but only the new positions with a PagedCache")
        if reason is not None:
            raise ValueError(
                f"PagedCache cannot serve {type(config).__name__} (model_type '{getattr(config, 'model_type', '?')}'): "
                f"{reason}; use transformers' own cache (the default, or cache_implementation='static') with "
                f"attn_implementation='{IMPLEMENTATION}'"
            )


def _shares_kv_across_layers(config) -> bool:
    """Whether some layers attend over another layer's K/V instead of caching their own (Gemma3n,
    Gemma4 and Mistral-Large-4 with shared KV layers): they read what that layer's update returned."""
    if getattr(config, "num_kv_shared_layers", None):
        return True
    try:
        modes = getattr(config, "kv_sharing_modes", None) or ()
    except ValueError:  # the property checks the config's layer types; the model refuses such a config itself
        return False
    # "store" alone (a Gemma4 without shared layers) only hands the K/V to an assistant model
    return any(isinstance(mode, str) and mode.startswith("reuse") for mode in modes)


def _refuse_different_kv_widths(config) -> None:
    """A PagedKVCacheCollection (continuous batching) holds K and V of one width; MLA layers
    (kv_lora_rank in the config: DeepSeek-V2/V3 and their kind) store other widths."""
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(
            f"PagedCache(collection=...) / generate_batch: {type(config).__name__} has multi-head latent "
            "attention (kv_lora_rank), whose layers store K and V of other widths than one PagedKVCacheCollection "
            "holds; use model.generate with PagedCache(model) (no collection), which sizes each layer's pages"
        )


# The way Cache.crop reads its argument on the installed transformers line.
_CROP_ARGUMENT = _crop_argument(Cache)


class PagedCache(Cache):
    """A transformers ``Cache`` for ``model.generate`` whose K/V live in pagedkv pages.

    model_or_config: the model (or its config) the cache is for. page_size: tokens per page.
    kv_dtype: cache dtype (default: the model's dtype; float8_e4m3fn / float8_e5m2 quantize
    per token, head and ``quant_group`` channels). num_pages: initial pool (default: enough for
    the first step; the pool doubles when full). collection: use these pages instead (ragged mode).
    The model must use ``attn_implementation="pagedkv"``. Beam search and assisted decoding work:
    rows share pages (``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``) and
    ``crop`` releases the pages past the rows' new ends (see ``_Pool``).
    """

    def __init__(
        self,
        model_or_config,
        *,
        page_size: int = 16,
        kv_dtype: torch.dtype | None = None,
        num_pages: int | None = None,
        quant_group: int = 128,
        collection: PagedKVCacheCollection | None = None,
    ):
        check_transformers_version()
        _refuse_unservable_models(model_or_config)
        config = _text_config(model_or_config)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in (None, IMPLEMENTATION):
            raise ValueError(
                f"PagedCache needs a model loaded with attn_implementation='{IMPLEMENTATION}', "
                f"got '{implementation}'"
            )
        # The layer count comes from the config; each layer's pages are sized at its first
        # store from the K/V it stores (heads, K and V widths), see _Pool.layer.
        self.num_layers, num_kv_heads, head_dim = _model_dims(config)
        _check_paged_cache_arguments(page_size, kv_dtype, num_pages, quant_group, collection,
                                     (self.num_layers, num_kv_heads, head_dim))
        _refuse_layers_without_attention(config)
        if collection is not None:
            _refuse_different_kv_widths(config)
        super().__init__(layers=[PagedLayer(self, i) for i in range(self.num_layers)])
        self.page_size, self.kv_dtype, self.quant_group = page_size, kv_dtype, quant_group
        self.initial_pages = num_pages
        self.pool: _Pool | None = None
        self.collection = collection
        self.ragged: _RaggedStep | None = None
        # The forward in progress: stored in some layers, committed once every layer has stored
        # (see _begin_layer); None between forwards.
        self._step: _ForwardStep | None = None
        # bool [B, positions so far]: which positions of each row are tokens (stored), None when
        # all are; from the last forward's padding mask, see _batch_step and crop
        self._kept: torch.Tensor | None = None

    # -- bookkeeping shared by all layers of one forward ------------------------------

    @property
    def kv_collection(self) -> PagedKVCacheCollection | None:
        """The collection given as ``collection`` (continuous batching), else None."""
        return self.collection

    # The lookups below answer for the committed state: a forward in progress (or one that
    # raised in a later layer) has reserved pages and rows that no stored length covers yet.

    @property
    def num_pages(self) -> int:
        """Pages per layer now (0 before the first step); the pool grows when a step needs more."""
        if self.collection is not None:
            return self.collection.num_pages
        committed = self._committed_pool()
        return 0 if committed is None else committed[0]

    def layer_pages(self, layer_idx: int) -> _LayerPages:
        """Layer layer_idx's pages: .k [N, P, Hk, Dk], .v [N, P, Hk, Dv], .k_scales / .v_scales
        (FP8), with page ids from ``lookup_table``; KeyError before the layer's first store.
        While a forward is in progress the tensors may hold more pages than ``num_pages``."""
        committed = self._committed_pool()
        if committed is None or layer_idx not in committed[1]:
            raise KeyError(layer_idx)
        return self.pool.layers[layer_idx]

    @property
    def lookup_table(self) -> torch.Tensor | None:
        """int32 [B, pages]: the page ids of each row (None before the first step)."""
        committed = self._committed_pool()
        return None if committed is None else committed[-1]

    def _committed_pool(self) -> tuple | None:
        """(num_pages, layer indices, lookup_table) of the pool as the last completed forward left
        it; None when there was no pool then."""
        if self._step is not None:
            state = self._step.pool_state
            return None if state is None else (state[0], state[1], state[-1])
        return None if self.pool is None else (self.pool.num_pages, self.pool.layers, self.pool.lookup_table)

    def _ensure_pool(self, key: torch.Tensor, rows: int, tokens: int) -> _Pool:
        if self.pool is None:
            dtype = self.kv_dtype or key.dtype
            pages = self.initial_pages or max(1, rows * -(-tokens // self.page_size))
            self.pool = _Pool(self.page_size, dtype, key.device, pages, self.quant_group)
        return self.pool

    # -- a forward is one step: every layer stores, or none does -----------------------
    # Layers store one after the other, and model code between them may raise (paged_store
    # refusing keys that require grad in a later layer, a refusal from attention, an
    # interrupt). So a layer's new lengths and positions wait in the step until the last
    # layer has stored and attended; public methods and the next forward see the committed
    # state, and a step left behind is rolled back (its reservations and copies undone).

    def _begin_layer(self, layer_idx: int) -> _ForwardStep:
        """The step layer layer_idx joins. Layers run in order within a forward, so a layer at or
        below one that already joined starts a new forward: the pending step never reached its
        last layer and is rolled back first."""
        step = self._step
        if step is not None and layer_idx <= step.last_layer:
            self._roll_back_step()
            step = None
        if step is None:
            step = self._step = _ForwardStep(self)
        step.last_layer = layer_idx
        return step

    def _end_layer(self, step: _ForwardStep, layer, seen: int, lengths: torch.Tensor | None) -> None:
        """Layer `layer` stored and attended in `step`; the last layer to do so commits the step."""
        step.updates[layer.layer_idx] = (seen, lengths)
        if len(step.updates) < len(self.layers):
            return
        for other in self.layers:
            other.seen, other.lengths = step.updates[other.layer_idx]
        if step.rows:
            # The mask covers every position so far: crop reads which positions were tokens.
            self._kept = next(iter(step.rows.values()))[3]
        self._step = None

    def _roll_back_step(self) -> None:
        """Undoes the pending step, if any: the pool back to its snapshot (or to no pool), each
        layer's gathering mode as it was. Lengths, positions and the padding mask were not changed."""
        step, self._step = self._step, None
        if step is None:
            return
        if step.pool_state is None:
            self.pool = None
        else:
            self.pool.restore(step.pool_state)
        for layer, gathers in zip(self.layers, step.gathers):
            layer.gathers = gathers

    @staticmethod
    def _check_batch(layer, batch: int, held: int) -> None:
        """Checked before the pool reserves anything: reserving for another batch grew the rows' page
        table, after which even forwards of the held batch failed in paged_store."""
        if batch != held:
            raise ValueError(
                f"PagedCache: this forward has batch {batch}, but layer {layer.layer_idx} holds {held} rows; a "
                "PagedCache continues the batch it holds (call reset() first for a new batch)"
            )

    def _batch_step(self, step, layer, key, attention_mask):
        """Rows of this forward for `layer`: what is stored where. Computed once per forward and
        mask (the first layer to arrive with it) and shared by the others."""
        batch, _, q_len, _ = key.shape
        if layer.lengths is not None:
            self._check_batch(layer, batch, layer.lengths.size(0))
        rows_key = (layer.seen, q_len, batch, attention_mask.data_ptr() if attention_mask is not None else 0)
        rows = step.rows.get(rows_key)
        if rows is not None:
            return rows
        keep = _padding_mask(attention_mask, batch, layer.seen + q_len, key.device)
        new = _Rows(None if keep is None else keep[:, -q_len:], batch, q_len, key.device)
        stored_before = layer.lengths if layer.lengths is not None else torch.zeros_like(new.counts)
        pool = self._ensure_pool(key, batch, layer.seen + q_len)
        before, after = torch.stack((stored_before, stored_before + new.counts)).tolist()  # one device read
        lookup = pool.reserve(after, before)
        rows = step.rows[rows_key] = (new, stored_before, lookup, keep)
        return rows

    def attend(self, layer_idx, query, key, value, attention_mask, options) -> torch.Tensor:
        layer = self.layers[layer_idx]
        if self.ragged is not None:
            return self._attend_ragged(layer_idx, query, key, value, options)
        step = self._begin_layer(layer_idx)
        if query.size(2) != key.size(2):
            raise ValueError("PagedCache: query and key lengths differ for this step")
        new, stored_before, lookup, keep = self._batch_step(step, layer, key, attention_mask)
        pages = self.pool.layer(layer_idx, key.transpose(1, 2), value.transpose(1, 2))
        pages.store(new.pack(key), new.pack(value), new.offsets, stored_before, lookup)
        out = pages.attend(new.pack(query), new.offsets, stored_before, lookup, options)
        self._end_layer(step, layer, layer.seen + key.size(2), stored_before + new.counts)
        return new.unpack(out)

    def start_gathering(self, layer, key, value) -> None:
        """Called when the attention of `layer` got other K/V than its update() was given (the
        model transformed what it caches, as DeepSeek's MLA in transformers 5.x expands cached
        latents): from now on the layer stores every position and hands back its whole history
        (see PagedLayer.gathers). Only a layer's first step can switch: later, this step's
        attention would have missed the history."""
        if self.ragged is not None or layer.seen or layer.lengths is not None:
            where = "in continuous batching" if self.ragged is not None else f"after {layer.seen} positions"
            raise RuntimeError(
                f"pagedkv.hf.PagedCache: layer {layer.layer_idx} attends over other K/V than it caches {where}; "
                "a PagedCache can serve such a layer only from its first step in model.generate"
            )
        layer.gathers = True
        self.store_and_gather(layer, key, value)

    def store_and_gather(self, layer, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores key [B, H, S, Dk] / value [B, H, S, Dv] at positions seen.. of every row
        (padding included: the model masks it) and returns each row's whole history."""
        batch, heads, new_len, _ = key.shape
        step = self._begin_layer(layer.layer_idx)
        if layer.seen:
            self._check_batch(layer, batch, 0 if self.pool is None else len(self.pool.row_pages))
        length = layer.seen + new_len
        pool = self._ensure_pool(key, batch, length)
        lookup = pool.reserve([length] * batch, [layer.seen] * batch)
        pages = pool.layer(layer.layer_idx, key.transpose(1, 2), value.transpose(1, 2))
        rows = _Rows(None, batch, new_len, key.device)
        before = torch.full((batch,), layer.seen, dtype=torch.int32, device=key.device)
        pages.store(rows.pack(key), rows.pack(value), rows.offsets, before, lookup)
        k, v = pages.gather(lookup, before + new_len, key.dtype)
        self._end_layer(step, layer, length, layer.lengths)
        return (k.view(batch, length, heads, -1).transpose(1, 2),
                v.view(batch, length, heads, -1).transpose(1, 2))

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

    # -- rows reordered or cut between forwards: beam search, assisted decoding ----------
    # Every argument is checked before anything changes: a refused call leaves the cache as it was.
    # Each first rolls back a forward that raised before its last layer (see _begin_layer).

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row i continues the history of old row beam_idx[i]. The rows' page lists
        are copied, not the pages (a row copies a shared page only before writing into it)."""
        self._refuse_in_continuous_batching("reorder_cache")
        self._roll_back_step()
        rows = self._held_rows()
        sources = _row_indices("beam_idx", beam_idx, rows)
        if rows and len(sources) != rows:
            raise ValueError(f"PagedCache.reorder_cache: beam_idx has {len(sources)} entries, but the cache "
                             f"holds {rows} rows (one entry per row)")
        if rows:
            self._select_rows(sources)

    def batch_select_indices(self, indices) -> None:
        """Keeps the rows `indices` (in that order; a row may come more than once)."""
        self._refuse_in_continuous_batching("batch_select_indices")
        self._roll_back_step()
        rows = self._held_rows()
        sources = _row_indices("indices", indices, rows)
        if rows:
            self._select_rows(sources)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times in a row (row b becomes rows b*repeats .. b*repeats+repeats-1)."""
        self._refuse_in_continuous_batching("batch_repeat_interleave")
        self._roll_back_step()
        _check_positive_int("repeats", repeats)
        rows = self._held_rows()
        if rows:
            self._select_rows([row for row in range(rows) for _ in range(repeats)])

    def crop(self, length: int) -> None:
        """Drops the last positions of every row, as transformers' DynamicCache.crop of the installed
        line reads its argument: 5.x crop(tokens_to_remove) removes -tokens_to_remove positions (<= 0);
        4.57 crop(max_length) keeps max_length positions, or removes -max_length when negative.
        Pages past a row's new end are released."""
        self._refuse_in_continuous_batching("crop")
        self._roll_back_step()
        held = self._held_positions()
        removed = _positions_to_remove(_CROP_ARGUMENT, length, held)
        if not removed:
            return
        end = held - removed
        # tokens stored among the removed positions (padding is not stored), per row
        tokens = removed if self._kept is None else self._kept[:, end:].sum(dim=1, dtype=torch.int32)
        for layer in self.layers:
            layer.seen = end
            if layer.lengths is not None:
                layer.lengths = layer.lengths - tokens
        if self._kept is not None:
            self._kept = self._kept[:, :end]
        if self.pool is not None:
            self.pool.truncate_rows(self._tokens_per_row())

    def _tokens_per_row(self) -> list[int]:
        """The most tokens each row holds in any layer (the pages it needs); a layer that gathers
        (see PagedLayer.gathers) stores every position of every row."""
        gathered = max((layer.seen for layer in self.layers if layer.gathers), default=0)
        stored = [layer.lengths for layer in self.layers if layer.lengths is not None]
        if not stored:
            return [gathered] * self._held_rows()
        return torch.stack(stored).amax(dim=0).clamp(min=gathered).tolist()

    def _held_rows(self) -> int:
        return 0 if self.pool is None else len(self.pool.row_pages)

    def _held_positions(self) -> int:
        """Positions every layer holds (seen); the layers agree between forwards."""
        seen = {layer.seen for layer in self.layers}
        if len(seen) != 1:
            raise RuntimeError(f"PagedCache: the layers hold {sorted(seen)} positions; reorder or crop the cache "
                               "between forwards, when every layer holds the same positions")
        return seen.pop()

    def _select_rows(self, sources: list[int]) -> None:
        """Row i becomes old row sources[i] in every layer: stored lengths, kept positions, pages."""
        self._held_positions()
        index = torch.tensor(sources, dtype=torch.int64)
        for layer in self.layers:
            if layer.lengths is not None:
                layer.lengths = layer.lengths.index_select(0, index.to(layer.lengths.device))
        if self._kept is not None:
            self._kept = self._kept.index_select(0, index.to(self._kept.device))
        self.pool.select_rows(sources)

    def _refuse_in_continuous_batching(self, what: str) -> None:
        if self.collection is not None:
            raise NotImplementedError(
                f"PagedCache(collection=...) does not support {what}: its rows and pages belong to the "
                "continuous-batching page manager (generate_batch); use PagedCache(model) with model.generate"
            )
