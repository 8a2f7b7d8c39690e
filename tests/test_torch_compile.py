"""torch.compile(fullgraph=True) of a small attention layer that stores into a paged cache and
attends over it (pagedkv.cache.PagedKVCacheCollection), on every device: the compiled layer
matches eager, step by step, and leaves the same cache behind (the ops' schemas, mutation
annotations and fake kernels are what make this work)."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES, assert_bytes_equal, dtype_name, supported_or_skip
from pagedkv.cache import PagedKVCacheCollection


class TinyAttentionLayer(torch.nn.Module):
    """q/k/v projections, paged_store into a collection, flash_attn_paged, output projection."""

    def __init__(self, cache, layer, hidden, num_q_heads, num_kv_heads, head_dim):
        super().__init__()
        self.cache, self.layer = cache, layer
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.qkv = torch.nn.Linear(hidden, (num_q_heads + 2 * num_kv_heads) * head_dim, bias=False)
        self.proj = torch.nn.Linear(num_q_heads * head_dim, hidden, bias=False)

    def forward(self, x, input_row_offsets, cache_lengths, lookup_table):
        tokens = x.shape[0]
        qkv = self.qkv(x).view(tokens, self.num_q_heads + 2 * self.num_kv_heads, self.head_dim)
        q = qkv[:, : self.num_q_heads]
        k = qkv[:, self.num_q_heads : self.num_q_heads + self.num_kv_heads]
        v = qkv[:, self.num_q_heads + self.num_kv_heads :]
        self.cache.store(self.layer, k, v, input_row_offsets, cache_lengths, lookup_table)
        o = self.cache.attention(self.layer, q, input_row_offsets, cache_lengths, lookup_table,
                                 softcap=20.0)
        return self.proj(o.reshape(tokens, -1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=dtype_name)
def test_torch_compile_fullgraph(device, backend, dtype):
    torch.manual_seed(0)
    caches = [PagedKVCacheCollection(12, 2, 4, 2, 16, dtype=dtype, device=device, quant_group=8)
              for _ in range(2)]
    eager = TinyAttentionLayer(caches[0], 1, 32, 4, 2, 16).to(device)
    compiled_layer = TinyAttentionLayer(caches[1], 1, 32, 4, 2, 16).to(device)
    compiled_layer.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_layer, backend=backend, fullgraph=True)
    table = torch.tensor([[3, 7, 1], [0, 11, 5]], dtype=torch.int32, device=device)
    steps = [([0, 5, 7], [0, 0]), ([0, 1, 2], [5, 2]), ([0, 3, 4], [6, 3])]
    with torch.no_grad():
        for offsets, lengths in steps:
            offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
            lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
            x = torch.randn((int(offsets[-1]) + 1, 32), device=device)  # one padding row
            expected = supported_or_skip(device, eager, x, offsets, lengths, table)
            got = compiled(x, offsets, lengths, table)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if backend == "aot_eager":
        # Same aten kernels for the projections: the stored bytes must match exactly.
        assert_bytes_equal(caches[1].blocks, caches[0].blocks, "compiled cache blocks")
        if caches[0].scales is not None:
            assert_bytes_equal(caches[1].scales, caches[0].scales, "compiled cache scales")
    elif dtype == torch.float32:
        torch.testing.assert_close(caches[1].blocks, caches[0].blocks, rtol=1e-5, atol=1e-6)
