"""flash_attn_paged (and its .out variant) on every device against pagedkv.reference: the grid
over every option, edge batches, NaN and large-logit cases, and opcheck. The decode/prefill grids of
the kernels' tile and split paths and the CUDA-only behaviour are in
test_flash_attn_paged_kernel_paths.py; the error cases and seeded fuzz chunks in
test_flash_attn_paged_errors.py.

Attention is compared with the float64 reference within conftest.attention_tolerance: 1e-5
(float32 queries) or 2e-2 (float16/bfloat16 queries) per-row relative L2 error; rows the reference
zeroes (no visible key, padding) must be exactly zero. The CUDA kernels run the same grids (float32
queries through a 16-bit copy, so at the 16-bit tolerance there: conftest.effective_q_dtype; float32
caches and head sizes outside 64/96/128/256 are not implemented there and skip, see
conftest.supported_or_skip). Caches start as NaN, so a read of an unused slot, page or neighbouring
layer shows up as a non-finite output.
"""

from __future__ import annotations

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

pytestmark = pytest.mark.usefixtures("cuda_knobs")

# ---------------------------------------------------------------------------------------------
# grid

ATTN_AXES = {
    "q_dtype": FLOAT_DTYPES,
    "cache_dtype": CACHE_DTYPES,
    "head_dim": HEAD_DIMS,
    "page_size": PAGE_SIZES,
    "gqa": GQA_RATIOS,
    "layout": LAYOUTS,
    "noncontig": (False, True),
    "quant_group": QUANT_GROUPS,
    "causal": (True, False),
    "window_left": (-1, 0, 5),
    "softcap": (0.0, 1.5),
    "scale": (None, 0.3),
}
ATTN_BASE = dict(
    q_dtype=torch.float32, cache_dtype=torch.bfloat16, head_dim=128, page_size=16, gqa=4,
    layout="collection", noncontig=False, quant_group=128, causal=True, window_left=-1,
    softcap=0.0, scale=None,
)
ATTN_CASES = build_cases(
    ATTN_BASE,
    ATTN_AXES,
    crosses=[
        ("q_dtype", "cache_dtype"),
        ("cache_dtype", "head_dim", "quant_group"),
        ("layout", "page_size", "noncontig"),
        ("causal", "window_left", "softcap", "scale"),
        ("gqa", "head_dim"),
    ],
    samples=RANDOM_SAMPLES,
    seed=3,
)


def run_attention(case, device, unused="random", rows=None, padding=3, use_out=False):
    gen = generator(seed_from("attn", case_id(case)))
    rows = rows_for(case["page_size"]) if rows is None else rows
    kv, batch = make_setup(
        gen, rows, layout=case["layout"], page_size=case["page_size"], num_kv_heads=NUM_KV_HEADS,
        head_dim=case["head_dim"], dtype=case["cache_dtype"], quant_group=case["quant_group"],
        noncontig=case["noncontig"], padding=padding, unused=unused, device=device,
    )
    kv.poison_("nan")
    fill_history(gen, kv, batch, case["q_dtype"])
    q = ragged_inputs(gen, batch.num_tokens, NUM_KV_HEADS * case["gqa"], case["head_dim"],
                      case["q_dtype"], device, case["noncontig"])
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table, case["scale"], case["causal"], kv.k_scales, kv.v_scales,
            case["quant_group"], case["window_left"], case["softcap"])
    if use_out:
        out = torch.full((q.shape[0], q.shape[1], case["head_dim"] + 8), float("nan"),
                         dtype=q.dtype, device=device)[..., : case["head_dim"]]
        result = supported_or_skip(device, pagedkv.flash_attn_paged, *args, out=out)
        assert result.data_ptr() == out.data_ptr()
    else:
        out = supported_or_skip(device, pagedkv.flash_attn_paged, *args)
    expected = ref.flash_attn_paged(q.to(torch.float64), *args[1:])
    assert_attention_close(out, expected, case["q_dtype"], f"flash_attn_paged {case_id(case)}", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(ATTN_CASES))
