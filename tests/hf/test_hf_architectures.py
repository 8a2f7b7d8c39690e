"""Every causal-LM architecture the installed transformers ships (discovered from its causal-LM
auto mapping, so a new release's models are in on the day it is installed), as a random tiny model
in float32: attn_implementation="pagedkv" against eager on a left-padded batch. Each either gives
eager's results or is refused cleanly, with an error naming pagedkv and the class: at construction
when its class does not call attention through transformers' AttentionInterface, at its first
forward when its code reads the attention mask as the 4-D eager mask (pagedkv.hf.mask; on the
tested transformers lines such a refusal must be listed in REFUSED_AT_FORWARD*). Anything else
fails. Runs under both transformers lines scripts/test.sh uses, and under a newer one as is.

One test per architecture builds the model once and runs it in every mode: greedy generation with
the default cache (the logits of every step, prefill and decode, within LOGITS_RTOL_FP32 of eager's,
and identical tokens), with transformers' StaticCache and with pagedkv's PagedCache (identical
tokens). The models run on one intra-op thread (see _one_thread).

Known wrong results are strict expected failures (XFAIL, XFAIL_4, XFAIL_5) naming the cause, so a fix shows
as a failure of this file; architectures the file's generic tiny config cannot build even with
eager are skipped (SKIP, SKIP_4, SKIP_5, SKIP_SINCE) with the reason."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

OLDER_LINE = transformers.__version__.startswith("4.")

# A tiny model: every size field an architecture has is set to these (the config's own names
# reach them through its attribute_map). MoE and MLA fields are shrunk too.
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
    topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    sliding_window=5, max_window_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    is_decoder=True,  # BERT-like models: their causal-LM class is a decoder
)
# The other sub-models of a composite model (vision and audio towers, which the text-only prompts
# never run but which are built and initialised): one small layer each.
TINY_TOWER = dict(num_hidden_layers=1, num_blocks=1, depth=1, encoder_layers=1, hidden_size=64,
                  intermediate_size=64, num_attention_heads=2)
# Norm-relative error of the logits (prefill, and all steps) against eager (float32, tiny models: a few ulps).
LOGITS_RTOL_FP32 = 1e-5
# Prefill plus two decode steps that read the cache.
NEW_TOKENS = 3
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}

# Architectures left out, each with why (per transformers line where it differs).
SKIP = {
    # The generic tiny config does not build or run with eager (fields this file does not shrink
    # consistently); pagedkv is not reached.
    "codegen": "rotary_dim larger than the tiny head size", "gptj": "rotary_dim larger than the tiny head size",
    "cohere_compass_text": "layer_types kinds its tiny config cannot take", "dbrx": "attention sub-config",
    "emu3": "composite config without pad_token_id", "llama4": "composite config without pad_token_id",
    "hrm_text": "its tiny config breaks its layer loop", "lfm2_moe": "layer_types without a tiny equivalent",
    "gemma3n": "needs timm", "gemma3n_text": "per-layer KV sharing needs more layers",
    "dots3_note": "per-layer configs", "dots3_note_text": "per-layer configs", "gemma4": "per-layer configs",
    "gemma4_text": "per-layer configs",
    "gemma4_unified": "per-layer configs", "gemma4_unified_text": "per-layer configs",
    "gemma4_assistant": "hidden_size_per_layer_input", "gemma4_unified_assistant": "per-layer configs",
    "prophetnet": "encoder/decoder layer counts", "xlnet": "no sequence length limit field",
    "xmod": "needs a default language", "granitemoehybrid": "only Mamba layers at two layers",
}
# transformers 5.x only (4.57 builds and runs it).
SKIP_5 = {"recurrent_gemma": "recurrent layers only in two layers"}
# From a transformers version on: model_type -> (version, why).
SKIP_SINCE = {
    "zamba": ((5, 25), "the tiny config's shared transformer layer fails transformers' tie_weights_keys check"),
}
# Known wrong with pagedkv: strict expected failures (reason, the exception they fail with), so a
# fix shows as a failure here. Architectures pagedkv refuses (REFUSED_AT_FORWARD below, classes
# with _supports_attention_backend = False) and models whose layers a PagedCache cannot hold
# (compat.PAGED_CACHE_REFUSED: mllama, moshi on 5.x) are not here: the test asserts their errors.
XFAIL = {}
# transformers 5.x only.
XFAIL_5 = {}
# Refused at their first forward, by what their model code does with the attention mask (see
# pagedkv.hf.mask): model_type -> what the code does. On the tested transformers lines every
# refusal must be listed here (a supported model refused by mistake fails); an architecture of a
# newer line passes with any clean refusal.
_INDEXER = "its sparse-attention indexer selects keys from the 4-D mask"
REFUSED_AT_FORWARD = {
    "doge": "its dynamic mask is computed from the 4-D mask (torch.where on it)",
}
REFUSED_AT_FORWARD_4 = {
    "opt": "it builds its own 4-D mask instead of calling the registered mask function",
    "persimmon": "it builds its own 4-D mask instead of calling the registered mask function",
    "fuyu": "its language model (Persimmon) builds its own 4-D mask",
}
REFUSED_AT_FORWARD_5 = {
    "deepseek_v32": _INDEXER, "glm_moe_dsa": _INDEXER, "axk2": _INDEXER, "hy_v4": _INDEXER,
    "kolibri1_1": _INDEXER + " (transformers 5.25)",
    "deepseek_v4": "its compressed keys are added after the cache, masked by extending the 4-D mask",
    "dory": "its looped layers attend over another pass's keys, more keys than the mask was built for",
}
# Listed above, and eager fails on the file's tiny config too (so there are no tokens to compare
# with): the test only checks the refusal.
NO_EAGER_REFERENCE = {"dory": "eager: the tiny config's looped layers get more keys than its 4-D mask"}
# Composite models refused at construction through a sub-model whose class sets
# _supports_attention_backend = False: model_type -> the sub-model class the error names.
REFUSED_THROUGH_SUBMODEL = {"phi4_multimodal": "Phi4MultimodalAudioModel"}

# transformers 4.57 only.
# The generic tiny config does not build or run these with eager on 4.57 (pagedkv is not reached).
SKIP_4 = {
    "musicgen": "composite config (text_encoder, audio_encoder, decoder)",
    "musicgen_melody": "composite config (text_encoder, audio_encoder, decoder)",
    "transfo-xl": "no sequence length limit field", "xlm-prophetnet": "encoder/decoder layer counts",
    "phi4_multimodal": "its default config has no vision_config (None), which the model needs",
    "mllama": "its tiny config does not build (a None sub-config field)",
}
# Known wrong with pagedkv on 4.57 (none now: GPT-2's is_causal=False with a mask, found by this
# sweep on 2026-11-28, is read from the module, see pagedkv.hf.compat.CAUSAL_FROM_MODULE).
XFAIL_4 = {}


def _architectures():
    names = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        model_class = getattr(transformers, class_name, None)
        if model_class is not None:
            names.append(model_type)
    return names


def _model_class(model_type):
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def _two_layer_types(layer_types):
    """Two layers of the architecture's kinds (a sliding and a full layer where it has both)."""
    kinds = list(dict.fromkeys(layer_types))
    return (kinds + kinds)[:2]


