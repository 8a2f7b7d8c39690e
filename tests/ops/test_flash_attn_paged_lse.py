"""flash_attn_paged_lse and attention sinks (flash_attn_paged's `sinks`) on every device against
pagedkv.reference: the output and the log-sum-exp over every cache dtype, the four layouts, GQA,
causal/window/softcap, decode rows long enough for the CPU's split-KV path, padding rows; sink limits;
two key ranges merged equal their union; errors; opcheck. The log-sum-exp is compared within
conftest.lse_tolerance (absolute, natural-log units). scripts/test.sh reruns the `per_isa` tests on
every CPU kernel path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

NUM_KV_HEADS = 2


ROWS = [(37, 1), (0, 9), (5, 0), (20, 3), (1500, 1)]
CASES = [
    dict(q_dtype=q, cache_dtype=c, layout=layout, gqa=gqa, causal=causal, window_left=window, softcap=cap,
         sinks=sinks)
    for (q, c), layout, gqa, (causal, window, cap), sinks in itertools.product(
        [(torch.float32, c) for c in CACHE_DTYPES] + [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float8_e4m3fn)],
        ["collection"],
        [4],
        [(True, -1, 0.0)],
        [False, True],
    )
] + [
    dict(q_dtype=torch.float32, cache_dtype=torch.bfloat16, layout=layout, gqa=gqa, causal=causal,
         window_left=window, softcap=cap, sinks=True)
    for layout, gqa, (causal, window, cap) in itertools.product(
        LAYOUTS, [1, 4], [(True, -1, 0.0), (False, -1, 0.0), (True, 6, 0.0), (True, -1, 2.5), (False, -1, 1.5)]
    )
]


def case_name(case):
    return "-".join(
        f"{k}={dtype_name(v) if isinstance(v, torch.dtype) else v}" for k, v in case.items()
    )


def build(case, device, rows=ROWS, padding=2):
    gen = generator(seed_from("lse", case_name(case)))
    if case["layout"] == "continuous":
        rows = [r for r in rows if r[0] + r[1] < 64]
    kv, batch = make_setup(
        gen, rows, layout=case["layout"], page_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=64,
        dtype=case["cache_dtype"], quant_group=32, padding=padding, device=device,
    )
    kv.poison_("nan")
    fill_history(gen, kv, batch, case["q_dtype"])
    hq = NUM_KV_HEADS * case["gqa"]
    q = ragged_inputs(gen, batch.num_tokens, hq, 64, case["q_dtype"], device)
    sinks = randn(gen, (hq,), torch.float32, device, scale=3.0) if case["sinks"] else None
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table,
            None, case["causal"], kv.k_scales, kv.v_scales, 32, case["window_left"], case["softcap"], sinks)
    return args, batch


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_lse_and_sinks_match_reference(device, case):
    args, _ = build(case, device)
    out, lse = supported_or_skip(device, pagedkv.flash_attn_paged_lse, *args)
    expected_out, expected_lse = ref.flash_attn_paged_lse(args[0].double(), *args[1:])
    assert_attention_close(out, expected_out, case["q_dtype"], f"out {case_name(case)}", q16_on_cuda=True)
    assert_lse_close(lse, expected_lse, case["q_dtype"], f"lse {case_name(case)}", q16_on_cuda=True)
    # flash_attn_paged and its out= variant give the same output with the same sinks
    assert torch.equal(pagedkv.flash_attn_paged(*args), out)
    buffer = torch.full_like(out, float("nan"))
    pagedkv.flash_attn_paged(*args, out=buffer)
    assert torch.equal(buffer, out)


@pytest.mark.parametrize("device", DEVICES)
def test_sink_limits_and_padding_rows(device):
    """Padding rows: zeros and lse -inf, sinks or not. Sinks of -inf are no sinks; a huge sink takes
    all the probability (out -> 0, lse -> the sink)."""
    case = dict(q_dtype=torch.float32, cache_dtype=torch.float32, layout="separate", gqa=2, causal=True,
                window_left=-1, softcap=0.0, sinks=True)
    args, _ = build(case, device, rows=[(0, 2), (4, 1)], padding=3)
    offsets, sinks = args[1], args[-1]
    out, lse = supported_or_skip(device, pagedkv.flash_attn_paged_lse, *args)
    real = int(offsets[-1])
    assert (out[real:] == 0).all()
    assert torch.equal(lse[real:], torch.full_like(lse[real:], float("-inf")))
    no_sink = pagedkv.flash_attn_paged_lse(*args[:-1], None)
    minus_inf = pagedkv.flash_attn_paged_lse(*args[:-1], torch.full_like(sinks, float("-inf")))
    assert torch.equal(no_sink[0], minus_inf[0]) and torch.equal(no_sink[1], minus_inf[1])
    huge = pagedkv.flash_attn_paged_lse(*args[:-1], torch.full_like(sinks, 80.0))
    assert huge[0][:real].abs().max() < 1e-20
    torch.testing.assert_close(huge[1][:real], torch.full_like(huge[1][:real], 80.0))



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=dtype_name)
def test_merging_two_key_ranges_equals_attending_their_union(device, cache_dtype):
    """Attention over pages [0, s) and over pages [s, n) of the same rows, merged, is attention over all."""
    gen = generator(seed_from("union", dtype_name(cache_dtype)))
    rows = [(40, 1), (70, 1), (33, 1)]
    kv, batch = make_setup(gen, rows, layout="separate", page_size=8, num_kv_heads=2, head_dim=32,
                           dtype=cache_dtype, quant_group=16, device=device)
    fill_history(gen, kv, batch)
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32, device)
    sinks = randn(gen, (4,), torch.float32, device)
    split = 2  # pages: the first 16 tokens vs the rest
    common = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=16)
    table = batch.lookup_table
    one = torch.ones(len(rows), dtype=torch.int32, device=device)
    # part A: the first `split` pages, non-causal (every query sits after them)
    out_a, lse_a = supported_or_skip(
        device, pagedkv.flash_attn_paged_lse, q, batch.input_row_offsets, kv.k_cache, kv.v_cache, one * (split * 8 - 1), table[:, :split],
        causal=False, **common)
    # part B: the rest, causal, positions shifted; the sink joins once
    out_b, lse_b = pagedkv.flash_attn_paged_lse(
        q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths - split * 8, table[:, split:],
        sinks=sinks, **common)
    out, lse = pagedkv.merge_attn_states(out_a, lse_a, out_b, lse_b)
    whole, whole_lse = pagedkv.flash_attn_paged_lse(
        q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, table, sinks=sinks, **common)
    expected, expected_lse = ref.flash_attn_paged_lse(
        q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, table, sinks=sinks,
        **common)
    assert_attention_close(out, expected, torch.float32, "merged", q16_on_cuda=True)
    assert_lse_close(lse, expected_lse, torch.float32, "merged lse", q16_on_cuda=True)
    if device == "cpu":  # float32 throughout: the merge equals the whole call up to float32 rounding
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)
    else:  # CUDA rounds queries and probabilities to 16 bits, in each part and in the whole differently
        assert_attention_close(out, whole.double(), torch.float32, "merged vs whole", q16_on_cuda=True)
        assert_lse_close(lse, whole_lse.double(), torch.float32, "merged vs whole lse", q16_on_cuda=True)



# ---- errors: named arguments, nothing written ----


def small_args(device="cpu", dtype=torch.bfloat16):
    gen = generator(11)
    kv, batch = make_setup(gen, [(3, 2), (0, 3)], layout="separate", page_size=4, num_kv_heads=2, head_dim=16,
                           dtype=dtype, quant_group=8, padding=1, device=device)
    fill_history(gen, kv, batch)
    q = ragged_inputs(gen, batch.num_tokens, 4, 16, torch.float32, device)
    return kv, batch, q


@pytest.mark.parametrize(
    "sinks,match",
    [
        (torch.zeros(4, dtype=torch.float64), "sinks must be float32, got float64"),
        (torch.zeros(3), r"sinks.size\(0\) must be 4 \(Hq of q\)"),
        (torch.zeros(4, 1), "sinks must be 1-D"),
        (torch.zeros(4, device="meta"), "sinks must be on the same device"),
    ],
)
def test_bad_sinks_name_the_argument(sinks, match):
    kv, batch, q = small_args()
    before = (kv.k_cache.clone(), kv.v_cache.clone())
    with pytest.raises(RuntimeError, match=match):
        pagedkv.flash_attn_paged_lse(q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
                                     batch.lookup_table, sinks=sinks, k_scales=kv.k_scales, v_scales=kv.v_scales,
                                     quant_group=8)
    assert_bytes_equal(kv.k_cache, before[0], "k_cache")
    assert_bytes_equal(kv.v_cache, before[1], "v_cache")



# ---- opcheck and torch.compile ----

FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
def test_opcheck(device, dtype):
    kv, batch, q = small_args(device, dtype)
    sinks = torch.randn(4, device=device)
    utils = FP8_OPCHECK_UTILS if dtype in FP8_DTYPES else "ALL"
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths, batch.lookup_table, 0.3,
            True, kv.k_scales, kv.v_scales, 8, -1, 0.0, sinks)
    supported_or_skip(device, torch.library.opcheck, torch.ops.pagedkv.flash_attn_paged_lse.default, args,
                      test_utils=utils)
    torch.library.opcheck(torch.ops.pagedkv.flash_attn_paged.default, args, test_utils=utils)


