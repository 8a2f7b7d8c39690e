"""Models that attn_implementation="pagedkv" cannot serve are refused by what their code does
(pagedkv.hf.mask), on any transformers line: code that reads the attention mask as the 4-D eager
mask (indexing, arithmetic, comparisons, torch functions, tensor methods), a model's own 4-D mask
handed to attention, more keys than the mask was built for. Each refusal is an UnsupportedModelError
naming pagedkv, the model's class, the code that did it, and the implementations to load instead.
What transformers' own mask code does with a 2-D padding mask (ndim, shape, dtype, device, moving
it, flattening it) passes, with eager's tokens. The architectures of transformers that do such
things are swept in test_hf_architectures.py; here a tiny Llama is made to do each of them."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf and the shared helpers)

from pagedkv.hf.mask import PaddingMask

NEW_TOKENS = 3


def llama(implementation):
    """A tiny random Llama (small_config), weights drawn larger than the default so that greedy
    tokens are far from ties."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(small_config("llama"), attn_implementation=implementation)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.2)
    return model.eval()


def attention_reads_mask(model, read):
    """Makes layer 0's attention hand read(attention_mask) to its attention call instead of the
    mask, as model code that reads the mask does (an indexer before its attention call)."""
    attention = model.model.layers[0].self_attn
    original = attention.forward

    def forward(*args, **kwargs):
        kwargs["attention_mask"] = read(kwargs["attention_mask"])
        return original(*args, **kwargs)

    attention.forward = forward


def batch(padded):
    if padded:
        return left_padded([7, 4], seed=3)
    ids, _ = left_padded([6, 6], seed=3)
    return ids, None


def greedy_tokens(model, ids, mask, **kwargs):
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs)
    return out[:, ids.shape[1]:]


def assert_names_model(error, what):
    message = str(error)
    assert message.startswith("attn_implementation='pagedkv' cannot run LlamaForCausalLM (model_type 'llama'): "), message
    assert what in message, message
    assert "load it with attn_implementation='eager' or 'sdpa'" in message, message


# Reads of the mask as the 4-D eager mask, each with what the message must quote.
READS = {
    "index": (lambda mask: mask[:, :, -1:], "attention_mask[...]"),
    "slice as eager attention does": (lambda mask: mask[:, :, :, :4], "attention_mask[...]"),
    "add": (lambda mask: mask + 0.0, "attention_mask + ..."),
    "added to a tensor": (lambda mask: torch.zeros(1) + mask, "add(attention_mask, ...)"),
    "torch.where": (lambda mask: torch.where(mask, 0.0, float("-inf")), "where(attention_mask, ...)"),
    "tensor method": (lambda mask: mask.masked_fill(torch.tensor(True), 0.0), "attention_mask.masked_fill"),
    "compare": (lambda mask: mask == 0, "attention_mask == ..."),
    "bool": (lambda mask: mask if bool(mask) else mask, "bool(attention_mask)"),
    "invert": (lambda mask: ~mask, "~attention_mask"),
    "view to 4-D": (lambda mask: mask.view(mask.shape[0], 1, 1, -1), "attention_mask.view(2, 1, 1, -1)"),
}


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("read", list(READS))
def test_model_code_reading_the_mask_is_refused_by_name(read, padded):
    model = llama("pagedkv")
    function, what = READS[read]
    attention_reads_mask(model, function)
    ids, mask = batch(padded)
    with pytest.raises(phf.UnsupportedModelError) as refused:
        greedy_tokens(model, ids, mask)
    assert_names_model(refused.value, f"({what} in <lambda> (test_hf_refusals.py:")
    assert isinstance(refused.value, ValueError)


def test_refused_before_a_paged_cache_stores_anything():
    """The mask is read in layer 0 before its attention call: the PagedCache holds nothing after
    the refusal."""
    model = llama("pagedkv")
    attention_reads_mask(model, lambda mask: mask[:, None])
    cache = phf.PagedCache(model, page_size=4)
    ids, mask = batch(True)
    with pytest.raises(phf.UnsupportedModelError, match="cannot run LlamaForCausalLM"):
        greedy_tokens(model, ids, mask, **{phf._cache_argument(model): cache})
    assert cache.get_seq_length() == 0
    assert all(layer.seen == 0 for layer in cache.layers)


def test_what_transformers_mask_code_does_passes():
    """ndim, shape, size, dtype, device, .to(device), .view(batch, -1), .contiguous(), `is None`: what
    transformers' mask and generation code asks of a 2-D padding mask (GPT-2 flattens the mask it
    is given); the tokens stay eager's."""
    eager, model = llama("eager"), llama("pagedkv")
    seen = []

    def read(mask):
        assert mask is not None and mask.ndim == 2 and mask.dim() == 2 and mask.dtype == torch.bool
        assert mask.shape == mask.size() and mask.size(0) == 2 and mask.device == torch.device("cpu")
        seen.append(tuple(mask.shape))
        return mask.to("cpu").to(device=torch.device("cpu"), dtype=torch.float32).view(mask.shape[0], -1).contiguous()

    attention_reads_mask(model, read)
    for padded in (True, False):
        ids, mask = batch(padded)
        assert torch.equal(greedy_tokens(model, ids, mask), greedy_tokens(eager, ids, mask))
    assert seen


def test_own_4d_mask_is_refused_by_name():
    """A model that builds its own eager mask instead of calling the registered mask function (4.57's
    OPT and Persimmon): attention gets a 4-D tensor."""
    model = llama("pagedkv")

    def own_mask(mask):
        length = mask.shape[1]
        return torch.zeros(mask.shape[0], 1, length if length > 1 else 1, length)

    attention_reads_mask(model, lambda mask: own_mask(mask.keep if mask.keep is not None else mask.tensor()))
    ids, mask = batch(True)
    with pytest.raises(phf.UnsupportedModelError) as refused:
        greedy_tokens(model, ids, mask)
    assert_names_model(refused.value, "is a 4-D tensor of shape (2, 1, 7, 7), which pagedkv's mask function did not build")


def test_keys_past_the_mask_are_refused_by_name():
    """An attention call given more keys than its mask was built for (keys the model adds after the
    cache and masks by extending the eager mask, as DeepSeek-V4's compressed keys)."""
    model = llama("eager")
    attention = model.model.layers[0].self_attn
    query, key = torch.zeros(2, 4, 3, 16), torch.zeros(2, 2, 5, 16)
    with pytest.raises(phf.UnsupportedModelError, match=r"cannot run LlamaAttention: its attention \(.*\) is given 5 "
                       r"keys, but the attention mask was built for the 3 keys of the cache.*'eager' or 'sdpa'"):
        phf.attention_forward(attention, query, key, key, PaddingMask(None, 2, 3, "cpu", keys=3))
    # fewer keys than the mask's (a preallocating cache's buffer cut to the rows written): attended
    out, _ = phf.attention_forward(attention, query, key[:, :, :3], key[:, :, :3], PaddingMask(None, 2, 3, "cpu", 5))
    assert out.shape == (2, 3, 4, 16)


def test_padding_mask_given_back_to_the_mask_function():
    """generate builds the masks of a compileable cache before the forward and hands them to the
    model as its attention_mask; the model's own mask code then gives it to the mask function again,
    which reads the padding it holds."""
    model, eager = llama("pagedkv"), llama("eager")
    ids, mask = batch(True)
    for padded in (True, False):
        ids, mask = batch(padded)
        expected = greedy_tokens(eager, ids, mask, cache_implementation="static")
        assert torch.equal(greedy_tokens(model, ids, mask, cache_implementation="static"), expected)