def tiny_config(model_type, implementation):
    config = transformers.AutoConfig.for_model(model_type)
    text = config.get_text_config(decoder=True)
    for name, value in TINY.items():
        if hasattr(text, name):
            try:
                setattr(text, name, value)
            except AttributeError:  # a property derived from other fields
                pass
    towers = [sub for sub in vars(config).values()
              if isinstance(sub, transformers.PretrainedConfig) and sub is not text and sub is not config]
    for tower in towers:
        for name, value in TINY_TOWER.items():
            if hasattr(tower, name):
                try:
                    setattr(tower, name, value)
                except AttributeError:
                    pass
    if getattr(text, "kv_lora_rank", None):  # MLA: the rotary part is what head_dim names; K/V per query head
        text.head_dim = text.qk_rope_head_dim
        text.num_key_value_heads = text.num_attention_heads
        if hasattr(text, "qk_head_dim"):  # derived once, at construction
            try:
                text.qk_head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
            except AttributeError:
                pass
    if isinstance(getattr(text, "layer_types", None), list):
        try:
            text.layer_types = _two_layer_types(text.layer_types)
        except AttributeError:
            pass
    config._attn_implementation = implementation  # noqa: SLF001  (what attn_implementation= sets)
    return config


def build(model_type, implementation="eager"):
    torch.manual_seed(0)
    config = tiny_config(model_type, implementation)
    return _model_class(model_type)._from_config(config, attn_implementation=implementation).eval()


