"""A DeepSeek-style MLA attention layer over a packed FP8 cache (kv_format="fp8_ds_mla"), runnable.

Each token caches one 576-channel key: the 512-channel compressed latent c_kv and a 64-channel rope
key shared by all heads, packed into a 656-byte row (FP8 latent, four scales, bfloat16 rope). The
layer attends with absorbed projections: the no-rope query goes into the latent space through W_UK
(q_latent = W_UK^T q_nope), so one 576-channel dot product gives q_nope . k_nope + q_rope . k_rope,
and the attention output (a latent, 512 channels) comes out through W_UV. The same layer computed
without absorption (per-head keys W_UK c_kv and values W_UV c_kv, float64, plain torch) is the check:

1. over the latents the cache holds (read back with paged_load): absorption and the op match it
   to float32 rounding;
2. over the exact latents: the difference is the FP8 quantization of the latent, whose relative
   error per element is at most 2^-4 (e4m3 keeps 3 mantissa bits; each 128-channel group is scaled
   so its largest element is 448, away from the subnormals).

Two sequences are prefilled (37 and 20 tokens, pages from a PageManager), then decode 3 steps.
`python examples/mla_layer.py` prints the errors and exits non-zero if a check fails.
"""

import math

import torch

import pagedkv

LATENT, ROPE, NOPE, V_HEAD = 512, 64, 128, 128  # DeepSeek-V3's kv_lora_rank, rope, nope and value head dims
FP8_RELATIVE_ERROR = 2.0**-4  # e4m3 rounding of a normal number: half of 2^-3 relative spacing


def rotary(x, positions, base=10000.0):
    """Rotary embedding (rotate-half form) of x [T, ..., 64] at positions [T]."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * freqs[None]  # [T, half]
    cos, sin = angles.cos(), angles.sin()
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


class MLALayer(torch.nn.Module):
    def __init__(self, hidden, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = torch.nn.Linear(hidden, num_heads * (NOPE + ROPE), bias=False)
        self.kv_a_proj = torch.nn.Linear(hidden, LATENT + ROPE, bias=False)  # c_kv and the shared rope key
        self.kv_a_norm = torch.nn.RMSNorm(LATENT)
        # kv_b_proj [H * (NOPE + V_HEAD), LATENT] split per head: W_UK [H, NOPE, LATENT], W_UV [H, V_HEAD, LATENT]
        self.w_uk = torch.nn.Parameter(torch.randn(num_heads, NOPE, LATENT) / math.sqrt(LATENT))
        self.w_uv = torch.nn.Parameter(torch.randn(num_heads, V_HEAD, LATENT) / math.sqrt(LATENT))
        self.o_proj = torch.nn.Linear(num_heads * V_HEAD, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(NOPE + ROPE)  # the softmax scale of the unabsorbed heads

    def project(self, x, positions):
        """Queries (no-rope part [T, H, 128], rotated rope part [T, H, 64]) and the cached latent
        key [T, 576] = concat(normed c_kv, rotated rope key) of the new tokens."""
        q = self.q_proj(x).view(x.shape[0], self.num_heads, NOPE + ROPE)
        q_nope, q_rope = q.split([NOPE, ROPE], -1)
        c_kv, k_rope = self.kv_a_proj(x).split([LATENT, ROPE], -1)
        key = torch.cat([self.kv_a_norm(c_kv), rotary(k_rope, positions)], -1)
        return q_nope, rotary(q_rope, positions), key

    def forward(self, x, positions, cache, input_row_offsets, cache_lengths, lookup_table):
        """Store the new tokens' latent keys, attend with absorbed projections: [T, hidden]."""
        q_nope, q_rope, key = self.project(x, positions)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)  # W_UK^T q_nope: [T, H, 512]
        cache.store(0, key.unsqueeze(1), None, input_row_offsets, cache_lengths, lookup_table)
        out_latent = cache.attention(0, torch.cat([q_latent, q_rope], -1), input_row_offsets, cache_lengths,
                                     lookup_table, scale=self.scale)  # [T, H, 512]
        out = torch.einsum("thc,hvc->thv", out_latent, self.w_uv)  # W_UV o_latent: [T, H, 128]
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_unabsorbed(self, q_nope, q_rope, keys):
        """One sequence's new queries [n, H, ...] over all its keys [L, 576] (the new ones last), in
        float64 without absorption: per-head keys concat(W_UK c_kv, k_rope), values W_UV c_kv."""
        f64 = torch.float64
        c_kv, k_rope = keys.to(f64).split([LATENT, ROPE], -1)
        k_nope = torch.einsum("lc,hnc->hln", c_kv, self.w_uk.to(f64))
        k = torch.cat([k_nope, k_rope.unsqueeze(0).expand(self.num_heads, -1, -1)], -1)  # [H, L, 192]
        v = torch.einsum("lc,hvc->hlv", c_kv, self.w_uv.to(f64))  # [H, L, 128]
        q = torch.cat([q_nope, q_rope], -1).to(f64).transpose(0, 1)  # [H, n, 192]
        n, total = q.shape[1], k.shape[1]
        visible = torch.arange(total)[None] <= torch.arange(total - n, total)[:, None]  # causal, bottom-right
        scores = (q @ k.transpose(1, 2) * self.scale).masked_fill(~visible, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1)  # [n, H, 128]
        return torch.nn.functional.linear(out.reshape(n, -1), self.o_proj.weight.to(f64))