def test_flash_attn_paged(device, case):
    run_attention(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flash_attn_paged_ignores_unused_table_entries(device, layout):
    run_attention(normalize({**ATTN_BASE, "layout": layout}), device, unused="garbage")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", FLOAT_DTYPES, ids=dtype_name)
def test_flash_attn_paged_out_variant(device, q_dtype):
    case = {**ATTN_BASE, "q_dtype": q_dtype, "cache_dtype": torch.float8_e4m3fn, "head_dim": 64,
            "quant_group": 32}
    run_attention(case, device, use_out=True)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_edge_batches(device):
    case = {**ATTN_BASE, "head_dim": 64, "gqa": 1}
    run_attention(case, device, rows=[], padding=3)  # B = 0: all padding -> zeros
    run_attention(case, device, rows=[(0, 0), (7, 0)], padding=0)  # T = 0
    run_attention(case, device, rows=[(5, 0), (0, 1), (0, 0)], padding=2)
    # Window 0: every query sees exactly its own key.
    run_attention({**case, "window_left": 0, "causal": False}, device, rows=[(30, 4), (0, 1)])


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_long_sequence(device):
    """A few thousand keys over many small pages (split/merge paths on GPU)."""
    case = {**ATTN_BASE, "q_dtype": torch.bfloat16, "head_dim": 64, "page_size": 2}
    run_attention(case, device, rows=[(3000, 1), (1500, 3), (0, 1)], padding=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_flash_attn_paged_ignores_nan_outside_window(device, cache_dtype):
    """Sliding window: keys that no query of the row can see (evicted pages) hold NaN, scales
    too; they must not leak into the output. Not spelled out in CONTRACT.md, but a model with a
    sliding window may recycle those pages."""
    gen = generator(seed_from("nan-window", str(cache_dtype)))
    rows, window = [(40, 2), (9, 1)], 3
    kv, batch = make_setup(gen, rows, layout="separate", page_size=4, num_kv_heads=2,
                           head_dim=64, dtype=cache_dtype, quant_group=32, device=device)
    fill_history(gen, kv, batch)
    # Row 0 queries sit at 40 and 41 and see keys >= 37: poison positions 0..35 (pages 0..8).
    evicted = batch.lookup_table[0, :9].long()
    for t in (kv.k_cache, kv.v_cache, kv.k_scales, kv.v_scales):
        if t is not None:
            t[evicted] = float("nan")
    q = randn(gen, (batch.num_tokens, 8, 64), torch.float32, device)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=32,
                  window_left=window)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, **kwargs)
    expected = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert torch.isfinite(expected).all()
    assert_attention_close(out, expected, torch.float32, "NaN outside the window", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_flash_attn_paged_large_logits(device, q_dtype, softcap, cache_dtype):
    """Scores in the hundreds: the softmax must subtract the running maximum (bf16 caches too, which
    the CUDA kernels take: they do not implement float32 caches)."""
    gen = generator(seed_from("large-logits", str(q_dtype), softcap, str(cache_dtype)))
    kv, batch = make_setup(gen, [(50, 3), (0, 7), (130, 1)], layout="collection", page_size=16,
                           num_kv_heads=2, head_dim=64, dtype=cache_dtype, device=device)
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 4, 64), q_dtype, device, scale=300.0)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, softcap=softcap)
    expected = ref.flash_attn_paged(q.double(), *args, softcap=softcap)
    assert_attention_close(out, expected, q_dtype, "large logits", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype, step", [(torch.float32, 4.0), (torch.bfloat16, 4.0), (torch.bfloat16, 100.0),
                                           (torch.bfloat16, 300.0)], ids=lambda x: str(x).replace("torch.", ""))
