"""pagedkv.hf refuses what it cannot do, by name: bad calls, keywords it does not implement,
bad sinks, PagedCache arguments; and the paths that must pass through (gpt-oss sinks, model output
switches, strided K/V read in place)."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf, ref and the shared helpers)


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
    # generate_batch checks its own pool arguments under their names before sizing the pool
    # (page_size=0 was a ZeroDivisionError, -1 a "num_pages ... got -6", kv_dtype=int8 "dtype must be").
    with pytest.raises(ValueError, match=r"^page_size must be >= 1, got 0$"):
        phf.generate_batch(model, [[3, 4]], max_new_tokens=2, page_size=0)
    with pytest.raises(ValueError, match=r"^page_size must be >= 1, got -1$"):
        phf.generate_batch(model, [[3, 4]], max_new_tokens=2, page_size=-1)
    with pytest.raises(ValueError, match=r"^num_pages must be >= 1, got 0$"):
        phf.generate_batch(model, [[3, 4]], max_new_tokens=2, num_pages=0)
    with pytest.raises(ValueError, match=r"^kv_dtype must be one of .*, got torch.int8$"):
        phf.generate_batch(model, [[3, 4]], max_new_tokens=2, kv_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"^kv_dtype must be a torch.dtype, got str$"):
        phf.generate_batch(model, [[3, 4]], max_new_tokens=2, kv_dtype="fp8_e4m3")
    cache = phf.PagedCache(model)
    model.set_attn_implementation("sdpa")  # after the cache was made for "pagedkv"
    with pytest.raises(RuntimeError, match="layer 0 did not attend with attn_implementation='pagedkv'"):
        model(input_ids=ids, attention_mask=mask, **{phf._cache_argument(model): cache})
    model.set_attn_implementation(phf.IMPLEMENTATION)
    query = torch.zeros(2, 4, 3, 16)
    key = torch.zeros(2, 2, 3, 16)
    with pytest.raises(phf.UnsupportedModelError, match=r"cannot run LlamaAttention: .* is a 4-D tensor of shape "
                       r"\(2, 1, 3, 3\), which pagedkv's mask function did not build"):
        phf.attention_forward(model.model.layers[0].self_attn, query, key, key, torch.zeros(2, 1, 3, 3))
    model.train()
    with pytest.raises(ValueError, match="dropout must be 0"):
        phf.attention_forward(model.model.layers[0].self_attn, query, key, key, None, dropout=0.1)



@pytest.mark.parametrize("other_batch", [3, 1])
def test_paged_cache_refuses_another_batch_and_stays_usable(saved_models, other_batch):
    """A forward of another batch size on a PagedCache that holds a batch: refused by name before
    anything changes, and the held batch then continues (logits equal sdpa over the whole sequence).
    A batch of 1 -> 3 grew the pool's row table before paged_store refused the call ("lookup_table.size(0)
    must be 1"), and every later forward of the held batch failed the same way."""
    path = saved_models["llama"]
    model, sdpa = load(path, "pagedkv"), load(path, "sdpa")
    held = 2 if other_batch == 1 else 1
    ids, _ = left_padded([6] * held, seed=1)
    other, _ = left_padded([4] * other_batch, seed=2)
    step = torch.full((held, 1), 7)
    cache = phf.PagedCache(model, page_size=4)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{phf._cache_argument(model): cache})
        with pytest.raises(ValueError, match=rf"this forward has batch {other_batch}, but layer 0 holds {held} rows"):
            model(input_ids=other, use_cache=True, **{phf._cache_argument(model): cache})
        got = model(input_ids=step, use_cache=True, **{phf._cache_argument(model): cache}).logits[:, -1]
        expected = sdpa(input_ids=torch.cat([ids, step], 1)).logits[:, -1]
    assert (got - expected).norm() / expected.norm() < LOGITS_RTOL[torch.float32]


@pytest.mark.parametrize("first, second", [(3, 1), (1, 3)])
def test_reset_paged_cache_serves_a_batch_of_another_size(saved_models, first, second):
    """After reset() a PagedCache takes a new batch of any size: the pool's rows of the old batch (3) stayed
    in its lookup table, and a batch of 1 then failed in paged_store ("lookup_table.size(0) must be 1")."""
    path = saved_models["llama"]
    model, sdpa = load(path, "pagedkv"), load(path, "sdpa")
    cache = phf.PagedCache(model, page_size=4)
    argument = {phf._cache_argument(model): cache}
    with torch.inference_mode():
        model(input_ids=left_padded([6] * first, seed=1)[0], use_cache=True, **argument)
        cache.reset()
        ids, _ = left_padded([5] * second, seed=2)
        step = torch.full((second, 1), 7)
        model(input_ids=ids, use_cache=True, **argument)
        got = model(input_ids=step, use_cache=True, **argument).logits[:, -1]
        expected = sdpa(input_ids=torch.cat([ids, step], 1)).logits[:, -1]
    assert (got - expected).norm() / expected.norm() < LOGITS_RTOL[torch.float32]


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


def test_paged_cache_refuses_layers_that_reuse_another_layers_kv():
    """Gemma3n's last num_kv_shared_layers layers attend over the K/V an earlier layer's cache update
    returned: its whole history with transformers' caches, only the new positions with a PagedCache,
    which gave other tokens than eager. The cache refuses such a config when it is made; without
    shared layers it is taken."""
    config = transformers.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
        activation_sparsity_pattern=[0.0] * 4, max_position_embeddings=256)
    with pytest.raises(ValueError, match=r"PagedCache cannot serve Gemma3nTextConfig .*num_kv_shared_layers"):
        phf.PagedCache(config)
    config.num_kv_shared_layers = 0
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
