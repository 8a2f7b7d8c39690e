"""pagedkv: paged KV-cache operators for PyTorch.

Importing the package registers torch.ops.pagedkv.{paged_store, paged_load,
flash_attn_paged}; the functions below are typed wrappers of the same ops.
"""

# First: an extension built for another torch fails here with how to rebuild, not with an undefined symbol.
from .build_report import build_info, check_build as _check_build

_check_build()

import importlib  # noqa: E402

from . import host_alloc  # noqa: E402
from .cache import (  # noqa: E402
    ContinuousBatchingKVCache,
    KVCacheBatch,
    PagedKVCache,
    PagedKVCacheCollection,
    PagedKVCacheFA3Fallback,
    PagedMLACache,
)
from .page_manager import OutOfPagesError, PageManager, copy_pages  # noqa: E402
from .ops import (  # noqa: E402
    checks_enabled,
    flash_attn_paged,
    flash_attn_paged_lse,
    flash_attn_paged_sparse,
    merge_attn_states,
    paged_load,
    kernel_options,
    paged_store,
    set_checks,
    set_kernel_options,
)
from .cascade import cascade_attention  # noqa: E402

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
    "set_kernel_options",
    "kernel_options",
    "reference",
    "host_alloc",
    "PagedKVCacheCollection",
    "PagedKVCacheFA3Fallback",
    "PagedKVCache",
    "ContinuousBatchingKVCache",
    "PagedMLACache",
    "KVCacheBatch",
    "PageManager",
    "OutOfPagesError",
    "copy_pages",
    "build_info",
]


def __getattr__(name: str):
    # pagedkv.reference is the test oracle, not part of the library: it is imported on first use
    # (pagedkv.reference.X after `import pagedkv`), never by the library itself (PEP 562).
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
