"""pagedkv: paged KV-cache operators for PyTorch.

Importing the package registers torch.ops.pagedkv.{paged_store, paged_load,
flash_attn_paged}; the functions below are typed wrappers of the same ops.
"""

from . import memory, reference
from .cache import (
    ContinuousBatchingKVCache,
    KVCacheBatch,
    PagedKVCache,
    PagedKVCacheCollection,
    PagedKVCacheFA3Fallback,
)
from .page_manager import OutOfPagesError, PageManager, copy_pages
from .ops import (
    checks_enabled,
    flash_attn_paged,
    flash_attn_paged_lse,
    flash_attn_paged_sparse,
    merge_attn_states,
    paged_load,
    paged_store,
    set_checks,
)
from .cascade import cascade_attention

__version__ = "0.1.0"

__all__ = [
    "paged_store",
    "paged_load",
    "flash_attn_paged",
    "flash_attn_paged_lse",
    "merge_attn_states",
    "flash_attn_paged_sparse",
    "cascade_attention",
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
]
