"""pagedkv: paged KV-cache operators for PyTorch.

Importing the package registers torch.ops.pagedkv.{paged_store, paged_load,
flash_attn_paged}; the functions below are typed wrappers of the same ops.
"""

# First: an extension built for another torch fails here with how to rebuild, not with an undefined symbol.
from .build_report import build_info, check_build as _check_build

_check_build()

from . import memory, reference  # noqa: E402
from .cache import (  # noqa: E402
    ContinuousBatchingKVCache,
    KVCacheBatch,
    PagedKVCache,
    PagedKVCacheCollection,
    PagedKVCacheFA3Fallback,
)
from .page_manager import OutOfPagesError, PageManager, copy_pages  # noqa: E402
from .ops import checks_enabled, flash_attn_paged, paged_load, paged_store, set_checks  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "paged_store",
    "paged_load",
    "flash_attn_paged",
    "set_checks",
    "checks_enabled",
    "reference",
    "memory",
    "PagedKVCacheCollection",
    "PagedKVCacheFA3Fallback",
    "PagedKVCache",
    "ContinuousBatchingKVCache",
    "KVCacheBatch",
    "PageManager",
    "OutOfPagesError",
    "copy_pages",
    "build_info",
]
