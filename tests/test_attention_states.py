"""flash_attn_paged_lse, attention sinks, merge_attn_states and cascade attention against the reference.

The log-sum-exp and the sink term are checked on the same grids as the output: every cache dtype, the
four layouts, GQA, causal/window/softcap, decode rows long enough for the CPU's split-KV path, padding
rows and rows that see no key. scripts/test.sh also runs this file on every CPU kernel path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import pagedkv
from conftest import (
    CACHE_DTYPES,
    DEVICES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    LAYOUTS,
    assert_attention_close,
    assert_bytes_equal,
    dtype_name,
    fill_history,
    generator,
    make_setup,
    randn,
    ragged_inputs,
    seed_from,
)
from pagedkv import reference as ref

NUM_KV_HEADS = 2


def lse_tolerance(q_dtype: torch.dtype) -> float:
    # absolute, in natural-log units: float32 softmax sums vs bf16-accurate probabilities (AMX) for
    # half-precision queries, whose relative error 2e-2 on the sum is ~2e-2 on its log
    return 1e-4 if q_dtype == torch.float32 else 2e-2


def assert_lse_close(got: torch.Tensor, expected: torch.Tensor, q_dtype, what=""):
    assert got.dtype == torch.float32 and got.shape == expected.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    got, expected = got.cpu().double(), expected.cpu().double()
    infinite = torch.isinf(expected)
    assert torch.equal(got[infinite], expected[infinite]), f"{what}: -inf entries differ"
    assert torch.isfinite(got[~infinite]).all(), f"{what}: non-finite lse where the reference is finite"
    err = (got[~infinite] - expected[~infinite]).abs().max().item() if (~infinite).any() else 0.0
    assert err <= lse_tolerance(q_dtype), f"{what}: lse error {err:.3e} > {lse_tolerance(q_dtype):.0e}"


# rows (cached, new): decode rows, a prefill row, an empty row, and one long decode row that the CPU
# splits over several work items (split-KV: its partial log-sum-exps are merged by the kernel)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_lse_and_sinks_match_reference(device, case):
    args, _ = build(case, device)
    out, lse = pagedkv.flash_attn_paged_lse(*args)
    expected_out, expected_lse = ref.flash_attn_paged_lse(args[0].double(), *args[1:])
    assert_attention_close(out, expected_out, case["q_dtype"], f"out {case_name(case)}")
    assert_lse_close(lse, expected_lse, case["q_dtype"], f"lse {case_name(case)}")
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
    out, lse = pagedkv.flash_attn_paged_lse(*args)
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
    out_a, lse_a = pagedkv.flash_attn_paged_lse(
        q, batch.input_row_offsets, kv.k_cache, kv.v_cache, one * (split * 8 - 1), table[:, :split],
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
    assert_attention_close(out, expected, torch.float32, "merged")
    assert_lse_close(lse, expected_lse, torch.float32, "merged lse")
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def shared_prefix_batch(gen, device, *, shared_pages, own, new, page_size=8, cache_dtype=torch.bfloat16,
                        num_pages=None):
    """B rows sharing their first `shared_pages` pages, each with `own[b]` more cached tokens and
    `new[b]` new ones (already stored)."""
    batch_rows = [(shared_pages * page_size + o, n) for o, n in zip(own, new)]
    kv, batch = make_setup(gen, batch_rows, layout="collection", page_size=page_size, num_kv_heads=2,
                           head_dim=32, dtype=cache_dtype, quant_group=16, device=device)
    fill_history(gen, kv, batch)
    # every row now points its first pages at row 0's: the prefix is stored once
    table = batch.lookup_table.clone()
    table[:, :shared_pages] = table[:1, :shared_pages]
    return kv, batch, table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=dtype_name)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cascade_equals_flash_attn_paged(device, cache_dtype, with_sinks):
    gen = generator(seed_from("cascade", dtype_name(cache_dtype), with_sinks))
    kv, batch, table = shared_prefix_batch(gen, device, shared_pages=3, own=[5, 0, 17, 9], new=[1, 4, 1, 2],
                                           cache_dtype=cache_dtype)
    q = ragged_inputs(gen, batch.num_tokens + 2, 8, 32, torch.float32, device)  # 2 padding rows
    sinks = randn(gen, (8,), torch.float32, device) if with_sinks else None
    common = dict(k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=16, softcap=3.0, sinks=sinks)
    got = pagedkv.cascade_attention(q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
                                    table, 3, **common)
    expected = ref.flash_attn_paged(q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                    batch.cache_lengths, table, **common)
    assert_attention_close(got, expected, torch.float32, "cascade")
    assert (got[batch.num_tokens:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_cascade_more_queries_than_prefix_tokens(device):
    """Prefill chunks longer than the prefix: the prefix part runs in chunks of <= prefix tokens."""
    gen = generator(7)
    kv, batch, table = shared_prefix_batch(gen, device, shared_pages=1, own=[0, 3], new=[11, 6], page_size=4)
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32, device)
    got = pagedkv.cascade_attention(q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths,
                                    table, 1, k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=16)
    expected = ref.flash_attn_paged(q.double(), batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                    batch.cache_lengths, table, k_scales=kv.k_scales, v_scales=kv.v_scales,
                                    quant_group=16)
    assert_attention_close(got, expected, torch.float32, "cascade chunks")


def test_cascade_rejects_rows_that_do_not_share_the_prefix():
    gen = generator(3)
    kv, batch, table = shared_prefix_batch(gen, "cpu", shared_pages=2, own=[1, 2], new=[1, 1])
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32)
    args = (q, batch.input_row_offsets, kv.k_cache, kv.v_cache, batch.cache_lengths)
    bad = table.clone()
    bad[1, 1] = (int(bad[0, 1]) + 1) % kv.k_cache.shape[0]
    with pytest.raises(ValueError, match=r"lookup_table\[:, :shared_pages\].*rows \[1\]"):
        pagedkv.cascade_attention(*args, bad, 2)
    with pytest.raises(ValueError, match="cache_lengths.*>= the shared prefix"):
        pagedkv.cascade_attention(q, batch.input_row_offsets, kv.k_cache, kv.v_cache,
                                  torch.tensor([1, 30], dtype=torch.int32), table, 2)
    with pytest.raises(ValueError, match="shared_pages must be in"):
        pagedkv.cascade_attention(*args, table, 0)
    with pytest.raises(TypeError, match="shared_pages must be an int"):
        pagedkv.cascade_attention(*args, table, 2.0)


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
    torch.library.opcheck(torch.ops.pagedkv.flash_attn_paged_lse.default, args, test_utils=utils)
    torch.library.opcheck(torch.ops.pagedkv.flash_attn_paged.default, args, test_utils=utils)
    out, lse = pagedkv.flash_attn_paged_lse(*args)
    torch.library.opcheck(torch.ops.pagedkv.merge_attn_states.default, (out, lse, out * 2, lse - 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_cascade_fullgraph(device, backend):
    gen = generator(5)
    kv, batch, table = shared_prefix_batch(gen, device, shared_pages=2, own=[3, 1, 0], new=[1, 1, 1])
    q = ragged_inputs(gen, batch.num_tokens, 4, 32, torch.float32, device)
    sinks = randn(gen, (4,), torch.float32, device)

    def attend(q, offsets, lengths, table):
        # two partial attentions merged, with sinks: the cascade's device-side path
        a, la = pagedkv.flash_attn_paged_lse(q, offsets, kv.k_cache, kv.v_cache, lengths, table, sinks=sinks)
        b, lb = pagedkv.flash_attn_paged_lse(q, offsets, kv.k_cache, kv.v_cache, lengths, table)
        return pagedkv.merge_attn_states(a, la, b, lb)

    expected = attend(q, batch.input_row_offsets, batch.cache_lengths, table)
    got = torch.compile(attend, backend=backend, fullgraph=True)(q, batch.input_row_offsets,
                                                                 batch.cache_lengths, table)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
