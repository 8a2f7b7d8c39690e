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

# vLLM's FP8 KV cache dtypes and the format of their bytes: vLLM allocates these caches as uint8 (one
# code a byte) and scales them per tensor (the layer's k_scale / v_scale: CONTRACT.md v1.2).
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class PagedKVAttentionBackend(AttentionBackend):
    # forward() stores this step's K/V itself (paged_store), then attends.
    forward_includes_kv_cache_update: bool = True

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES]

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
        # elements between a token's heads) give the same results and about the same speed: the bf16 dot
        # decode prefetches a head's page block there as one span, the other CPU paths one row per head
        # (measured: benchmarks/README.md, "Measurements behind the CPU kernels").
        return (KVCacheLayout.LBNHC, KVCacheLayout.BLNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
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
        # vLLM's CUDA platform checks supports_block_size when it picks a backend; its CPU platform never asks,
        # and builds this builder (at engine start, with the pages' real size) whatever --block-size says.
        block_size = kv_cache_spec.block_size
        if not PagedKVAttentionBackend.supports_block_size(block_size):
            raise NotImplementedError(
                f"pagedkv attention backend: block_size must be 1..{MAX_BLOCK_SIZE}, got {block_size}; "
                f"{NOT_SUPPORTED_HINT}")
        if vllm_config is not None:
            # vLLM builds this after loading the weights, so a checkpoint's FP8 scales are known: refuse the ones
            # forward cannot take (per-head k_scale / v_scale) now rather than at the first request.
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention import Attention

            for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values():
                if isinstance(layer.impl, PagedKVAttentionImpl):
                    layer.impl.fp8_scales(layer)

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
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            refusals.append(f"sinks must hold one value per query head, shape ({num_heads},), got "
                            f"{tuple(sinks.shape)}")
        if kv_cache_dtype not in PagedKVAttentionBackend.supported_kv_cache_dtypes:
            refusals.append(
                f"kv_cache_dtype must be one of {PagedKVAttentionBackend.supported_kv_cache_dtypes}, got "
                f"{kv_cache_dtype!r} (FP8 caches: one scale per tensor, vLLM's k_scale / v_scale)"
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
        self.check_configuration()
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
        # The model's parameter, filled when vLLM loads the weights (after this runs): read at each forward.
        self.sinks = sinks
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
        k_scale, v_scale = self.fp8_scales(layer)
        meta = attn_metadata
        # Everything the attention call could refuse is checked before the store writes the cache: a step
        # that raises leaves the cache as it was.
        self.check_step(query, output, v_cache)
        # A layer that shares another layer's cache reads it; that layer already stored this step.
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            self.store(key, value, k_cache, v_cache, k_scale, v_scale, meta)
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()  # pagedkv takes float32 sinks; [Hq] values, converted each step
        # Rows past input_row_offsets[B] are vLLM's padding: pagedkv writes zeros there.
        flash_attn_paged(query, meta.input_row_offsets, k_cache, v_cache, meta.cache_lengths, meta.lookup_table,
                         scale=self.scale, causal=meta.causal, k_scales=k_scale, v_scales=v_scale,
                         window_left=self.window_left, softcap=self.softcap, sinks=sinks, out=output)
        return output

    def check_configuration(self) -> None:
        """Refuse at engine start what flash_attn_paged would refuse at every step (heads that do not group,
        a softcap out of range, ...): one token over a one-page cache, with this layer's heads, sizes,
        scale, window and softcap, asks the ops' own checks."""
        # float32 on the CPU whatever vLLM's default device and dtype are while it builds the model: the checks
        # are the core's, shared by every device
        cpu = torch.device("cpu")
        query = torch.zeros(1, self.num_heads, self.head_size, dtype=torch.float32, device=cpu)
        cache = torch.zeros(1, 1, self.num_kv_heads, self.head_size, dtype=torch.float32, device=cpu)
        one_row = torch.tensor([0, 1], dtype=torch.int32, device=cpu)
        first_page = torch.zeros(1, 1, dtype=torch.int32, device=cpu)
        try:
            flash_attn_paged(query, one_row, cache, cache, one_row[:1], first_page,
                             scale=self.scale, window_left=self.window_left, softcap=self.softcap)
        except (RuntimeError, TypeError, ValueError) as error:
            raise NotImplementedError(f"pagedkv attention backend: this layer's attention is refused: {error}; "
                                      f"{NOT_SUPPORTED_HINT}") from error

    def check_step(self, query: torch.Tensor, output: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The step's query and output buffer as this layer attends: query [T, Hq, D], output [T, Hq, Dv] in the
        query's dtype (what flash_attn_paged writes into)."""
        expected_query = (self.num_heads, self.head_size)
        if query.dim() != 3 or tuple(query.shape[1:]) != expected_query:
            raise ValueError(f"pagedkv attention backend: query must be [T, {self.num_heads}, {self.head_size}], "
                             f"got {list(query.shape)}")
        expected_output = (query.size(0), self.num_heads, v_cache.size(-1))
        if tuple(output.shape) != expected_output or output.dtype != query.dtype:
            raise ValueError(f"pagedkv attention backend: output must be {list(expected_output)} {query.dtype} "
                             f"(query's rows and dtype, the cache's value size), got {list(output.shape)} "
                             f"{output.dtype}")

    def store(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor], meta: PagedKVMetadata) -> None:
        """This step's K/V into the cache, as vLLM's own backend on this platform writes them."""
        rows = (meta.input_row_offsets, meta.cache_lengths, meta.lookup_table)
        if k_scale is None or k_cache.device.type != "cpu":
            # 16-bit caches; FP8 off CPU: fp8(clamp(x / s)) rounded to nearest even, as vLLM's CUDA writer does
            paged_store(key, value, k_cache, v_cache, *rows, k_scale, v_scale)
            return
        # vLLM's CPU writer rounds toward zero (csrc/cpu/vllm_cpu_fp8.c has its rule). paged_store with a scale
        # of one stores values that already are codes unchanged, so the cache holds the codes vLLM's own CPU
        # backend would hold.
        one = torch.ones((), dtype=torch.float32, device=k_cache.device)
        codes = torch.ops.pagedkv._vllm_cpu_fp8_values
        paged_store(codes(key, k_scale, self.fp8_dtype), codes(value, v_scale, self.fp8_dtype), k_cache, v_cache,
                    *rows, one, one)

    def fp8_scales(self, layer: AttentionLayer) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The layer's per-tensor k_scale / v_scale (one float32 element each) for an FP8 cache, else None."""
        if self.fp8_dtype is None:
            return None, None
        k_scale, v_scale = layer._k_scale, layer._v_scale
        if k_scale.numel() != 1 or v_scale.numel() != 1:
            raise NotImplementedError(
                f"pagedkv attention backend: FP8 KV caches take one k_scale and one v_scale per layer, got "
                f"k_scale of shape {tuple(k_scale.shape)} and v_scale of shape {tuple(v_scale.shape)} (per-head "
                f"scales); {NOT_SUPPORTED_HINT}")
        return k_scale.float(), v_scale.float()

    def cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's ``[num_blocks, Hk, P, D + Dv]`` layer cache as pagedkv's two ``[N, P, Hk, D]`` views.

        FP8 caches, which vLLM allocates as uint8, are viewed as their FP8 format (same bytes, no copy).
        """
        if self.fp8_dtype is not None and kv_cache.dtype != self.fp8_dtype:
            if kv_cache.element_size() != 1:
                raise TypeError(f"pagedkv attention backend: kv_cache_dtype {self.kv_cache_dtype!r} needs a cache of "
                                f"one-byte elements, got {kv_cache.dtype}")
            kv_cache = kv_cache.view(self.fp8_dtype)
        key_size = self.head_size
        return kv_cache[..., :key_size].transpose(1, 2), kv_cache[..., key_size:].transpose(1, 2)
