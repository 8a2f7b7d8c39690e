"""The dtypes pagedkv stores and computes in, and the FP8 scale-group arithmetic.

Shared by the cache objects (what a cache may hold) and pagedkv.reference (how FP8 is quantized),
so the library does not import its test oracle for a dtype table.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_DTYPES", "FLOAT_DTYPES", "fp8_max", "is_fp8", "is_per_tensor_scale", "num_scale_groups"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype: 448 for e4m3fn, 57344 for e5m2."""
    if not is_fp8(dtype):
        raise ValueError(f"fp8_max: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


def num_scale_groups(head_dim: int, quant_group: int) -> int:
    """ceil(D / G): number of FP8 scales per (token, head)."""
    if quant_group < 1:
        raise ValueError(f"quant_group must be >= 1, got {quant_group}")
    return -(-head_dim // quant_group)


def is_per_tensor_scale(scales) -> bool:
    """Whether FP8 `scales` is one per-tensor scale (CONTRACT v1.2: one element, shape [] or [1]),
    not per-token scales [N, P, Hk, ceil(D/G)]."""
    return isinstance(scales, torch.Tensor) and scales.dim() <= 1 and scales.numel() == 1
