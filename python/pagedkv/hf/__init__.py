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

The attention mask is a 2-D padding mask (as flash attention's, no [B, 1, q, kv] mask is built),
so rows may be padded on either side; only pagedkv's attention function reads it, and model code
that reads it as the 4-D eager mask is refused by name (``pagedkv.hf.mask``).
Beam search and assisted decoding work on ``PagedCache``: rows share pages (reference counts,
copy on write of a shared page before a row writes into it, a free list of released pages), and
``crop`` releases the pages past the rows' new ends.

4. **varlen** (transformers' own ``generate_batch``, 5.x): its scheduler and paged cache, whose
   per-step packed K/V (``cu_seq_lens_q/k``) are attended with ``flash_attn_paged``. Its manager
   only knows sdpa, paged|eager and flash, so ``register`` makes it leave "pagedkv" models as they
   are. ``pagedkv.hf.generate_batch`` is continuous batching on pagedkv's own page manager and
   cache instead (no gather of the K/V into a packed copy per layer and step).

Modules: ``compat`` (transformers versions, keywords), ``attention`` (the registered attention
function), ``mask`` (the registered mask function and the refusal of models whose code reads the
mask as the 4-D eager mask: ``UnsupportedModelError``), ``cache`` (``PagedCache``), ``pool`` (its pages, reference counts and copy on write), ``generate``
(``generate_batch``). Importing ``pagedkv.hf``
checks the installed transformers and registers the implementation.
"""

from .attention import attention_forward, register, transformers_continuous_batching_supported
from .cache import PagedCache
from .compat import (
    IMPLEMENTATION,
    MIN_VERSION,
    TESTED_VERSIONS,
    _warn_if_untested,
    check_transformers_version,
)
from .generate import TransformersPagedModel, generate_batch
from .mask import UnsupportedModelError

# Reached as pagedkv.hf.X by the tests, benchmarks and examples since hf was one module.
from ..cache import PagedKVCacheCollection  # noqa: F401
from .cache import _model_dims, _text_config  # noqa: F401
from .compat import _UNSUPPORTED_KEYWORDS, _version_tuple  # noqa: F401
from .generate import _cache_argument  # noqa: F401

__all__ = [
    "IMPLEMENTATION",
    "MIN_VERSION",
    "TESTED_VERSIONS",
    "PagedCache",
    "TransformersPagedModel",
    "UnsupportedModelError",
    "attention_forward",
    "check_transformers_version",
    "generate_batch",
    "register",
    "transformers_continuous_batching_supported",
]

_warn_if_untested(check_transformers_version())
register()
