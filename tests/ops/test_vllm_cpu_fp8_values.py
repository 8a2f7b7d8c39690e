"""torch.ops.pagedkv._vllm_cpu_fp8_values, the vLLM backend's FP8 writer (csrc/cpu/vllm_cpu_fp8.c): the
values of the codes vLLM's CPU cache writer stores, bit for bit against that writer's rule written in torch
operations below (tests/vllm_integration compares the stored codes with vLLM's own writer byte for byte),
over every bfloat16 and float16 bit pattern, float32 edge values and random data, then paged_store of them
with a scale of one stores exactly those codes."""

import pytest
import torch

from op_helpers import *  # noqa: F401,F403

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


# Per FP8 format: the float32 bits a code keeps when truncating toward zero (3 or 2 of the 23 mantissa bits),
# and below the format's normal range (smallest normal value), the spacing of its subnormal codes.
FP8_TRUNCATION_MASK = {torch.float8_e4m3fn: ~((1 << 20) - 1), torch.float8_e5m2: ~((1 << 21) - 1)}
FP8_SUBNORMALS = {torch.float8_e4m3fn: (2.0**-6, 2.0**-9), torch.float8_e5m2: (2.0**-14, 2.0**-16)}
# vLLM's CPU writer takes e4m3 codes off v * 2^-120 as a float32: below e4m3's normal range that is a float32
# subnormal, which rounds v to nearest on this grid before the code truncates it
E4M3_SUBNORMAL_GRID = 2.0**-29


def vllm_cpu_fp8_reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The values of the codes vLLM's CPU cache writer (cpu_attn_reshape_and_cache) stores for x, in torch
    operations (float32, each exactly an FP8 value): x times the float32 reciprocal of the scale, NaN to
    +max, saturated to +-max, an exact zero +0, rounded toward zero. The backend ran this until the C
    writer replaced it, checked byte for byte against vLLM's writer by tests/vllm_integration."""
    limit = torch.finfo(fp8_dtype).max
    smallest_normal, spacing = FP8_SUBNORMALS[fp8_dtype]
    value = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True).mul_(1.0 / scale)
    value.nan_to_num_(nan=limit).clamp_(-limit, limit).add_(0.0)  # adding +0 turns an exact -0 into +0
    flat = value.view(-1)
    subnormal = torch.nonzero(flat.abs() < smallest_normal).squeeze(1)
    below = flat[subnormal]
    if fp8_dtype == torch.float8_e4m3fn:
        below = torch.round(below * (1.0 / E4M3_SUBNORMAL_GRID)).mul_(E4M3_SUBNORMAL_GRID)
    below = torch.trunc(below * (1.0 / spacing)).mul_(spacing)
    value.view(torch.int32).bitwise_and_(FP8_TRUNCATION_MASK[fp8_dtype])
    flat[subnormal] = below
    return value


def op(x, scale, fp8_dtype):
    return torch.ops.pagedkv._vllm_cpu_fp8_values(x, scale, fp8_dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.to(torch.float32).view(torch.int32), b.to(torch.float32).view(torch.int32))


