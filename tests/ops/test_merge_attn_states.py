"""merge_attn_states on every device against pagedkv.reference: random parts, -inf parts (a part that
saw no key is ignored, even a NaN one), one part dominating, strided inputs, every float dtype;
errors that name the argument; opcheck.
"""

from __future__ import annotations


import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

@pytest.mark.parametrize("device", DEVICES)
def test_merge_with_parts_that_saw_no_key(device):
    """A part with lse -inf saw no key: its out is ignored even when it holds NaN (never written);
    two such parts give zeros and -inf."""
    gen = generator(1)
    out = randn(gen, (3, 2, 8), torch.float32, device)
    empty_out = torch.full_like(out, float("nan"))
    lse = randn(gen, (3, 2), torch.float32, device)
    empty_lse = torch.full_like(lse, float("-inf"))
    merged, merged_lse = pagedkv.merge_attn_states(out, lse, empty_out, empty_lse)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    merged, merged_lse = pagedkv.merge_attn_states(empty_out, empty_lse, empty_out, empty_lse)
    assert (merged == 0).all() and torch.equal(merged_lse, empty_lse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 1, 0), (0, 3, 8)])
def test_merge_of_empty_parts(device, shape):
    """No values per head (Dv = 0: the log-sum-exps still merge) or no rows: tensors that may have no
    data pointer at all (the C fuzzer found address arithmetic on one)."""
    gen = generator(3)
    out_a, out_b = randn(gen, shape, torch.float32, device), randn(gen, shape, torch.float32, device)
    lse_a, lse_b = randn(gen, shape[:2], torch.float32, device), randn(gen, shape[:2], torch.float32, device)
    merged, merged_lse = pagedkv.merge_attn_states(out_a, lse_a, out_b, lse_b)
    expected, expected_lse = ref.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert merged.shape == shape
    torch.testing.assert_close(merged_lse, expected_lse)
    torch.testing.assert_close(merged, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_merge_matches_reference(device, dtype):
    gen = generator(seed_from("merge", dtype_name(dtype)))
    tokens, heads, dv = 7, 3, 40
    out_a = randn(gen, (tokens, heads, dv), dtype, device)
    # a strided view of a fused tensor, as a kernel's output slice would be
    out_b = randn(gen, (tokens, heads + 2, dv + 8), dtype, device)[:, 1 : heads + 1, :dv]
    lse_a = randn(gen, (tokens, heads), torch.float32, device, scale=4.0)
    lse_b = randn(gen, (tokens, heads + 1), torch.float32, device, scale=4.0)[:, :heads]
    lse_a[0, 0] = float("-inf")
    lse_b[1, 1] = float("-inf")
    lse_a[2, 2] = lse_b[2, 2] = float("-inf")
    lse_a[3, 0], lse_b[3, 0] = 60.0, -60.0  # one part dominates
    out, lse = pagedkv.merge_attn_states(out_a, lse_a, out_b, lse_b)
    expected, expected_lse = ref.merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and out.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected.double(), rtol=tol, atol=tol)
    assert_lse_close(lse, expected_lse.double().float(), torch.float32, "merge lse")
    assert (out[2, 2] == 0).all()



LARGE_LSE = [
    ("1e5", 1e5, 1e5), ("1e6", 1e6, 1e6), ("1e7", 1e7, 1e7), ("-1e7", -1e7, -1e7),
    ("1e7 vs 1e7-3", 1e7, 1e7 - 3), ("-1e7 vs -1e7+4", -1e7, -1e7 + 4), ("1e7 vs 0.5", 1e7, 0.5),
    ("-1e7 vs 20", -1e7, 20.0), ("3e38 vs -3e38", 3e38, -3e38), ("1e5 vs 1e5+40", 1e5, 1e5 + 40),
]


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_name)
def test_merge_is_exact_at_large_log_sum_exps(device, dtype):
    """The weights depend on lse_a - lse_b only: equal parts of 1 and 3 merge to exactly 2 at any
    magnitude (weighting by exp(lse_a - logaddexp(..)) in float32 gave 1.99, 2.01 and 1.47 at
    1e5..1e7), and unequal ones match the float64 reference."""
    lse_a = torch.tensor([[a for _, a, _ in LARGE_LSE]], dtype=torch.float32, device=device).repeat(3, 1)
    lse_b = torch.tensor([[b for _, _, b in LARGE_LSE]], dtype=torch.float32, device=device).repeat(3, 1)
    lse_a[1], lse_b[1] = lse_b[1].clone(), lse_a[1].clone()  # row 1: the parts swapped
    out_a = torch.ones((3, len(LARGE_LSE), 24), dtype=dtype, device=device)
    out_b = torch.full((3, len(LARGE_LSE), 24), 3.0, dtype=dtype, device=device)
    out_b[2] = randn(generator(7), (len(LARGE_LSE), 24), dtype, device)  # row 2: other values
    out, lse = pagedkv.merge_attn_states(out_a, lse_a, out_b, lse_b)
    expected, expected_lse = ref.merge_attn_states(out_a, lse_a, out_b, lse_b)
    equal = (lse_a == lse_b)[:2]
    assert (out[:2][equal] == 2).all(), [name for (name, _, _), e in zip(LARGE_LSE, equal[0]) if e]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-7, atol=0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(out_b=torch.zeros(5, 2, 8)), r"out_b.size\(0\) must be 4"),
        (dict(out_b=torch.zeros(4, 2, 8, dtype=torch.float16)), "out_b must have out_a's dtype float32"),
        (dict(lse_a=torch.zeros(4, 2, dtype=torch.float16)), "lse_a must be float32"),
        (dict(lse_b=torch.zeros(4, 3)), r"lse_b.size\(1\) must be 2"),
        (dict(out_a=torch.zeros(4, 2, 8, dtype=torch.int32)), "out_a must be float32, float16 or bfloat16"),
        (dict(out_a=torch.zeros(4, 16)[:, ::2].reshape(4, 2, 4).expand(4, 2, 4).transpose(1, 2)),
         r"out_a must have stride\(-1\) == 1"),
        (dict(lse_a=torch.zeros(4, 2, device="meta")), "lse_a must be on the same device as out_a"),
    ],
)
def test_bad_merge_arguments_name_the_argument(change, match):
    parts = dict(out_a=torch.zeros(4, 2, 8), lse_a=torch.zeros(4, 2), out_b=torch.zeros(4, 2, 8),
                 lse_b=torch.zeros(4, 2))
    parts.update(change)
    with pytest.raises(RuntimeError, match=match):
        pagedkv.merge_attn_states(parts["out_a"], parts["lse_a"], parts["out_b"], parts["lse_b"])




@pytest.mark.parametrize("device", DEVICES)
def test_merge_opcheck(device):
    gen = generator(12)
    out = randn(gen, (5, 3, 16), torch.bfloat16, device)
    lse = randn(gen, (5, 3), torch.float32, device)
    torch.library.opcheck(torch.ops.pagedkv.merge_attn_states.default, (out, lse, out * 2, lse - 1))
