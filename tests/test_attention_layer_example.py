"""examples/attention_layer.py (the README's attention layer) against the same layer computed in plain
torch: per row, causal SDPA with GQA over the row's prompt (prefill), then over prompt + one new token
(a decode step reading the pages the prefill wrote)."""

import importlib.util
import os

import torch
import torch.nn.functional as F

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "attention_layer.py")


def load_example():
    spec = importlib.util.spec_from_file_location("attention_layer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_layer(layer, x_rows):
    """Each row's output of its last len(new) tokens: x_rows [(x_all_tokens, n_new)]."""
    outs = []
    for x, n_new in x_rows:
        q, k, v = layer.qkv(x).split([layer.hq * layer.d, layer.hk * layer.d, layer.hk * layer.d], dim=-1)
        q, k, v = (t.view(-1, h, layer.d).transpose(0, 1) for t, h in ((q, layer.hq), (k, layer.hk), (v, layer.hk)))
        k, v = (t.repeat_interleave(layer.hq // layer.hk, dim=0) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(-1, layer.hq * layer.d)
        outs.append(layer.o(out)[-n_new:])
    return torch.cat(outs)


def test_readme_attention_layer_prefill_then_decode_equals_plain_attention():
    example = load_example()
    torch.manual_seed(0)
    layer = example.PagedAttention(hidden=256, n_heads=8, n_kv_heads=2)
    k_cache, v_cache = torch.zeros(64, 16, 2, 32), torch.zeros(64, 16, 2, 32)
    table = torch.randperm(64, dtype=torch.int32)[:8].view(2, 4)
    prompts = [torch.randn(5, 256), torch.randn(20, 256)]  # the second spans two pages
    new = [torch.randn(1, 256), torch.randn(1, 256)]
    with torch.no_grad():
        prefill = layer(torch.cat(prompts), k_cache, v_cache, torch.tensor([0, 5, 25], dtype=torch.int32),
                        torch.zeros(2, dtype=torch.int32), table)
        decode = layer(torch.cat(new), k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32),
                       torch.tensor([5, 20], dtype=torch.int32), table)
        expected_prefill = plain_layer(layer, [(p, len(p)) for p in prompts])
        expected_decode = plain_layer(layer, [(torch.cat([p, n]), 1) for p, n in zip(prompts, new)])
    torch.testing.assert_close(prefill, expected_prefill, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(decode, expected_decode, rtol=1e-4, atol=1e-5)
