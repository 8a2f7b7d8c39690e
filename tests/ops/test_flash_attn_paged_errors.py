"""flash_attn_paged's bad input on every device: each error case raises a RuntimeError naming the
argument and writes nothing (error_cases.expect_error), for the op and its .out variant and for
tensors on mixed devices; then the seeded fuzz chunks (scripts/test.sh also runs the `per_isa`
tests on every CPU kernel path) and the rejections they rely on.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

pytestmark = pytest.mark.usefixtures("cuda_knobs")

# ---------------------------------------------------------------------------------------------
# errors


def attn_call(device, dtype=torch.float8_e4m3fn):
    gen, kv, batch = setup_call(device, dtype)
    args = dict(
        q=randn(gen, (batch.num_tokens, 2 * HK, D), torch.float32, device),
        input_row_offsets=batch.input_row_offsets, k_cache=kv.k_cache, v_cache=kv.v_cache,
        cache_lengths=batch.cache_lengths, lookup_table=batch.lookup_table, scale=None,
        causal=True, k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=G, window_left=-1,
        softcap=0.0,
    )
    return kv, args


ATTN_ERRORS = index_errors("input_row_offsets", "cache_lengths", "k_cache") + [
    ("cache_lengths negative", set_("cache_lengths", lambda t, a: _with(t, (1,), -1)),
     ["cache_lengths"], []),
    ("length past max_pages*P", set_("cache_lengths", lambda t, a: _with(t, (0,), 9)),
     ["cache_lengths", "lookup_table"], []),
    ("T < offsets[B]", set_("q", lambda t, a: t[:5]), ["input_row_offsets", "q"], []),
    ("q 2-D", set_("q", lambda t, a: t[:, 0]), ["q"], []),
    ("q float64", set_("q", lambda t, a: t.double()), ["q"], []),
    ("q int64", set_("q", lambda t, a: t.long()), ["q"], []),
    ("q fp8", set_("q", lambda t, a: t.to(torch.float8_e5m2)), ["q"], []),
    ("q head size", set_("q", lambda t, a: t[..., :16]), ["q"], []),
    ("Hq % Hk != 0", set_("q", lambda t, a: t[:, :3]), ["q"], []),
    ("q stride(-1) != 1", set_("q", lambda t, a: strided_last(t)), ["q"], []),
    ("k_cache 5-D", set_("k_cache", lambda t, a: t[None]), ["k_cache"], []),
    ("k_cache stride(-1) != 1", set_("k_cache", lambda t, a: strided_last(t)), ["k_cache"], []),
    ("v_cache stride(-1) != 1", set_("v_cache", lambda t, a: strided_last(t)), ["v_cache"], []),
    ("v_cache N mismatch", set_("v_cache", lambda t, a: t[:-1]), ["v_cache"], []),
    ("v_cache Hk mismatch", set_("v_cache", lambda t, a: t[:, :, :1]), ["v_cache"], []),
    ("v_cache dtype", set_("v_cache", lambda t, a: torch.zeros(t.shape, dtype=torch.int16,
                                                               device=t.device)), ["v_cache"], []),
    ("k_scales missing", set_("k_scales", lambda t, a: None), ["k_scales"], []),
    ("v_scales missing", set_("v_scales", lambda t, a: None), ["v_scales"], []),
    ("k_scales groups", set_("k_scales", lambda t, a: t[..., :1]), ["k_scales"], []),
    ("v_scales P", set_("v_scales", lambda t, a: t[:, :1]), ["v_scales"], []),
    ("quant_group 0", set_("quant_group", lambda t, a: 0), ["quant_group"], []),
    ("window_left -2", set_("window_left", lambda t, a: -2), ["window_left"], []),
    ("softcap negative", set_("softcap", lambda t, a: -1.0), ["softcap"], []),
    ("softcap nan", set_("softcap", lambda t, a: float("nan")), ["softcap"], []),
    ("scale nan", set_("scale", lambda t, a: float("nan")), ["scale"], []),
    ("scale inf", set_("scale", lambda t, a: float("inf")), ["scale"], []),
]

# each `out` is made on the call's device: a strided view moved with .to() would arrive contiguous
ATTN_OUT_ERRORS = [
    ("out dtype", lambda dev: torch.zeros((7, 4, D), dtype=torch.float16, device=dev), ["out"]),
    ("out tokens", lambda dev: torch.zeros((6, 4, D), device=dev), ["out"]),
    ("out heads", lambda dev: torch.zeros((7, 2, D), device=dev), ["out"]),
    ("out head size", lambda dev: torch.zeros((7, 4, 16), device=dev), ["out"]),
    ("out stride(-1) != 1", lambda dev: strided_last(torch.zeros((7, 4, D), device=dev)), ["out"]),
    ("out 2-D", lambda dev: torch.zeros((7, 4 * D), device=dev), ["out"]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_ERRORS, ids=ids(ATTN_ERRORS))
def test_flash_attn_paged_errors(device, case):
    _, mutate, names, fragments = case
    kv, args = attn_call(device)
    mutate(args, kv)
    expect_error(device, torch.ops.pagedkv.flash_attn_paged, kv, args, names, fragments)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_extra_scales(device):
    kv, args = attn_call(device, torch.float32)
    args["k_scales"] = torch.ones((kv.num_pages, P, HK, 2), device=device)
    expect_error(device, torch.ops.pagedkv.flash_attn_paged, kv, args, ["k_scales"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_OUT_ERRORS, ids=ids(ATTN_OUT_ERRORS))
def test_flash_attn_paged_out_errors(device, case):
    _, make_out, names = case
    kv, args = attn_call(device)
    args["out"] = make_out(device)
    expect_error(device, torch.ops.pagedkv.flash_attn_paged.out, kv, args, names)


@CUDA_ONLY
@pytest.mark.parametrize("moved", ["q", "lookup_table", "cache_lengths", "input_row_offsets",
                                   "v_cache", "v_scales"])
def test_flash_attn_paged_mixed_devices(moved):
    kv, args = attn_call("cuda")
    args[moved] = args[moved].cpu()
    expect_error("cuda", torch.ops.pagedkv.flash_attn_paged, kv, args, [moved, "device"])


# ---------------------------------------------------------------------------------------------
# seeded fuzz (CPU; scripts/test.sh also runs the `per_isa` tests on every CPU kernel path)


@pytest.mark.per_isa
@pytest.mark.parametrize("chunk", chunks("attn"))
def test_flash_attn_paged_fuzz(chunk):
    run_chunk("attn", chunk)


def test_flash_attn_paged_fuzz_chunks_run_every_case_once():
    seen = []
    for chunk in range(CHUNKS):
        run_chunk("attn", chunk, case=lambda op, index: seen.append((op, index)))
    assert seen == [("attn", i) for i in range(cases_for("attn"))]


@pytest.mark.per_isa
def test_flash_attn_paged_meta_argument_is_rejected_by_name():
    """A meta tensor among CPU tensors dispatches to the fake kernel, which must not succeed silently."""
    cache = torch.zeros((2, 2, 1, 4))
    index = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([[1]], dtype=torch.int32).to("meta"))
    with pytest.raises(RuntimeError, match="lookup_table must be on the same device"):
        pagedkv.flash_attn_paged(torch.ones((1, 1, 4)), index[0], cache, cache, index[1], index[2])
    assert cache.abs().sum() == 0


@pytest.mark.per_isa
def test_flash_attn_paged_infinite_softcap_is_rejected():
    cache = torch.ones((1, 1, 1, 4))
    index = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="softcap must be 0 .off. or in"):
        pagedkv.flash_attn_paged(torch.ones((1, 1, 4)), index[0], cache, cache, index[1],
                                 torch.tensor([[0]], dtype=torch.int32), softcap=math.inf)


# Float arguments the kernels cannot use as float32: refused by name with the value. 1e300 overflowed
# float32 (all-NaN outputs); a softcap of 1e-300 flushed to 0 and silently disabled the cap.
BAD_FLOATS = [("scale", 1e300), ("scale", -1e300), ("scale", 1e19), ("scale", math.nan), ("softcap", 1e300),
              ("softcap", 1e19), ("softcap", 1e-300), ("softcap", 1e-19), ("softcap", -1e-300)]


def _tiny_attention_call():
    cache = torch.ones((2, 2, 1, 8))
    index = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    return torch.ones((1, 2, 8)), index[0], cache, cache, index[1], torch.tensor([[1]], dtype=torch.int32)


@pytest.mark.per_isa
@pytest.mark.parametrize("name,value", BAD_FLOATS, ids=[f"{n}={v:g}" for n, v in BAD_FLOATS])
def test_float_arguments_outside_float32_are_refused(name, value):
    q, offsets, k_cache, v_cache, lengths, table = _tiny_attention_call()
    indices = torch.zeros((1, 1, 2), dtype=torch.int32)
    calls = {
        "flash_attn_paged": lambda **kw: pagedkv.flash_attn_paged(q, offsets, k_cache, v_cache, lengths, table, **kw),
        "flash_attn_paged_lse": lambda **kw: pagedkv.flash_attn_paged_lse(q, offsets, k_cache, v_cache, lengths,
                                                                          table, **kw),
        "flash_attn_paged_sparse": lambda **kw: pagedkv.flash_attn_paged_sparse(q, k_cache, v_cache, indices, **kw),
        "cascade": lambda **kw: pagedkv.cascade_attention(q, offsets, k_cache, v_cache, lengths + 2,
                                                          torch.tensor([[0, 1]], dtype=torch.int32), 1, **kw),
    }
    for op, call in calls.items():
        checker = "flash_attn_paged_sparse" if op.endswith("sparse") else "flash_attn_paged"  # lse, cascade too
        with pytest.raises(RuntimeError, match=f"^{checker}: {name} must .* got {re.escape(f'{value:g}')}"):
            call(**{name: value})


@pytest.mark.per_isa
@pytest.mark.parametrize("name,value", [("softcap", 1e-18), ("softcap", 1e18), ("scale", 1e-18), ("scale", -1e-30)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_float_arguments_at_the_limits_match_the_reference(dtype, name, value):
    gen = generator(seed_from("float limits", dtype_name(dtype), name, value))
    k_cache, v_cache = randn(gen, (3, 4, 1, 8), dtype), randn(gen, (3, 4, 1, 8), dtype)
    q = randn(gen, (3, 2, 8), dtype, scale=4.0)
    args = (q, torch.tensor([0, 3], dtype=torch.int32), k_cache, v_cache, torch.tensor([6], dtype=torch.int32),
            torch.tensor([[2, 0, 1]], dtype=torch.int32))
    got = pagedkv.flash_attn_paged(*args, **{name: value})
    expected = ref.flash_attn_paged(*args, **{name: value})
    assert_attention_close(got, expected, dtype, f"{name}={value:g}")
