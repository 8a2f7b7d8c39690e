"""Which transformers pagedkv.hf runs with: the version floor, the release lines tested, the hooks
it needs, and the attention keywords it knows (those without effect on the result, those it
refuses). Update TESTED_VERSIONS and the keyword lists together when a transformers line is added:
the lists are audited per line."""

from __future__ import annotations

import importlib
import re
import warnings

IMPLEMENTATION = "pagedkv"
# The hooks used here: AttentionInterface / AttentionMaskInterface (4.54+) and Cache made of
# per-layer objects (CacheLayerMixin, 4.56+); 4.57 is the oldest line tested.
MIN_VERSION = (4, 57)
# Release lines the test suite runs against (see tests/hf and README).
TESTED_VERSIONS = ("4.57.6", "5.24.0")


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
    "logits_to_keep",  # which positions the LM head reads (GOT-OCR2 hands it down to its layers)
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



# Attention classes whose model windows attention (its mask function is the sliding-window one)
# without passing sliding_window to the attention function: the window is config.sliding_window.
# (A class that keeps its window as `self.sliding_window` without passing it, as 5.x's
# Qwen2MoeAttention, needs no entry: a missing keyword is read from that attribute first.)
WINDOW_FROM_CONFIG = frozenset({
    "PhimoeAttention",  # 5.x: only create_sliding_window_causal_mask applies the window
})

# Attention classes whose is_causal keyword says whether a mask was given, not whether attention is
# causal: 4.57's GPT-2 passes is_causal=False with a mask (its eager path masks causally through
# its own `bias` buffer and that mask), which pagedkv's 2-D padding mask does not do. For them the
# module decides: causal unless it is a cross-attention layer.
CAUSAL_FROM_MODULE = frozenset({"GPT2Attention", "DecisionTransformerGPT2Attention"})

# Architectures pagedkv cannot serve are not listed: a class that does not call the attention
# interface says so (_supports_attention_backend = False) and is refused when built, and model
# code that reads the attention mask as the 4-D eager mask (sparse-attention indexers, dynamic
# masks, a model's own 4-D mask, keys added after the cache) is refused by what it does at its
# first forward (pagedkv.hf.mask).

# Architectures whose layers a PagedCache cannot hold: model_type (of the config or its text
# config) -> (why, transformers major versions or None). PagedCache(model) raises a ValueError
# with the reason when it is made; transformers' own caches work with attn_implementation="pagedkv".
PAGED_CACHE_REFUSED = {
    "mllama": ("its cross-attention layers read the image tokens' keys and values from the cache, and a "
               "PagedCache holds only self-attention layers", None),
    "moshi": ("its sliding window is applied only by transformers' sliding cache layers (which drop keys "
              "past config.sliding_window), not by its attention or mask, and a PagedCache keeps every key", (5,)),
}


def refusal(table: dict, model_type, version: str | None = None) -> str | None:
    """The reason `table` gives for model_type on this transformers line, or None."""
    entry = table.get(model_type)
    if entry is None:
        return None
    reason, lines = entry
    if lines is not None:
        if version is None:
            import transformers

            version = transformers.__version__
        if _version_tuple(version)[0] not in lines:
            return None
    return reason


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



def _warn_if_untested(version: str) -> None:
    """Warns (once: pagedkv.hf calls it when imported) when the installed transformers line is newer
    than every tested one, naming the tested versions. stacklevel 3 points at the import of pagedkv.hf
    (warnings skips the import machinery's frames)."""
    newest = max(_version_tuple(v) for v in TESTED_VERSIONS)
    if _version_tuple(version)[:2] > newest[:2]:
        tested = " and ".join([", ".join(TESTED_VERSIONS[:-1]), TESTED_VERSIONS[-1]] if len(TESTED_VERSIONS) > 1
                              else TESTED_VERSIONS)
        warnings.warn(
            f"pagedkv.hf was tested with transformers {tested}; installed {version} is newer. Models whose code "
            "pagedkv cannot serve are refused by name (pagedkv.hf.UnsupportedModelError or a ValueError at "
            "construction); any other failure with attn_implementation='pagedkv' is a pagedkv bug",
            stacklevel=3,
        )
