"""paged_store on every device against pagedkv.reference: the grid, its error cases, opcheck,
CUDA-only behaviour, and the seeded fuzz chunks.

The store is a copy: the caches (FP8 bytes and scales included) must match the reference byte for
byte. Caches are filled with NaN (or random bytes) before use, so any stray write shows up as a
byte difference in the storage, including the padding around strided views and other layers.
"""

from __future__ import annotations

import math

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

pytestmark = pytest.mark.usefixtures("cuda_knobs")

# ---------------------------------------------------------------------------------------------
# grid

STORE_AXES = {
    "key_dtype": FLOAT_DTYPES,
    "cache_dtype": CACHE_DTYPES,
    "head_dim": STORE_HEAD_DIMS,
    "page_size": PAGE_SIZES,
    "num_kv_heads": (1, 2, 8),
    "layout": LAYOUTS,
    "noncontig": (False, True),
    "quant_group": QUANT_GROUPS,
    "k_only": (False, True),
}
STORE_BASE = dict(
    key_dtype=torch.float32, cache_dtype=torch.bfloat16, head_dim=128, page_size=16,
    num_kv_heads=2, layout="collection", noncontig=False, quant_group=128, k_only=False,
)
STORE_CASES = build_cases(
    STORE_BASE,
    STORE_AXES,
    crosses=[
        ("cache_dtype", "key_dtype", "head_dim"),
        ("layout", "page_size", "noncontig"),
        ("cache_dtype", "head_dim", "quant_group"),
        ("cache_dtype", "layout", "k_only"),
    ],
    samples=RANDOM_SAMPLES,
    seed=1,
)


def store_inputs(gen, case, num_tokens, device):
    """Random key/value with the FP8 edge cases: an all-zero (token, head), a zero group,
    a huge token and a tiny token."""
    D, H = case["head_dim"], case["num_kv_heads"]

    def one():
        x = ragged_inputs(gen, num_tokens, H, D, torch.float32, "cpu", case["noncontig"])
        if num_tokens >= 4:
            x[0, 0] = 0
            x[1, :, : min(case["quant_group"], D)] = 0
            x[2] *= 1000.0
            x[3] *= 1e-3
        return x.to(case["key_dtype"]).to(device)

    key = one()
    value = None if case["k_only"] else one()
    return key, value


def run_store(case, device, poison="nan", unused="random", rows=None, padding=2):
    gen = generator(seed_from("store", case_id(case)))
    rows = rows_for(case["page_size"]) if rows is None else rows
    kv, batch = make_setup(
        gen, rows, layout=case["layout"], page_size=case["page_size"],
        num_kv_heads=case["num_kv_heads"], head_dim=case["head_dim"], dtype=case["cache_dtype"],
        quant_group=case["quant_group"], k_only=case["k_only"], noncontig=case["noncontig"],
        padding=padding, unused=unused, device=device,
    )
    kv.poison_(poison, gen)
    key, value = store_inputs(gen, case, batch.num_tokens, device)
    expected = kv.clone()
    ref.paged_store(
        key, value, *expected.views[:2], batch.input_row_offsets, batch.cache_lengths,
        batch.lookup_table, *expected.views[2:], case["quant_group"],
    )
    k, v, ks, vs = kv.views
    supported_or_skip(
        device, pagedkv.paged_store, key, value, k, v, batch.input_row_offsets,
        batch.cache_lengths, batch.lookup_table, ks, vs, case["quant_group"],
    )
    kv.assert_equal(expected, f"paged_store {case_id(case)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(STORE_CASES))
def test_paged_store(device, case):
    run_store(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_store_random_byte_poison(device, cache_dtype, layout):
    """Sentinel bytes (random, including NaN/Inf patterns) around the written slots survive."""
    case = {**STORE_BASE, "cache_dtype": cache_dtype, "layout": layout, "head_dim": 64,
            "quant_group": 32, "noncontig": True}
    run_store(normalize(case), device, poison="bytes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_store_ignores_unused_table_entries(device, layout):
    """Entries past a row's last page (-1, N, INT32_MAX, INT32_MIN here) are never read."""
    case = normalize({**STORE_BASE, "layout": layout, "cache_dtype": torch.float8_e4m3fn})
    run_store(case, device, unused="garbage")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_empty_batches(device):
    case = {**STORE_BASE, "head_dim": 64}
    run_store(case, device, rows=[], padding=3)  # B = 0, only padding rows
    run_store(case, device, rows=[(0, 0), (5, 0)], padding=0)  # T = 0
    run_store(case, device, rows=[(0, 0)], padding=4)



# Odd page sizes and groups (7 tokens, groups of 1 and 48, a group wider than D) on the rows of
# a decode/prefill mix, unused table entries garbage: the CUDA suite's byte-equality grid.
ODD_GEOMETRY = [(16, 128, 128), (1, 32, 64), (7, 48, 96), (16, 1, 32), (5, 256, 80)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("page_size,quant_group,head_dim", ODD_GEOMETRY)
def test_paged_store_odd_geometry(device, key_dtype, cache_dtype, page_size, quant_group, head_dim):
    case = {**STORE_BASE, "key_dtype": key_dtype, "cache_dtype": cache_dtype, "layout": "separate",
            "page_size": page_size, "quant_group": quant_group, "head_dim": head_dim}
    run_store(case, device, unused="garbage", rows=[(3, 5), (0, 1), (17, 0), (40, 9)])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_many_rows_random_lengths(device):
    """48 rows of random history and 0-3 new tokens into FP8 e5m2 with groups of 32."""
    gen = generator(seed_from("many-rows"))
    rows = [(int(torch.randint(0, 300, (1,), generator=gen)),
             int(torch.randint(0, 4, (1,), generator=gen))) for _ in range(48)]
    kv, batch = make_setup(gen, rows, layout="fa3", page_size=8, num_kv_heads=4, head_dim=96,
                           dtype=torch.float8_e5m2, quant_group=32, padding=5, device=device)
    fill_history(gen, kv, batch)
    key = randn(gen, (batch.num_tokens, 4, 96), torch.bfloat16, device)
    expected_kv = kv.clone()
    ref.paged_store(key, key, *expected_kv.views[:2], batch.input_row_offsets,
                    batch.cache_lengths, batch.lookup_table, *expected_kv.views[2:], 32)
    pagedkv.paged_store(key, key, kv.k_cache, kv.v_cache, batch.input_row_offsets,
                        batch.cache_lengths, batch.lookup_table, kv.k_scales, kv.v_scales, 32)
    kv.assert_equal(expected_kv, "many rows store")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_rows_filling_the_table_exactly(device):
    """cache_length + new == max_pages * P: the last slot of the last page, no spare column."""
    gen = generator(seed_from("exact-capacity"))
    rows = [(13, 3), (15, 1), (0, 16)]
    kv, batch = make_setup(gen, rows, layout="collection", page_size=4, num_kv_heads=2,
                           head_dim=64, dtype=torch.float8_e4m3fn, quant_group=32,
                           extra_columns=0, device=device)
    assert batch.lookup_table.shape[1] * 4 == 16
    fill_history(gen, kv, batch)
    key = randn(gen, (batch.num_tokens, 2, 64), torch.float32, device)
    expected_kv = kv.clone()
    ref.paged_store(key, key, *expected_kv.views[:2], batch.input_row_offsets,
                    batch.cache_lengths, batch.lookup_table, *expected_kv.views[2:], 32)
    pagedkv.paged_store(key, key, kv.k_cache, kv.v_cache, batch.input_row_offsets,
                        batch.cache_lengths, batch.lookup_table, kv.k_scales, kv.v_scales, 32)
    kv.assert_equal(expected_kv, "exact capacity store")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_strided_index_tensors(device):
    """A column slice of a preallocated table and lengths/offsets taken from wider metadata."""
    gen = generator(seed_from("strided-index"))
    kv, batch = make_setup(gen, [(5, 3), (0, 4), (9, 1)], layout="separate", page_size=4,
                           num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=device)
    fill_history(gen, kv, batch)
    table, offsets, lengths = strided_index_tensors(batch, device)
    key = randn(gen, (batch.num_tokens, 2, 64), torch.float32, device)
    expected_kv = kv.clone()
    ref.paged_store(key, key, *expected_kv.views[:2], batch.input_row_offsets,
                    batch.cache_lengths, batch.lookup_table)
    pagedkv.paged_store(key, key, kv.k_cache, kv.v_cache, offsets, lengths, table)
    kv.assert_equal(expected_kv, "store with strided index tensors")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 5, 31])
def test_paged_store_fp8_non_finite_matches_reference(device, cache_dtype, bad, where):
    """A NaN or inf in a stored group follows the contract's scale rule exactly as the reference
    computes it (bytes and scales equal)."""
    torch.manual_seed(1)
    n_pages, page, heads, dim, group = 4, 2, 2, 64, 32
    key = torch.randn(3, heads, dim)
    key[1, 0, where] = bad
    key = key.to(device)
    offsets = torch.tensor([0, 3], dtype=torch.int32, device=device)
    lengths = torch.tensor([1], dtype=torch.int32, device=device)
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    caches = [torch.zeros(n_pages, page, heads, dim, dtype=cache_dtype, device=device) for _ in range(2)]
    scales = [torch.zeros(n_pages, page, heads, dim // group, device=device) for _ in range(2)]
    pagedkv.paged_store(key, None, caches[0], None, offsets, lengths, table, scales[0], None, group)
    ref.paged_store(key, None, caches[1], None, offsets, lengths, table, scales[1], None, group)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert torch.equal(scales[0].view(torch.int32), scales[1].view(torch.int32))


# ---------------------------------------------------------------------------------------------
# opt-in: cuda_fp8_store_rows (a warp per token row over all heads, the hardware conversion;
# compiled, not yet run on a GPU)

FP8_ROWS_AXES = {
    "key_dtype": FLOAT_DTYPES,
    "cache_dtype": FP8_DTYPES,
    "head_dim": (64, 80, 96, 128, 256, 576),
    "quant_group": (8, 16, 32, 64, 128),
    "num_kv_heads": (1, 2, 8),
    "page_size": (1, 16),
    "layout": LAYOUTS,
    "noncontig": (False, True),
    "k_only": (False, True),
}
FP8_ROWS_CASES = build_cases(
    dict(STORE_BASE, cache_dtype=torch.float8_e4m3fn),
    FP8_ROWS_AXES,
    crosses=[("cache_dtype", "key_dtype", "head_dim"), ("head_dim", "quant_group", "num_kv_heads")],
    samples=RANDOM_SAMPLES,
    seed=3,
)


@CUDA_ONLY
@pytest.mark.parametrize("case", params(FP8_ROWS_CASES))
def test_paged_store_cuda_fp8_rows(case):
    """cuda_fp8_store_rows=True: FP8 bytes and scales equal to the reference, byte for byte, on a grid of
    source dtypes, head sizes (those whose groups do not tile a warp, 80 and 96 with groups of 16 say, and
    576 with one scale per head, keep the default path), groups of 8-128 channels and one per head, KV heads,
    layouts and strides, K only; the store inputs hold a zero head, a zero group, a huge token and a tiny one
    (subnormal codes), and the caches NaN before the store."""
    pagedkv.set_kernel_options(cuda_fp8_store_rows=True)
    run_store(case, "cuda")


@CUDA_ONLY
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("group", [32, 64])
def test_paged_store_cuda_fp8_rows_non_finite(cache_dtype, bad, group):
    """cuda_fp8_store_rows=True with a NaN (either sign) or inf in a group: the codes (NaN's sign kept) and
    the scale equal the reference's and the default path's, for a group of one head and a group inside it."""
    torch.manual_seed(2)
    n_pages, page, heads, dim = 4, 2, 2, 64
    key = torch.randn(3, heads, dim)
    key[1, 0, 5] = bad
    key[2, 1, :] *= 1e-6  # subnormal codes
    key = key.cuda()
    offsets = torch.tensor([0, 3], dtype=torch.int32).cuda()
    lengths = torch.tensor([1], dtype=torch.int32).cuda()
    table = torch.tensor([[2, 0]], dtype=torch.int32).cuda()
    out = {}
    for rows in (True, False):
        pagedkv.set_kernel_options(cuda_fp8_store_rows=rows)
        cache = torch.zeros(n_pages, page, heads, dim, dtype=cache_dtype).cuda()
        scales = torch.zeros(n_pages, page, heads, dim // group).cuda()
        pagedkv.paged_store(key, None, cache, None, offsets, lengths, table, scales, None, group)
        out[rows] = (cache.view(torch.uint8).cpu(), scales.view(torch.int32).cpu())
    cache = torch.zeros(n_pages, page, heads, dim, dtype=cache_dtype)
    scales = torch.zeros(n_pages, page, heads, dim // group)
    ref.paged_store(key.cpu(), None, cache, None, offsets.cpu(), lengths.cpu(), table.cpu(), scales, None, group)
    for rows in (True, False):
        assert torch.equal(out[rows][0], cache.view(torch.uint8)), f"codes, cuda_fp8_store_rows={rows}"
        assert torch.equal(out[rows][1], scales.view(torch.int32)), f"scales, cuda_fp8_store_rows={rows}"


# ---------------------------------------------------------------------------------------------
# errors


def store_call(device, dtype=torch.float8_e4m3fn, k_only=False):
    gen, kv, batch = setup_call(device, dtype, k_only=k_only)
    k, v, ks, vs = kv.views
    args = dict(
        key=randn(gen, (batch.num_tokens, HK, D), torch.float32, device),
        value=None if k_only else randn(gen, (batch.num_tokens, HK, D), torch.float32, device),
        k_cache=k, v_cache=v, input_row_offsets=batch.input_row_offsets,
        cache_lengths=batch.cache_lengths, lookup_table=batch.lookup_table, k_scales=ks,
        v_scales=vs, quant_group=G,
    )
    return kv, args


STORE_ERRORS = index_errors("input_row_offsets", "cache_lengths", "k_cache") + [
    ("cache_lengths negative", set_("cache_lengths", lambda t, a: _with(t, (1,), -1)),
     ["cache_lengths"], []),
    ("length past max_pages*P", set_("cache_lengths", lambda t, a: _with(t, (0,), 9)),
     ["cache_lengths", "lookup_table"], []),
    ("T < offsets[B]", lambda a, kv: a.update(key=a["key"][:5], value=a["value"][:5]),
     ["input_row_offsets"], []),
    ("duplicate slot", set_("lookup_table", lambda t, a: _with(t, (1, 0), int(t[0, 1]))),
     ["lookup_table"], []),
    ("key 2-D", set_("key", lambda t, a: t[:, 0]), ["key"], []),
    ("key float64", set_("key", lambda t, a: t.double()), ["key"], []),
    ("key int32", set_("key", lambda t, a: t.int()), ["key"], []),
    ("key fp8", set_("key", lambda t, a: t.to(torch.float8_e4m3fn)), ["key"], []),
    ("key Hk mismatch", set_("key", lambda t, a: t[:, :1]), ["key"], []),
    ("key D mismatch", set_("key", lambda t, a: t[..., :16]), ["key"], []),
    ("key stride(-1) != 1", set_("key", lambda t, a: strided_last(t)), ["key"], []),
    ("value T mismatch", set_("value", lambda t, a: t[:-1]), ["value"], []),
    ("value Dv mismatch", set_("value", lambda t, a: t[..., :16]), ["value"], []),
    ("value stride(-1) != 1", set_("value", lambda t, a: strided_last(t)), ["value"], []),
    ("value dtype", set_("value", lambda t, a: t.to(torch.int64)), ["value"], []),
    ("value None, v_cache set", set_("value", lambda t, a: None), ["value"], []),
    ("v_cache None, value set", set_("v_cache", lambda t, a: None), ["v_cache", "value"], []),
    ("k_cache 3-D", set_("k_cache", lambda t, a: t[0]), ["k_cache"], []),
    ("k_cache int8", set_("k_cache", lambda t, a: torch.zeros(t.shape, dtype=torch.int8,
                                                              device=t.device)), ["k_cache"], []),
    ("k_cache float64", set_("k_cache", lambda t, a: torch.zeros(t.shape, dtype=torch.float64,
                                                                 device=t.device)), ["k_cache"], []),
    ("k_cache stride(-1) != 1", set_("k_cache", lambda t, a: strided_last(t)), ["k_cache"], []),
    ("k_cache broadcast page", set_("k_cache", lambda t, a: t[:1].expand(t.shape)), ["k_cache"],
     []),
    ("v_cache N mismatch", set_("v_cache", lambda t, a: t[:-1]), ["v_cache"], []),
    ("v_cache P mismatch", set_("v_cache", lambda t, a: t[:, :-1]), ["v_cache"], []),
    ("v_cache Hk mismatch", set_("v_cache", lambda t, a: t[:, :, :1]), ["v_cache", "value"], []),
    ("k_scales missing", set_("k_scales", lambda t, a: None), ["k_scales"], []),
    ("v_scales missing", set_("v_scales", lambda t, a: None), ["v_scales"], []),
    ("k_scales float16", set_("k_scales", lambda t, a: t.half()), ["k_scales"], ["float32"]),
    ("k_scales groups", set_("k_scales", lambda t, a: t[..., :1]), ["k_scales"], []),
    ("k_scales N", set_("k_scales", lambda t, a: t[:-1]), ["k_scales"], []),
    ("v_scales Hk", set_("v_scales", lambda t, a: t[:, :, :1]), ["v_scales"], []),
    ("k_scales stride(-1) != 1", set_("k_scales", lambda t, a: strided_last(t)), ["k_scales"], []),
    ("quant_group 0", set_("quant_group", lambda t, a: 0), ["quant_group"], []),
    ("quant_group -8", set_("quant_group", lambda t, a: -8), ["quant_group"], []),
    ("quant_group vs scales", set_("quant_group", lambda t, a: 8), ["k_scales", "quant_group"], []),
]

STORE_FLOAT_ERRORS = [
    ("k_scales for float cache", None, ["k_scales"], []),
    ("v_scales for float cache", None, ["v_scales"], []),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", STORE_ERRORS, ids=ids(STORE_ERRORS))
def test_paged_store_errors(device, case):
    _, mutate, names, fragments = case
    kv, args = store_call(device)
    mutate(args, kv)
    expect_error(device, torch.ops.pagedkv.paged_store, kv, args, names, fragments)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", STORE_FLOAT_ERRORS, ids=ids(STORE_FLOAT_ERRORS))
def test_paged_store_extra_scales(device, case):
    name, _, names, _ = case
    kv, args = store_call(device, torch.bfloat16)
    groups = -(-D // G)
    scales = torch.ones((kv.num_pages, P, HK, groups), device=device)
    args["k_scales" if name.startswith("k_") else "v_scales"] = scales
    expect_error(device, torch.ops.pagedkv.paged_store, kv, args, names)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_k_only_errors(device):
    kv, args = store_call(device, k_only=True)
    args["value"] = torch.zeros_like(args["key"])
    expect_error(device, torch.ops.pagedkv.paged_store, kv, args, ["value", "v_cache"])
    kv, args = store_call(device, k_only=True)
    args["v_scales"] = args["k_scales"]
    expect_error(device, torch.ops.pagedkv.paged_store, kv, args, ["v_scales"])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_python_wrapper_errors(device):
    kv, args = store_call(device)
    args["lookup_table"] = args["lookup_table"].long()
    expect_error(device, pagedkv.paged_store, kv, args, ["lookup_table"])


@CUDA_ONLY
@pytest.mark.parametrize("moved", ["lookup_table", "cache_lengths", "input_row_offsets", "key",
                                   "k_scales", "v_cache"])
def test_paged_store_mixed_devices(moved):
    kv, args = store_call("cuda")
    args[moved] = args[moved].cpu()
    expect_error("cuda", torch.ops.pagedkv.paged_store, kv, args, [moved, "device"])



# ---------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_name)
def test_opcheck_paged_store(device, dtype):
    gen, kv, batch = small_setup(device, dtype)
    key = randn(gen, (batch.num_tokens, 2, 32), torch.float32, device)
    value = randn(gen, (batch.num_tokens, 2, 32), torch.float32, device)
    k, v, ks, vs = kv.views
    supported_or_skip(
        device, opcheck, torch.ops.pagedkv.paged_store.default,
        (key, value, k, v, batch.input_row_offsets, batch.cache_lengths, batch.lookup_table,
         ks, vs, 16),
        cache_dtype=dtype,
    )



@CUDA_ONLY
def test_paged_store_cuda_skips_out_of_range_indices_without_checks():
    """With host checks off, bad page ids / lengths are skipped on the device, nothing else is written."""
    pagedkv.set_checks(False)
    k = torch.full((4, 8, 1, 64), 5.0, dtype=torch.bfloat16, device="cuda")
    v = k.clone()
    key = torch.randn((3, 1, 64), dtype=torch.bfloat16, device="cuda")
    table = torch.tensor([[-1, 9], [100, 2], [1, 1]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([0, 0, 10_000], dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    torch.ops.pagedkv.paged_store(key, key, k, v, offsets, lengths, table)
    torch.cuda.synchronize()
    assert bool((k == 5.0).all()) and bool((v == 5.0).all())


@CUDA_ONLY
def test_paged_store_cuda_checks_raise_before_writing():
    """PAGEDKV_CHECK=1 on CUDA: bad index values raise on the host, the cache stays as it was."""
    pagedkv.set_checks(True)
    k = torch.zeros((4, 8, 1, 64), dtype=torch.bfloat16, device="cuda")
    key = torch.randn((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([0], dtype=torch.int32, device="cuda")
    bad_table = torch.tensor([[7]], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"lookup_table\[0, 0\] = 7"):
        torch.ops.pagedkv.paged_store(key, None, k, None, offsets, lengths, bad_table)
    assert bool((k == 0).all())
    with pytest.raises(RuntimeError, match="cache_lengths"):
        torch.ops.pagedkv.paged_store(key, None, k, None, offsets,
                                      torch.tensor([-1], dtype=torch.int32, device="cuda"),
                                      torch.tensor([[1]], dtype=torch.int32, device="cuda"))


@CUDA_ONLY
def test_paged_store_cuda_descriptor_errors_without_checks():
    pagedkv.set_checks(False)
    k = torch.zeros((4, 8, 1, 64), dtype=torch.bfloat16, device="cuda")
    key = torch.randn((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.pagedkv.paged_store(key, None, k, None, torch.tensor([0, 2], device="cuda"),
                                      torch.tensor([0], dtype=torch.int32, device="cuda"),
                                      torch.tensor([[1]], dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.pagedkv.paged_store(key, None, k, None, torch.tensor([0, 2], dtype=torch.int32),
                                      torch.tensor([0], dtype=torch.int32, device="cuda"),
                                      torch.tensor([[1]], dtype=torch.int32, device="cuda"))


# ---------------------------------------------------------------------------------------------
# seeded fuzz (CPU; scripts/test.sh also runs the `per_isa` tests on every CPU kernel path)


@pytest.mark.per_isa
@pytest.mark.parametrize("chunk", chunks("store"))
def test_paged_store_fuzz(chunk):
    run_chunk("store", chunk)


def test_paged_store_fuzz_chunks_run_every_case_once():
    """The chunks together run cases 0 .. cases_for("store") - 1, each once, so the CI run covers
    the PAGEDKV_FUZZ_CASES share it claims."""
    seen = []
    for chunk in range(CHUNKS):
        run_chunk("store", chunk, case=lambda op, index: seen.append((op, index)))
    assert seen == [("store", i) for i in range(cases_for("store"))]


def _store_one_group(values, dtype):
    key = torch.tensor([[values]], dtype=torch.float32)
    cache = torch.zeros((1, 1, 1, len(values)), dtype=dtype)
    scales = torch.zeros((1, 1, 1, 1))
    index = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([[0]], dtype=torch.int32))
    pagedkv.paged_store(key, None, cache, None, *index, scales, None, len(values))
    want_cache, want_scales = torch.zeros_like(cache), torch.zeros_like(scales)
    ref.paged_store(key, None, want_cache, None, *index, want_scales, None, len(values))
    return cache, scales, want_cache, want_scales


@pytest.mark.per_isa
@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("values", [[math.nan, 1.0], [1.0, math.nan], [math.nan]], ids=["first", "last", "alone"])
def test_paged_store_fp8_nan_group(values, dtype):
    """Contract: amax = max|x| is NaN, so scale = amax / FP8_MAX is NaN and every element is NaN.
    (Found by this fuzzer: the kernel used to drop a NaN that was not the group's last element.)"""
    cache, scales, want_cache, want_scales = _store_one_group(values, dtype)
    assert torch.isnan(scales).all() and torch.isnan(want_scales).all()
    assert torch.isnan(cache.float()).all() and torch.isnan(want_cache.float()).all()


@pytest.mark.per_isa
def test_paged_store_meta_argument_is_rejected_by_name():
    """A meta tensor among CPU tensors dispatches to the fake kernel, which must not succeed silently."""
    cache = torch.zeros((2, 2, 1, 4))
    index = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([[1]], dtype=torch.int32).to("meta"))
    with pytest.raises(RuntimeError, match="lookup_table must be on the same device"):
        pagedkv.paged_store(torch.ones((1, 1, 4)), None, cache, None, *index)
    assert cache.abs().sum() == 0


@pytest.mark.per_isa
def test_paged_store_rank_above_descriptor_limit_names_the_argument():
    cache = torch.zeros((2, 2, 1, 4, 1, 1, 1))
    with pytest.raises(RuntimeError, match="k_cache must be 4-D"):
        pagedkv.paged_store(torch.ones((1, 1, 4)), None, cache, None, torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([0], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32))

