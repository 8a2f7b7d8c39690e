"""A Llama-family decoder in plain torch whose attention reads and writes a paged KV cache.

The model works on ragged batches: the new tokens of all sequences of a step are concatenated into
one ``[T]`` token tensor, and ``input_row_offsets`` / ``cache_lengths`` / ``lookup_table`` (the
CONTRACT.md index tensors) say which sequence each token belongs to and where its K/V go. Prefill
rows (many new tokens) and decode rows (one new token) mix freely in one step.

Per layer, attention does exactly two cache calls on a ``pagedkv.PagedKVCacheCollection``::

    collection.store(layer, k, v, input_row_offsets, cache_lengths, lookup_table)
    out = collection.attention(layer, q, input_row_offsets, cache_lengths, lookup_table)

Parameter names follow ``transformers.LlamaForCausalLM`` so a HF-named state dict (see
``pagedkv.gguf_model``) loads with ``load_state_dict`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Command-line names of the KV cache dtypes the demo accepts.
KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# Command-line names of the model (activation and weight) dtypes.
MODEL_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 like HF's ``LlamaRMSNorm``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with one position id per token (HF's rotate-half convention)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, 1, D] (broadcast over heads)
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] rotated by the per-token angles."""
    return x * cos + _rotate_half(x) * sin


class PagedAttention(nn.Module):
    """GQA self-attention over a paged KV cache; ``layer`` selects this layer's slice of the cache."""

    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin, kv_cache, input_row_offsets, cache_lengths, lookup_table):
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        kv_cache.store(self.layer, k, v, input_row_offsets, cache_lengths, lookup_table)
        out = kv_cache.attention(self.layer, q, input_row_offsets, cache_lengths, lookup_table)  # [T, Hq, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim).to(x.dtype))


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin, kv_cache, input_row_offsets, cache_lengths, lookup_table):
        x = x + self.self_attn(
            self.input_layernorm(x), cos, sin, kv_cache, input_row_offsets, cache_lengths, lookup_table
        )
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Embeddings, decoder layers and final norm (HF's ``LlamaModel``, named ``model.*``)."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, layer) for layer in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)


class LlamaPagedModel(nn.Module):
    """Causal LM over ragged batches with a paged KV cache (see the module docstring).

    ``kv_cache`` is any object with the ``store`` / ``attention`` methods of
    ``pagedkv.PagedKVCacheCollection``; it can be given here or assigned to ``model.kv_cache`` later.
    """

    def __init__(self, config, kv_cache=None):
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_cache = kv_cache

    @classmethod
    def from_state_dict(cls, config, state_dict, dtype=torch.float32, device="cpu", kv_cache=None):
        """Build on ``device`` and load HF-named weights (missing ``lm_head`` is fine when tied)."""
        with torch.device("meta"):
            model = cls(config, kv_cache=kv_cache)
        model = model.to_empty(device=device)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - allowed_missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model = model.to(dtype=dtype).eval()
        # The rotary frequencies are not in the state dict, and stay float32 whatever the model dtype.
        model.model.rotary = RotaryEmbedding(config.head_dim, config.rope_theta).to(device)
        return model

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        input_row_offsets: torch.Tensor,
        cache_lengths: torch.Tensor,
        lookup_table: torch.Tensor,
        return_all_logits: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One step over a ragged batch.

        tokens [T] int64, positions [T] (position id of each token), input_row_offsets int32 [B+1],
        cache_lengths int32 [B], lookup_table int32 [B, max_pages] (on the cache's device).
        Returns float32 logits of each row's last new token [B, vocab]; with ``return_all_logits``
        also the logits of every token [T, vocab]. Each row must have at least one new token.
        """
        if self.kv_cache is None:
            raise RuntimeError("LlamaPagedModel has no kv_cache: pass one or set model.kv_cache")
        body = self.model
        x = body.embed_tokens(tokens)  # [T, hidden]
        cos, sin = body.rotary(positions, x.dtype)
        for layer in body.layers:
            x = layer(x, cos, sin, self.kv_cache, input_row_offsets, cache_lengths, lookup_table)
        num_rows = cache_lengths.shape[0]
        last_rows = input_row_offsets[1 : num_rows + 1].long() - 1  # [B]
        if return_all_logits:
            all_logits = self.lm_head(body.norm(x)).float()  # [T, vocab]
            return all_logits[last_rows], all_logits
        return self.lm_head(body.norm(x[last_rows])).float()  # [B, vocab]


def make_kv_cache(config, num_pages: int, page_size: int, kv_dtype: str | torch.dtype = "fp32", device="cpu"):
    """A ``pagedkv.PagedKVCacheCollection`` sized for ``config``; ``kv_dtype`` is a ``KV_DTYPES`` key."""
    import pagedkv

    if isinstance(kv_dtype, str) and kv_dtype not in KV_DTYPES:
        # A bare KeyError 'fp8' named neither the argument nor the accepted names.
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} or a torch.dtype, got {kv_dtype!r}")
    dtype = KV_DTYPES[kv_dtype] if isinstance(kv_dtype, str) else kv_dtype
    return pagedkv.PagedKVCacheCollection(
        num_pages,
        config.num_hidden_layers,
        page_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )
