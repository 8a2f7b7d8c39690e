"""torch.compile of a "pagedkv" model with transformers' StaticCache (issue 52): greedy tokens equal
eager's, left-padded and unpadded, on the transformers line installed (scripts/test.sh runs tests/hf
under both). The aot_eager backend traces the model as inductor does (dynamo, AOT autograd, the
graph breaks of pagedkv's mask function and of its attention call with a padding mask) without
compiling kernels, so the test stays cheap; inductor gives the same tokens (docs/transformers.md)."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf and the shared helpers)

NEW_TOKENS = 6


@pytest.fixture(autouse=True)
def _one_thread():
    """A tiny model: a second intra-op thread only costs time on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(implementation):
    torch.manual_seed(0)
    config = small_config("llama")
    config.num_hidden_layers = 2
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=implementation).eval()


def test_torch_compile_static_cache_tokens_equal_eager():
    """One compiled model, a left-padded batch then an unpadded one of the same shape."""
    batches = {"left-padded": left_padded([9, 4], seed=3), "unpadded": left_padded([9, 9], seed=4)}
    static = {"cache_implementation": "static"}
    eager = _model("eager")
    expected = {name: greedy(eager, ids, mask, NEW_TOKENS, **static) for name, (ids, mask) in batches.items()}
    model = _model(phf.IMPLEMENTATION)
    for name, (ids, mask) in batches.items():
        assert torch.equal(greedy(model, ids, mask, NEW_TOKENS, **static), expected[name]), f"{name}, not compiled"
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # generate calls the model through its forward, so the compiled forward is what runs every step
    model.forward = torch.compile(model.forward, backend="aot_eager")
    try:
        for name, (ids, mask) in batches.items():
            tokens = greedy(model, ids, mask, NEW_TOKENS, **static)
            assert torch.equal(tokens, expected[name]), f"{name}, under torch.compile (aot_eager)"
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "torch.compile traced nothing"
    finally:
        torch._dynamo.reset()
