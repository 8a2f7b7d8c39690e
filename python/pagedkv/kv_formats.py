"""The packed KV row formats of CONTRACT v1.2 (the ops' `kv_format` argument): byte layout and sizes.

A packed cache is uint8 `[N, P, 1, row_bytes]`, one row per token holding a DeepSeek MLA key:

| format       | row bytes | [0, 512)    | then                                                          |
|--------------|-----------|-------------|---------------------------------------------------------------|
| `fp8_ds_mla` | 656       | e4m3 latent | [512, 528) four float32 scales (one per 128 latent channels), |
|              |           |             | [528, 656) 64 bfloat16 rope                                   |
| `fp8_rope`   | 640       | e4m3 latent | [512, 640) 64 bfloat16 rope; the latent's scale is `k_scales` |
|              |           |             | (one per-tensor float32 element)                              |

Logical key (D = 576) = concat(latent * scale, rope); logical value (Dv = 512) = the dequantized
latent. Shared by the ops' wrappers and fakes (output sizes), the cache objects (pool shapes) and
pagedkv.reference (packing), as dtypes.py is for the FP8 dtypes.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LATENT_DIM", "ROPE_DIM", "KEY_DIM", "DS_MLA_GROUP", "PackedRow", "KV_FORMATS", "packed_row",
           "kv_format_row"]

LATENT_DIM = 512  # e4m3 latent channels: the logical value (Dv)
ROPE_DIM = 64  # bfloat16 rope channels after the latent in the logical key
KEY_DIM = LATENT_DIM + ROPE_DIM  # the logical key (D)
DS_MLA_GROUP = 128  # latent channels per float32 scale of an fp8_ds_mla row


@dataclasses.dataclass(frozen=True)
class PackedRow:
    """Where the parts of one packed token row lie, in bytes."""

    name: str
    row_bytes: int
    scales_offset: int | None  # the float32 group scales; None: one per-tensor scale (k_scales)
    rope_offset: int  # the bfloat16 rope

    @property
    def per_tensor_scale(self) -> bool:
        return self.scales_offset is None


KV_FORMATS = {
    "fp8_ds_mla": PackedRow("fp8_ds_mla", row_bytes=656, scales_offset=LATENT_DIM, rope_offset=528),
    "fp8_rope": PackedRow("fp8_rope", row_bytes=640, scales_offset=None, rope_offset=LATENT_DIM),
}


_NAMES = "None, " + " or ".join(repr(name) for name in KV_FORMATS)


def kv_format_row(kv_format, op: str = "") -> PackedRow | None:
    """The one reading of a `kv_format` argument (every op wrapper, the cache objects, the reference):
    the row layout of a packed format, None for None and for a str naming no format (the op refuses
    that name itself, naming kv_format). Anything but None or a str raises TypeError naming kv_format
    and its type: torch's schema parser would read bytes as the name and report a list by position."""
    if kv_format is None:
        return None
    if not isinstance(kv_format, str):
        prefix = f"{op}: " if op else ""
        raise TypeError(f"{prefix}kv_format must be {_NAMES} (a str), got {type(kv_format).__name__} {kv_format!r}")
    return KV_FORMATS.get(kv_format)


def packed_row(kv_format: str | None) -> PackedRow | None:
    """The row layout of `kv_format`; None for None (a plain cache). Another name raises ValueError,
    another type TypeError, each naming kv_format."""
    layout = kv_format_row(kv_format)
    if kv_format is not None and layout is None:
        raise ValueError(f"kv_format must be {_NAMES}, got {kv_format!r}")
    return layout
