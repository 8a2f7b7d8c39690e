"""A decoder attention layer on a paged KV cache: the README's example, runnable."""
import torch
import pagedkv


class PagedAttention(torch.nn.Module):
    def __init__(self, hidden, n_heads, n_kv_heads):
        super().__init__()
        self.hq, self.hk, self.d = n_heads, n_kv_heads, hidden // n_heads
        self.qkv = torch.nn.Linear(hidden, (n_heads + 2 * n_kv_heads) * self.d, bias=False)
        self.o = torch.nn.Linear(n_heads * self.d, hidden, bias=False)

    def forward(self, x, k_cache, v_cache, input_row_offsets, cache_lengths, lookup_table):
        # x: [T, hidden], the new tokens of all B rows concatenated (ragged batch)
        q, k, v = self.qkv(x).split([self.hq * self.d, self.hk * self.d, self.hk * self.d], dim=-1)
        q, k, v = q.view(-1, self.hq, self.d), k.view(-1, self.hk, self.d), v.view(-1, self.hk, self.d)
        pagedkv.paged_store(k, v, k_cache, v_cache, input_row_offsets, cache_lengths, lookup_table)
        out = pagedkv.flash_attn_paged(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table)
        return self.o(out.reshape(-1, self.hq * self.d))


if __name__ == "__main__":
    torch.manual_seed(0)
    layer = PagedAttention(hidden=256, n_heads=8, n_kv_heads=2)
    k_cache = torch.zeros(64, 16, 2, 32)  # [N pages, P tokens, Hk, D]
    v_cache = torch.zeros_like(k_cache)
    lookup_table = torch.randperm(64, dtype=torch.int32)[:8].view(2, 4)  # 2 rows, 4 pages each
    offsets = torch.tensor([0, 5, 12], dtype=torch.int32)  # prefill: 5 and 7 prompt tokens
    lengths = torch.zeros(2, dtype=torch.int32)
    y = layer(torch.randn(12, 256), k_cache, v_cache, offsets, lengths, lookup_table)
    step = layer(torch.randn(2, 256), k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32),
                 torch.tensor([5, 7], dtype=torch.int32), lookup_table)  # one decode step per row
    print("prefill", tuple(y.shape), "decode", tuple(step.shape))