def prompts():
    ids, mask = left_padded([7, 4], seed=5)
    return ids % TINY["vocab_size"], mask


def generate(model, **kwargs):
    """Greedy NEW_TOKENS tokens [B, NEW_TOKENS] and the logits of every step [steps, B, vocab]."""
    ids, mask = prompts()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)


def relative_error(got, expected):
    return float((got.double() - expected.double()).norm() / expected.double().norm())


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from a second intra-op thread, and on a loaded machine its spinning
    costs more than it saves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _params():
    params = []
    for model_type in _architectures():
        marks = []
        skip = SKIP.get(model_type) or (SKIP_4 if OLDER_LINE else SKIP_5).get(model_type)
        since, reason = SKIP_SINCE.get(model_type, (None, None))
        if since is not None and compat._version_tuple(transformers.__version__)[:2] >= since:
            skip = skip or reason
        if skip:
            marks.append(pytest.mark.skip(reason=skip))
        known = XFAIL.get(model_type) or (XFAIL_4 if OLDER_LINE else XFAIL_5).get(model_type)
        if known:
            reason, raises = known
            marks.append(pytest.mark.xfail(reason=reason, raises=raises, strict=True))
        params.append(pytest.param(model_type, marks=marks))
    return params


@pytest.mark.parametrize("model_type", _params())
def test_architecture_against_eager(model_type):
    model_class = _model_class(model_type)
    if model_type in REFUSED_THROUGH_SUBMODEL:
        with pytest.raises(ValueError, match=f"pagedkv.*{REFUSED_THROUGH_SUBMODEL[model_type]}"):
            build(model_type, "pagedkv")
        return
    if phf.attention.refused_architecture_message(model_class) is not None:  # _supports_attention_backend = False
        with pytest.raises(ValueError, match=f"pagedkv.*{model_class.__name__}"):
            build(model_type, "pagedkv")
        return
    if model_type in NO_EAGER_REFERENCE:
        model = build(model_type, "pagedkv")
        with pytest.raises(phf.UnsupportedModelError) as refused:
            generate(model)
        _check_refused_at_forward(model_type, model, refused.value)
        return
    model = build(model_type)
    expected_tokens, expected_logits = generate(model)
    model.set_attn_implementation(phf.IMPLEMENTATION)
    try:
        tokens, logits = generate(model)
    except (ValueError, NotImplementedError) as error:
        _check_refused_at_forward(model_type, model, error)
        return
    assert model_type not in _refused_at_forward(), "expected a refusal: " + _refused_at_forward()[model_type]
    error = relative_error(logits[0], expected_logits[0])
    assert error <= LOGITS_RTOL_FP32, f"prefill logits: relative error {error:.2e}"
    assert torch.equal(tokens, expected_tokens), "default cache: tokens"
    error = relative_error(logits, expected_logits)
    assert error <= LOGITS_RTOL_FP32, f"default cache, prefill and decode logits: relative error {error:.2e}"
    _check_static_cache(model_type, model, expected_tokens)
    if set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()) - ATTENTION_LAYERS:
        with pytest.raises(ValueError, match="PagedCache cannot hold"):  # recurrent / convolution layers
            phf.PagedCache(model)
        return
    if _paged_cache_refused(model):
        with pytest.raises(ValueError, match="PagedCache cannot serve"):
            phf.PagedCache(model)
        return
    paged = generate(model, **paged_cache_argument(model, page_size=4))[0]
    assert torch.equal(paged, expected_tokens), "PagedCache: tokens"


