"""FP8 KV cache in transformers models: every layer's attention and stored K/V against
pagedkv.reference on the same FP8 K/V (random Llama and Mistral models; SmolLM2 in test_hf_smollm2.py)."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf, ref and the shared helpers)


# ---- FP8 KV cache: every layer against pagedkv.reference -----------------------------------------


@pytest.mark.parametrize("kv_dtype", FP8_DTYPES, ids=FP8_IDS)
@pytest.mark.parametrize("family,quant_group,page_size", [("llama", 128, 16), ("llama", 8, 3), ("mistral", 128, 5)],
                         ids=["llama", "llama-group8-page3", "mistral-window"])
def test_fp8_attention_every_layer_matches_reference(saved_models, family, quant_group, page_size, kv_dtype,
                                                     num_threads):
    """Random models, left-padded prompts (Mistral's longer than its sliding window), per-group scales."""
    model = load(saved_models[family], "pagedkv")
    ids, mask = left_padded([17, 9, 30, 4], seed=5)
    check_fp8_layers_against_reference(model, ids, mask, kv_dtype, 6, quant_group=quant_group, page_size=page_size)
