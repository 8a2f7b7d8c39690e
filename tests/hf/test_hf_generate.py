"""pagedkv.hf generation: greedy tokens identical to sdpa (padded batches, chunked prefill,
DynamicCache and PagedCache), logits within bounds, and continuous batching (pagedkv's and transformers')."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf, ref and the shared helpers)


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


def test_reset_cache_serves_a_new_batch_with_other_padding(saved_models):
    """One PagedCache reset between forwards over batches of other padding, the bool mask given in one
    reused buffer (so at one address): each forward's logits equal sdpa's. The step memo shared by the
    layers of a forward was keyed on positions and the mask's address and outlived reset(): the second
    batch was stored and attended with the first one's rows (logits off by ~100%)."""
    path = saved_models["llama"]
    sdpa, model = load(path, "sdpa"), load(path, "pagedkv")
    cache = phf.PagedCache(model, page_size=4)
    buffer = torch.zeros((2, 7), dtype=torch.bool)
    for lengths, seed in [([7, 3], 1), ([3, 7], 2)]:
        ids, mask = left_padded(lengths, seed)
        buffer.copy_(mask)
        with torch.inference_mode():
            expected = sdpa(input_ids=ids, attention_mask=mask).logits
            got = model(input_ids=ids, attention_mask=buffer, use_cache=True,
                        **{phf._cache_argument(model): cache}).logits
        keep = mask.bool()
        error = (got[keep] - expected[keep]).norm() / expected[keep].norm()
        assert error < LOGITS_RTOL[torch.float32], f"{lengths}: relative logits error {error:.2e}"
        cache.reset()


def test_paged_cache_is_a_class_users_can_name():
    """PagedCache is a class of its own (a subclass of transformers' Cache), not a factory returning an
    instance of a class made inside it: isinstance works, and the class is the one pagedkv.hf exports."""
    config = small_config("llama")
    config._attn_implementation = "pagedkv"
    cache = phf.PagedCache(config, page_size=4)
    assert isinstance(cache, phf.PagedCache) and type(cache) is phf.PagedCache
    assert isinstance(cache, transformers.cache_utils.Cache)
    assert phf.PagedCache.__name__ == "PagedCache" and phf.PagedCache.__module__ == "pagedkv.hf.cache"
    assert len(cache.layers) == config.num_hidden_layers and cache.get_seq_length() == 0
    with pytest.raises(TypeError):
        phf.PagedCache(config, 4)  # the options are keyword-only


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