def _refused_at_forward():
    return {**REFUSED_AT_FORWARD, **(REFUSED_AT_FORWARD_4 if OLDER_LINE else REFUSED_AT_FORWARD_5)}


def _check_refused_at_forward(model_type, model, error):
    """A refusal by behaviour (pagedkv.hf.mask): the error names pagedkv and the model's class and
    says what to load instead, for a left-padded batch, an unpadded one and a PagedCache alike. On
    the tested transformers lines the architecture must be listed in REFUSED_AT_FORWARD*, so that a
    supported model refused by mistake fails here; on a newer line a clean refusal is what an
    architecture pagedkv cannot serve must give."""
    name = type(model).__name__
    message = str(error)
    assert isinstance(error, phf.UnsupportedModelError), f"{type(error).__name__}: {message}"
    assert f"attn_implementation='pagedkv' cannot run {name} " in message, message
    assert "attn_implementation='eager' or 'sdpa'" in message, message
    newer = compat._version_tuple(transformers.__version__)[:2] > max(
        compat._version_tuple(version)[:2] for version in phf.TESTED_VERSIONS)
    assert newer or model_type in _refused_at_forward(), f"refused, but not listed in REFUSED_AT_FORWARD: {message}"
    ids = torch.randint(3, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(phf.UnsupportedModelError, match=f"cannot run {name} "), torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or ()
    if _paged_cache_refused(model) or set(layer_types) - ATTENTION_LAYERS:  # PagedCache(model) refuses these
        return
    with pytest.raises(phf.UnsupportedModelError, match=f"cannot run {name} "):
        generate(model, **paged_cache_argument(model, page_size=4))


def _paged_cache_refused(model):
    """Whether compat.PAGED_CACHE_REFUSED lists the model (or its text model), or its text config
    has cross-attention layers or layers that reuse another layer's K/V: then PagedCache(model)
    must refuse it."""
    configs = (model.config, model.config.get_text_config(decoder=True))
    return any(phf.compat.refusal(phf.compat.PAGED_CACHE_REFUSED, getattr(config, "model_type", None))
               or getattr(config, "cross_attention_layers", None) or phf.cache._shares_kv_across_layers(config)
               for config in configs)


def _check_static_cache(model_type, model, expected_tokens):
    """transformers' StaticCache gives eager's tokens; where it cannot hold the model (eager
    fails on it too, e.g. 4.57's with MLA's K and V widths) pagedkv is excused. Eager is tried
    on a fresh model: the failed call leaves its half-made static cache on this one."""
    try:
        tokens = generate(model, cache_implementation="static")[0]
    except Exception:  # noqa: BLE001
        with pytest.raises(Exception):  # noqa: B017, PT011
            generate(build(model_type), cache_implementation="static")
        return
    assert torch.equal(tokens, expected_tokens), "static cache: tokens"


def test_gathering_layers_refuse_another_batch_and_stay_usable():
    """DeepSeek's MLA layers (transformers 5.x) gather their history from the pages (PagedLayer.gathers): a
    forward of another batch size was accepted there (rows of the old batch's positions) and then every
    forward of the held batch failed in paged_store; now refused by name before anything changes."""
    import pagedkv.hf as phf

    if "deepseek_v3" not in _architectures():
        pytest.skip("this transformers has no deepseek_v3")
    model, eager = build("deepseek_v3", "pagedkv"), build("deepseek_v3", "eager")
    cache = phf.PagedCache(model, page_size=4)
    argument = {phf._cache_argument(model): cache}
    ids, step = torch.randint(0, TINY["vocab_size"], (2, 6)), torch.full((2, 1), 7)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **argument)
        if not any(layer.gathers for layer in cache.layers):
            pytest.skip("this transformers' deepseek_v3 attends over what it caches (no gathering layer)")
        with pytest.raises(ValueError, match="this forward has batch 3, but layer 0 holds 2 rows"):
            model(input_ids=torch.full((3, 1), 7), use_cache=True, **argument)
        got = model(input_ids=step, use_cache=True, **argument).logits[:, -1]
        expected = eager(input_ids=torch.cat([ids, step], 1)).logits[:, -1]
    assert relative_error(got, expected) <= LOGITS_RTOL_FP32
