"""The parameter grids of the op tests: axes, case generation and ids, shared by tests/ops/test_<op>.py.

Grids: every axis varied alone around a base case, a few axes fully crossed where cheap, plus a
seeded random sample of the full product (`build_cases`). Each op file declares its axes and base
case and runs every case on every device of conftest.DEVICES.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from conftest import FP8_DTYPES, dtype_name, fill_history, generator, make_setup, seed_from

HEAD_DIMS = (64, 80, 96, 128, 256)
STORE_HEAD_DIMS = HEAD_DIMS + (576,)
PAGE_SIZES = (1, 2, 16, 64, 256)
GQA_RATIOS = (1, 4, 8)
QUANT_GROUPS = (128, 32, 64)
NUM_KV_HEADS = 2
RANDOM_SAMPLES = 40


def rows_for(page_size):
    """(cache_length, new_tokens) per row: prefill, decode, zero new tokens, empty, chunked
    prefill, and a chunk crossing a page boundary deep in the sequence."""
    return [(0, 5), (37, 1), (20, 0), (0, 0), (9, 12), (2 * page_size - 2, 4)]


# ---------------------------------------------------------------------------------------------
# Case generation


def normalize(case):
    """Drop combinations that do not exist and collapse axes that do not matter."""
    case = dict(case)
    fp8 = case["cache_dtype"] in FP8_DTYPES
    if not fp8 or (case["quant_group"] != 128 and case["quant_group"] >= case["head_dim"]):
        case["quant_group"] = 128
    if case["layout"] == "continuous":
        case["page_size"] = 16  # the slot length is derived from the rows
    return case


def build_cases(base, axes, crosses, samples, seed, keep=lambda c: True):
    cases, seen = [], set()

    def add(case):
        case = normalize(case)
        key = tuple(sorted((k, str(v)) for k, v in case.items()))
        if keep(case) and key not in seen:
            seen.add(key)
            cases.append(case)

    add(base)
    for name, values in axes.items():
        for v in values:
            add({**base, name: v})
    for names in crosses:
        for combo in itertools.product(*(axes[n] for n in names)):
            add({**base, **dict(zip(names, combo))})
    rnd = random.Random(seed)
    for _ in range(samples):
        add({name: rnd.choice(values) for name, values in axes.items()})
    return cases


def short(v):
    if isinstance(v, torch.dtype):
        return (
            dtype_name(v).replace("float", "f").replace("bf16", "bf16").replace("8_e4m3fn", "8e4m3")
            .replace("8_e5m2", "8e5m2")
        )
    return str(v)


def case_id(case):
    return "-".join(f"{k[:2]}{short(v)}" for k, v in case.items())


def params(cases):
    return [pytest.param(c, id=case_id(c)) for c in cases]


# ---------------------------------------------------------------------------------------------
# opcheck: every op's registration check (schema, fake kernel, autograd) runs on this setup


def small_setup(device, dtype):
    gen = generator(seed_from("opcheck", str(dtype)))
    kv, batch = make_setup(gen, [(3, 4), (0, 0), (6, 1)], layout="collection", page_size=4,
                           num_kv_heads=2, head_dim=32, dtype=dtype, quant_group=16, padding=1,
                           device=device)
    fill_history(gen, kv, batch)
    return gen, kv, batch


# torch's schema checker compares tensors with arithmetic that FP8 lacks on CPU
# ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn); FP8 runs the other checks.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
OPCHECK_DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


def opcheck(op, args, kwargs=None, *, cache_dtype):
    utils = FP8_OPCHECK_UTILS if cache_dtype in FP8_DTYPES else "ALL"
    torch.library.opcheck(op, args, kwargs, test_utils=utils)

