"""Argument checks of the Python entry points that read tensors before an op does (the convenience
wrappers, cascade_attention, the cache objects, the reference): in the core checker's words
(csrc/core/pkv_check.c), each message naming the argument, so that bad input never reaches torch's
own errors (a broadcast error, an IndexError, "Cannot copy out of meta tensor") that name nothing.
Pure torch: the reference uses it without the compiled extension's ops."""

from __future__ import annotations

import torch

__all__ = ["check_tensor", "check_index_tensors", "check_host_readable"]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(op: str, name: str, value, dims: int, shape: str, *, dtype: torch.dtype | None = None,
                 device: torch.device | None = None, device_ref: str = "") -> torch.Tensor:
    """`value` must be a tensor (TypeError), of `dims` dims (`shape` names them), of `dtype` and on
    `device` (ValueError). Returns it."""
    prefix = f"{op}: " if op else ""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{prefix}{name} must be a {dims}-D tensor {shape}, got {type(value).__name__}")
    if value.dim() != dims:
        raise ValueError(f"{prefix}{name} must be {dims}-D {shape}, got {value.dim()}-D")
    if dtype is not None and value.dtype != dtype:
        raise ValueError(f"{prefix}{name} must be {_name(dtype)}, got {_name(value.dtype)}")
    if device is not None and value.device != device:
        raise ValueError(f"{prefix}{name} must be on the same device as {device_ref} ({device}), got {value.device}")
    return value


def check_index_tensors(op: str, offsets_name: str, offsets, lengths_name: str, lengths, lookup_table,
                        device: torch.device, device_ref: str, *, offsets_sizes: str = "B+1") -> None:
    """offsets int32 [B+1] (offsets_sizes "B or B+1": paged_load's output_row_offsets), lengths int32
    [B], lookup_table int32 [B, max_pages], all on `device`: the core's check_index_tensors."""
    prefix = f"{op}: " if op else ""
    check_tensor(op, "lookup_table", lookup_table, 2, "[B, max_pages]", dtype=torch.int32, device=device,
                 device_ref=device_ref)
    check_tensor(op, lengths_name, lengths, 1, "[B]", dtype=torch.int32, device=device, device_ref=device_ref)
    check_tensor(op, offsets_name, offsets, 1, f"[{offsets_sizes}]", dtype=torch.int32, device=device,
                 device_ref=device_ref)
    batch = lengths.size(0)
    if lookup_table.size(0) != batch:
        raise ValueError(f"{prefix}lookup_table.size(0) must be {batch} (B, the length of {lengths_name}), got "
                         f"{lookup_table.size(0)}")
    allowed = (batch, batch + 1) if offsets_sizes == "B or B+1" else (batch + 1,)
    if offsets.size(0) not in allowed:
        raise ValueError(f"{prefix}{offsets_name}.size(0) must be {offsets_sizes} (B = {batch} rows of {lengths_name}), "
                         f"got {offsets.size(0)}")


def check_host_readable(op: str, **tensors) -> None:
    """Tensors whose values are read on the host must hold values: a meta tensor raises ValueError
    naming it (torch's "Cannot copy out of meta tensor" names nothing)."""
    prefix = f"{op}: " if op else ""
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise ValueError(f"{prefix}{name} must hold values (they are read on the host), got a meta tensor")
