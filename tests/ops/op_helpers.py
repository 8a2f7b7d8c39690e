"""What the tests/ops files share, in one line: ``from op_helpers import *``.

pagedkv, its compiled library (``_C``) and its reference (``ref``); from conftest the devices, dtypes,
layouts, seeded data, cache builders and tolerances; the case builders of grid_cases (the grids and
opcheck), error_cases (the error cases) and fuzz_cases / fuzz_op_cases (the seeded fuzz chunks).
Each test file keeps its own standard-library, pytest and torch imports.
"""

from __future__ import annotations

import pagedkv
from conftest import (
    CACHE_DTYPES,
    CUDA_ONLY,
    DEVICES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    LAYOUTS,
    assert_attention_close,
    assert_bytes_equal,
    assert_lse_close,
    dtype_name,
    effective_q_dtype,
    fill_history,
    generator,
    make_paged_kv,
    make_setup,
    poison_,
    ragged_inputs,
    randn,
    rising_scores,
    seed_from,
    strided_index_tensors,
    supported_or_skip,
)
from error_cases import D, G, HK, P, _with, expect_error, ids, index_errors, set_, setup_call, strided_last
from fuzz_cases import CHUNKS
from fuzz_op_cases import cases_for, chunks, run_chunk
from grid_cases import (
    GQA_RATIOS,
    HEAD_DIMS,
    NUM_KV_HEADS,
    OPCHECK_DTYPES,
    PAGE_SIZES,
    QUANT_GROUPS,
    RANDOM_SAMPLES,
    STORE_HEAD_DIMS,
    build_cases,
    case_id,
    normalize,
    opcheck,
    params,
    rows_for,
    small_setup,
)
from pagedkv import _C
from pagedkv import reference as ref

__all__ = [
    # pagedkv
    "pagedkv", "_C", "ref",
    # conftest
    "CACHE_DTYPES", "CUDA_ONLY", "DEVICES", "FLOAT_DTYPES", "FP8_DTYPES", "LAYOUTS",
    "assert_attention_close", "assert_bytes_equal", "assert_lse_close", "dtype_name", "effective_q_dtype",
    "fill_history",
    "generator", "make_paged_kv", "make_setup", "poison_", "ragged_inputs", "randn", "rising_scores", "seed_from",
    "strided_index_tensors", "supported_or_skip",
    # error_cases
    "D", "G", "HK", "P", "_with", "expect_error", "ids", "index_errors", "set_", "setup_call", "strided_last",
    # fuzz_cases, fuzz_op_cases
    "CHUNKS", "cases_for", "chunks", "run_chunk",
    # grid_cases
    "GQA_RATIOS", "HEAD_DIMS", "NUM_KV_HEADS", "OPCHECK_DTYPES", "PAGE_SIZES", "QUANT_GROUPS", "RANDOM_SAMPLES",
    "STORE_HEAD_DIMS", "build_cases", "case_id", "normalize", "opcheck", "params", "rows_for", "small_setup",
]  # fmt: skip
