"""pagedkv as a vLLM attention backend (vLLM's engine, scheduler and server; pagedkv's kernels).

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in every one of its
processes. It changes nothing unless ``PAGEDKV_VLLM=1``; then vLLM's CPU attention backend
(``CPU_ATTN``, which vLLM's CPU platform always picks) and the ``CUSTOM`` backend (CUDA:
``--attention-backend CUSTOM``) resolve to ``PagedKVAttentionBackend``.

The backend keeps vLLM's cache format, one tensor per layer seen as ``[num_blocks, Hk, block_size,
D + Dv]`` (K and V of a head and token side by side), and hands pagedkv strided views of it:
``kv[..., :D].transpose(1, 2)`` is the ``[N, P, Hk, D]`` key cache of CONTRACT.md, so nothing is
copied. It asks vLLM for token-major pages (``KVCacheLayout.LBNHC``: memory ``[num_blocks,
block_size, Hk, D + Dv]``, a token's heads side by side, as pagedkv's kernels prefer); vLLM's own CPU
backend uses head-major pages, which pagedkv reads correctly but slower. vLLM's metadata maps one to one:

    input_row_offsets = query_start_loc[:B+1]
    cache_lengths     = seq_lens[:B] - diff(input_row_offsets)   (vLLM counts this step's tokens)
    lookup_table      = block_table[:B]

``forward`` stores this step's K/V (``paged_store``), then attends (``flash_attn_paged`` into
vLLM's output buffer), with the layer's attention sinks (gpt-oss) and, for FP8 caches (vLLM's uint8
bytes viewed as float8_e4m3fn / float8_e5m2, no copy), its per-tensor k_scale / v_scale. Decoder
attention only: encoder, encoder-only and cross attention, ALiBi and KV cache dtypes other than
16-bit and per-tensor-scaled FP8 are refused with an error that says how to run without pagedkv.
"""

from __future__ import annotations

import os

from .vllm_settings import BACKEND_CLASS_PATH, ENABLE_VARIABLE, MAX_BLOCK_SIZE

__all__ = ["BACKEND_CLASS_PATH", "ENABLE_VARIABLE", "MAX_BLOCK_SIZE", "enabled", "register"]


def enabled() -> bool:
    return os.environ.get(ENABLE_VARIABLE, "0") == "1"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: route vLLM's attention to pagedkv when opted in.

    Runs in every vLLM process (API server, engine core, workers), so it only records class
    paths; the backend module (and pagedkv's ops) load when vLLM resolves the class.
    """
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLASS_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)