def relative_error(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


def main():
    torch.manual_seed(0)
    hidden, num_heads, page_size, num_pages = 256, 16, 16, 16
    layer = MLALayer(hidden, num_heads)
    cache = pagedkv.PagedMLACache(num_pages, page_size, kv_format="fp8_ds_mla")
    manager = pagedkv.PageManager(num_pages, page_size, caches=cache.k_pools)
    seqs = [0, 1]
    exact_keys = {seq: torch.empty(0, LATENT + ROPE) for seq in seqs}  # the latents before FP8, per sequence
    worst = {"stored": 0.0, "exact": 0.0}
    with torch.no_grad():
        for step, new_tokens in enumerate([[37, 20], [1, 1], [1, 1], [1, 1]]):
            for seq, n in zip(seqs, new_tokens):
                if step == 0:
                    manager.add_sequence(seq)
                manager.reserve(seq, n)
            lookup_table, cache_lengths = manager.export(seqs)
            offsets = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
            positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cache_lengths.tolist(), new_tokens)])
            x = torch.randn(int(offsets[-1]), hidden)
            y = layer(x, positions, cache, offsets, cache_lengths, lookup_table)
            for seq, n in zip(seqs, new_tokens):
                manager.commit(seq, n)
            q_nope, q_rope, key = layer.project(x, positions)
            stored = cache.load(0, lookup_table, cache_lengths + torch.tensor(new_tokens, dtype=torch.int32))
            stored_offsets = [0, *(cache_lengths + torch.tensor(new_tokens)).cumsum(0).tolist()]
            for b, seq in enumerate(seqs):
                rows = slice(int(offsets[b]), int(offsets[b + 1]))
                exact_keys[seq] = torch.cat([exact_keys[seq], key[rows]])
                seq_stored = stored[stored_offsets[b] : stored_offsets[b + 1], 0]
                for name, keys in (("stored", seq_stored), ("exact", exact_keys[seq])):
                    expected = layer.forward_unabsorbed(q_nope[rows], q_rope[rows], keys)
                    worst[name] = max(worst[name], relative_error(y[rows], expected))
            print(f"step {step}: {new_tokens} new tokens, output {tuple(y.shape)}")
    print(f"absorbed fp8_ds_mla layer vs unabsorbed float64 over the cached latents: "
          f"relative error {worst['stored']:.2e} (float32 rounding, limit 1e-4)")
    print(f"absorbed fp8_ds_mla layer vs unabsorbed float64 over the exact latents:  "
          f"relative error {worst['exact']:.2e} (FP8 latent, limit {FP8_RELATIVE_ERROR:.2e})")
    ok = worst["stored"] <= 1e-4 and worst["exact"] <= FP8_RELATIVE_ERROR
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