def test_flash_attn_paged_scores_rising_past_the_float_range(device, q_dtype, step):
    """Scores rising by `step` natural-log units per 64 keys (conftest.rising_scores: a decode token and a
    40-token chunk over 300 cached keys, bf16 cache). From 100 on, each tile's maximum is more than 126
    (log2 units) above the last, so the rescale factor of everything before it falls below 2^-126, as do
    most probabilities inside a tile: the kernels flush those to 0 (CPU exp2, CUDA ex2.approx.ftz)
    where float64 keeps them, which must not show against the reference. Those steps run with bf16
    queries only: scores reach 500-1600, where float32's own rounding of q.k (~1e-7 of the score)
    alone moves the output by more than the float32 tolerance (1e-5)."""
    args = rising_scores(q_dtype, step, device)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, *args)
    cpu_args = [t.cpu() for t in args]
    expected = ref.flash_attn_paged(cpu_args[0].double(), *cpu_args[1:])
    assert_attention_close(out, expected, q_dtype, f"scores rising {step} per tile", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_many_rows_random_lengths(device):
    """48 rows of random history and 0-3 new tokens, FP8 e5m2 with groups, window, fp16 q."""
    gen = generator(seed_from("many-rows"))
    rows = [(int(torch.randint(0, 300, (1,), generator=gen)),
             int(torch.randint(0, 4, (1,), generator=gen))) for _ in range(48)]
    kv, batch = make_setup(gen, rows, layout="fa3", page_size=8, num_kv_heads=4, head_dim=96,
                           dtype=torch.float8_e5m2, quant_group=32, padding=5, device=device)
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 16, 96), torch.float16, device)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=32, window_left=37)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, **kwargs)
    expected = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert_attention_close(out, expected, torch.float16, "many rows")


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_rows_filling_the_table_exactly(device):
    """cache_length + new == max_pages * P: the last slot of the last page, no spare column."""
    gen = generator(seed_from("exact-capacity"))
    rows = [(13, 3), (15, 1), (0, 16)]
    kv, batch = make_setup(gen, rows, layout="collection", page_size=4, num_kv_heads=2,
                           head_dim=64, dtype=torch.float8_e4m3fn, quant_group=32,
                           extra_columns=0, device=device)
    assert batch.lookup_table.shape[1] * 4 == 16
    fill_history(gen, kv, batch)
    q = randn(gen, (batch.num_tokens, 4, 64), torch.float32, device)
    args = (batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table)
    kwargs = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=32)
    assert_attention_close(supported_or_skip(device, pagedkv.flash_attn_paged, q, *args, **kwargs),
                           ref.flash_attn_paged(q.double(), *args, **kwargs), torch.float32,
                           "exact capacity attention", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_strided_index_tensors(device):
    """A column slice of a preallocated table and lengths/offsets taken from wider metadata."""
    gen = generator(seed_from("strided-index"))
    kv, batch = make_setup(gen, [(5, 3), (0, 4), (9, 1)], layout="separate", page_size=4,
                           num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=device)
    fill_history(gen, kv, batch)
    table, offsets, lengths = strided_index_tensors(batch, device)
    q = randn(gen, (batch.num_tokens, 4, 64), torch.float32, device)
    out = supported_or_skip(device, pagedkv.flash_attn_paged, q, offsets, kv.k_cache, kv.v_cache,
                            lengths, table)
    expected = ref.flash_attn_paged(q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                    batch.cache_lengths, batch.lookup_table)
    assert_attention_close(out, expected, torch.float32, "strided index tensors", q16_on_cuda=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
def test_flash_attn_paged_nan_value_scale_does_not_leak_into_later_key_tiles(device, q_dtype):
    """A NaN FP8 value scale (what storing a NaN gives) at key 40, sliding window 20, 100 keys: the
    kernels read keys in 64-key tiles (0..63, 64..99). Rows 84..99 see only keys of the second tile and
    must equal the reference computed with that scale made finite; rows that see key 40 are NaN.
    Regression: the short second tile kept key 40's scale in its unused lane 40, and the lane's zero
    probability times NaN poisoned every row of that tile on the AMX path. (Rows sharing a tile with
    the bad key without seeing it may be NaN, as in the reference's 0 * NaN: not asserted.)"""
    torch.manual_seed(3)
    n_new, page, dim, window = 100, 16, 64, 20
    n_pages = (n_new + page - 1) // page
    k, ks = ref.quantize_fp8(torch.randn(n_pages, page, 1, dim), torch.float8_e4m3fn, 128)
    v, vs = ref.quantize_fp8(torch.randn(n_pages, page, 1, dim), torch.float8_e4m3fn, 128)
    q = torch.randn(n_new, 1, dim).to(q_dtype)  # one query head: all 100 rows in one work item
    offsets = torch.tensor([0, n_new], dtype=torch.int32)
    lengths = torch.tensor([0], dtype=torch.int32)
    table = torch.arange(n_pages, dtype=torch.int32).view(1, -1)
    vs_bad = vs.clone()
    vs_bad[40 // page, 40 % page] = float("nan")
    args = [t.to(device) for t in (q, offsets, k, v, lengths, table)]
    got = supported_or_skip(device, pagedkv.flash_attn_paged, *args, k_scales=ks.to(device),
                            v_scales=vs_bad.to(device), quant_group=128, window_left=window)
    want = ref.flash_attn_paged(q, offsets, k, v, lengths, table, k_scales=ks, v_scales=vs,
                                quant_group=128, window_left=window)
    got = got.cpu()
    assert torch.isnan(got[40:41 + window]).all(), "rows that see the NaN value must be NaN"
    # float32 queries attend through a bf16 copy on CUDA (effective_q_dtype)
    tol = 2e-2 if effective_q_dtype(q_dtype, device, q16_on_cuda=True) == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got[84:].float(), want[84:].float(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("overload", ["default", "out"])
def test_opcheck_flash_attn_paged(device, dtype, overload):
    gen, kv, batch = small_setup(device, dtype)
    q = randn(gen, (batch.num_tokens, 4, 32), torch.float32, device)
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
            batch.lookup_table, 0.2, True, kv.k_scales, kv.v_scales, 16, -1, 0.0)
    if overload == "default":
        supported_or_skip(device, opcheck, torch.ops.pagedkv.flash_attn_paged.default, args, cache_dtype=dtype)
    else:
        out = torch.empty((q.shape[0], 4, 32), device=device)
        supported_or_skip(device, opcheck, torch.ops.pagedkv.flash_attn_paged.out, args, {"out": out},
                          cache_dtype=dtype)