def every_pattern(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


SCALES = [1.0, 0.05, 3.7, 2.0**-20, 1e4]


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
def test_every_16_bit_pattern_matches_the_writers_rule(fp8_dtype, dtype, scale):
    x = every_pattern(dtype)
    s = torch.tensor(scale, dtype=torch.float32)
    got = op(x, s, fp8_dtype)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert same_bits(got, vllm_cpu_fp8_reference(x, s, fp8_dtype))
    # each value is an FP8 value (bfloat16 holds it exactly): the cast to FP8 and back changes no bit
    assert same_bits(got.to(fp8_dtype).to(torch.bfloat16), got)


def float32_edges():
    tiny = [2.0**-e for e in range(1, 40)]
    near = []
    for v in tiny + [448.0, 57344.0, 464.0, 61440.0, 1.0, 3.0, 0.1]:  # around codes, ties and limits
        t = torch.tensor([v], dtype=torch.float32)
        near += [torch.nextafter(t, torch.tensor([0.0])).item(), v, torch.nextafter(t, torch.tensor([1e38])).item()]
    vals = torch.tensor(near + [0.0, float("inf"), float("nan"), 1e30, 3.4e38, 1.4e-45], dtype=torch.float32)
    return torch.cat([vals, -vals, torch.tensor([-0.0])])


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("scale", SCALES)
def test_float32_edges_and_random_values_match_the_writers_rule(fp8_dtype, scale):
    g = torch.Generator().manual_seed(7)
    random = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-30, 20, (4096,), generator=g).float())
    on_grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    on_grid = on_grid[torch.isfinite(on_grid)] * scale
    for x in (float32_edges(), random, on_grid):
        s = torch.tensor(scale, dtype=torch.float32)
        assert same_bits(op(x, s, fp8_dtype), vllm_cpu_fp8_reference(x, s, fp8_dtype))


def test_strided_and_empty_inputs():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(37, 3, 4, 16, generator=g, dtype=torch.float32).to(torch.bfloat16)
    key = qkv[:, 1]  # a view of a fused projection, as the backend gets it
    s = torch.tensor(0.02, dtype=torch.float32)
    got = op(key, s, torch.float8_e4m3fn)
    assert got.shape == key.shape and got.is_contiguous()
    assert same_bits(got, vllm_cpu_fp8_reference(key, s, torch.float8_e4m3fn))
    assert op(torch.empty(0, 2, 8), s, torch.float8_e5m2).shape == (0, 2, 8)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_paged_store_with_scale_one_stores_the_codes(fp8_dtype):
    g = torch.Generator().manual_seed(11)
    T, H, D, P = 40, 2, 32, 16
    key = (torch.randn(T, H, D, generator=g) * 3).to(torch.bfloat16)
    s = torch.tensor(0.031, dtype=torch.float32)
    values = op(key, s, fp8_dtype)
    cache = torch.zeros(4, P, H, D, dtype=fp8_dtype)
    one = torch.ones((), dtype=torch.float32)
    rows = (torch.tensor([0, T], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.arange(4, dtype=torch.int32)[None])
    pagedkv.paged_store(values, None, cache, None, *rows, one, None)
    stored = cache.view(-1, H, D)[:T]
    assert torch.equal(stored.view(torch.uint8), vllm_cpu_fp8_reference(key, s, fp8_dtype).to(fp8_dtype).view(torch.uint8))


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.zeros(4, dtype=torch.float64)), "x must be float32, float16 or bfloat16"),
    (dict(scale=torch.ones(2)), "scale must be one float32 element"),
    (dict(scale=torch.ones((), dtype=torch.float64)), "scale must be one float32 element"),
    (dict(scale=torch.tensor(0.0)), "scale must be finite and > 0"),
    (dict(scale=torch.tensor(-1.0)), "scale must be finite and > 0"),
    (dict(scale=torch.tensor(float("nan"))), "scale must be finite and > 0"),
    (dict(scale=torch.tensor(float("inf"))), "scale must be finite and > 0"),
    (dict(fp8_dtype=torch.bfloat16), "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2"),
    # a meta scale sent the call to the fake kernel, which returned uninitialised memory
    (dict(scale=torch.ones((), device="meta")), r"scale must be on the same device as x \(cpu\), got meta"),
])
def test_bad_arguments_are_named(bad, message):
    args = dict(x=torch.zeros(4), scale=torch.ones(()), fp8_dtype=torch.float8_e4m3fn) | bad
    with pytest.raises(RuntimeError, match=message):
        op(args["x"], args["scale"], args["fp8_dtype"])


def test_opcheck():
    x = torch.randn(5, 2, 8).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedkv._vllm_cpu_fp8_values.default, (x, torch.tensor(0.5), torch.float8_e4m3fn))
