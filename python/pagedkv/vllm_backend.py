"""The vLLM attention backend, its metadata builder and implementation over pagedkv's ops.

vLLM imports this module when it resolves the class path that ``pagedkv.vllm.register`` records
(see that module for the switch and the mapping of vLLM's cache and metadata onto CONTRACT.md); the
two modules do not import each other (shared names: ``pagedkv.vllm_settings``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from .ops import flash_attn_paged, paged_store
from .vllm_settings import ENABLE_VARIABLE, MAX_BLOCK_SIZE

# vLLM configures handlers for its own logger tree only, so the messages go through a child of it.
logger = init_logger(f"vllm.{__name__}")

NOT_SUPPORTED_HINT = f"unset {ENABLE_VARIABLE} to run vLLM's own attention backend"


class PagedKVAttentionBackend(AttentionBackend):
    # forward() stores this step's K/V itself (paged_store), then attends.
    forward_includes_kv_cache_update: bool = True

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        # vLLM maps a layer's backend back to its enum member by this name; on CPU the class
        # stands in for CPU_ATTN, on CUDA it is the CUSTOM backend.
        from vllm.platforms import current_platform

        return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["PagedKVAttentionImpl"]:
        return PagedKVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["PagedKVMetadataBuilder"]:
        return PagedKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supports_block_size(cls, block_size: Optional[int]) -> bool:
        return block_size is None or 1 <= block_size <= MAX_BLOCK_SIZE

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Token-major pages first: a token's heads sit side by side, so the CPU kernels prefetch one span
        # per key for all of an item's heads. Head-major pages (vLLM's CPU layout, block_size * (D + Dv)
        # elements between a token's heads) give the same results; the bf16 dot decode prefetches a head's
        # page block there as one span (0.89-1.06x the token-major time, SmolLM2 shapes, B=16 L=8192, 1-2
        # threads, Zen 4), the other CPU paths one row per head (float32 ~1.08x).
        return (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclasses.dataclass
class PagedKVMetadata:
    """One step's batch in pagedkv's terms (CONTRACT.md), shared by every layer of a group."""

    num_actual_tokens: int
    input_row_offsets: torch.Tensor  # int32 [B+1]
    cache_lengths: torch.Tensor  # int32 [B], tokens cached before this step
    lookup_table: torch.Tensor  # int32 [B, max_pages]
    causal: bool


class PagedKVMetadataBuilder(AttentionMetadataBuilder[PagedKVMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PagedKVMetadata:
        common = common_attn_metadata
        if isinstance(common.causal, torch.Tensor):
            raise NotImplementedError(
                f"pagedkv attention backend: per-request causal masks are not supported; {NOT_SUPPORTED_HINT}"
            )
        rows = common.num_reqs
        offsets = common.query_start_loc[: rows + 1].to(torch.int32)
        query_lengths = offsets[1:] - offsets[:-1]
        cache_lengths = (common.seq_lens[:rows] - query_lengths).to(torch.int32)
        lookup_table = common.block_table_tensor[:rows].to(torch.int32)
        return PagedKVMetadata(
            num_actual_tokens=common.num_actual_tokens,
            input_row_offsets=offsets,
            cache_lengths=cache_lengths,
            lookup_table=lookup_table,
            causal=bool(common.causal),
        )


class PagedKVAttentionImpl(AttentionImpl[PagedKVMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Optional[list[float]] = None,
        sliding_window: Optional[int] = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
        sinks: Optional[torch.Tensor] = None,
        **unsupported,
    ) -> None:
        refusals = []
        if attn_type != AttentionType.DECODER:
            refusals.append(f"attn_type must be {AttentionType.DECODER.value!r}, got {str(attn_type)!r}")
        if alibi_slopes is not None:
            refusals.append("ALiBi slopes are not supported")
        if sinks is not None:
            refusals.append("attention sinks are not supported")
        if kv_cache_dtype not in PagedKVAttentionBackend.supported_kv_cache_dtypes:
            refusals.append(
                f"kv_cache_dtype must be one of {PagedKVAttentionBackend.supported_kv_cache_dtypes}, got "
                f"{kv_cache_dtype!r} (FP8 KV caches are not supported yet: pagedkv's per-token scales are "
                "not in vLLM's cache spec)"
            )
        if unsupported:
            refusals.append(f"unsupported arguments {sorted(unsupported)}")
        if refusals:
            raise NotImplementedError(f"pagedkv attention backend: {'; '.join(refusals)}; {NOT_SUPPORTED_HINT}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        # vLLM's window counts the query's own token: keys p - (W - 1) .. p are visible.
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.softcap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        logger.info_once("Using pagedkv attention backend (pagedkv.flash_attn_paged over vLLM's paged KV cache)")

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,  # [T, Hq, D]
        key: Optional[torch.Tensor],  # [T, Hk, D]
        value: Optional[torch.Tensor],  # [T, Hk, Dv]
        kv_cache: torch.Tensor,  # [num_blocks, Hk, block_size, D + Dv]
        attn_metadata: Optional[PagedKVMetadata],
        output: torch.Tensor,  # [T, Hq, Dv]
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"pagedkv attention backend: fused output quantization is not supported; "
                                      f"{NOT_SUPPORTED_HINT}")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output
        k_cache, v_cache = self.cache_views(kv_cache)
        meta = attn_metadata
        # A layer that shares another layer's cache reads it; that layer already stored this step.
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            paged_store(key, value, k_cache, v_cache, meta.input_row_offsets, meta.cache_lengths, meta.lookup_table)
        # Rows past input_row_offsets[B] are vLLM's padding: pagedkv writes zeros there.
        flash_attn_paged(query, meta.input_row_offsets, k_cache, v_cache, meta.cache_lengths, meta.lookup_table,
                         scale=self.scale, causal=meta.causal, window_left=self.window_left, softcap=self.softcap,
                         out=output)
        return output

    def cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's ``[num_blocks, Hk, P, D + Dv]`` layer cache as pagedkv's two ``[N, P, Hk, D]`` views."""
        key_size = self.head_size
        return kv_cache[..., :key_size].transpose(1, 2), kv_cache[..., key_size:].transpose(1, 2)
