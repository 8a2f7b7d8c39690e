"""paged_load on every device against pagedkv.reference: the grid, its error cases, opcheck,
CUDA-only behaviour, and the seeded fuzz chunks.

The load is a copy (FP8 dequantized as float(q) * s): `out` must match the reference byte for
byte, and its rows outside the gathered ranges (gaps between rows, trailing padding) must keep
their NaN. Caches start as NaN, so a read of an unused slot or page shows up in `out`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

pytestmark = pytest.mark.usefixtures("cuda_knobs")

# ---------------------------------------------------------------------------------------------
# grid

LOAD_AXES = {
    "out_dtype": FLOAT_DTYPES,
    "cache_dtype": CACHE_DTYPES,
    "head_dim": STORE_HEAD_DIMS,
    "page_size": PAGE_SIZES,
    "num_kv_heads": (1, 2, 8),
    "layout": LAYOUTS,
    "noncontig": (False, True),
    "quant_group": QUANT_GROUPS,
}
LOAD_BASE = dict(
    out_dtype=torch.float32, cache_dtype=torch.bfloat16, head_dim=128, page_size=16,
    num_kv_heads=2, layout="collection", noncontig=False, quant_group=128,
)
LOAD_CASES = build_cases(
    LOAD_BASE,
    LOAD_AXES,
    crosses=[
        ("cache_dtype", "out_dtype", "head_dim"),
        ("layout", "page_size", "noncontig"),
        ("cache_dtype", "head_dim", "quant_group"),
    ],
    samples=RANDOM_SAMPLES,
    seed=2,
)


def run_load(case, device, unused="random"):
    gen = generator(seed_from("load", case_id(case)))
    rows = rows_for(case["page_size"])
    kv, batch = make_setup(
        gen, rows, layout=case["layout"], page_size=case["page_size"],
        num_kv_heads=case["num_kv_heads"], head_dim=case["head_dim"], dtype=case["cache_dtype"],
        quant_group=case["quant_group"], noncontig=case["noncontig"], unused=unused,
        device=device,
    )
    kv.poison_("nan")
    fill_history(gen, kv, batch, torch.float32)
    seq_lens = batch.seq_lens
    # Output regions with gaps (rows past seq_lens[b] stay untouched) and trailing padding.
    gaps = torch.randint(0, 3, (len(rows),), generator=gen, dtype=torch.int32)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(seq_lens.cpu() + gaps, 0)
    offsets = offsets.to(device)
    D, H = case["head_dim"], case["num_kv_heads"]
    out = torch.empty((int(offsets[-1]) + 2, H, D + (4 if case["noncontig"] else 0)),
                      dtype=case["out_dtype"], device=device)
    poison_(out, "nan")
    out = out[..., :D]
    expected = out.clone()
    for which in ("k", "v"):
        cache = kv.k_cache if which == "k" else kv.v_cache
        scales = kv.k_scales if which == "k" else kv.v_scales
        ref.paged_load(cache, scales, batch.lookup_table, seq_lens, offsets, expected,
                       case["quant_group"])
        supported_or_skip(device, torch.ops.pagedkv.paged_load, cache, scales, batch.lookup_table,
                          seq_lens, offsets, out, case["quant_group"])
        assert_bytes_equal(out, expected, f"paged_load {which} {case_id(case)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", params(LOAD_CASES))
def test_paged_load(device, case):
    run_load(case, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_load_ignores_unused_table_entries(device, layout):
    run_load(normalize({**LOAD_BASE, "layout": layout}), device, unused="garbage")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=dtype_name)
def test_paged_load_python_convenience(device, cache_dtype):
    gen = generator(seed_from("load-convenience", str(cache_dtype)))
    kv, batch = make_setup(
        gen, [(3, 4), (0, 0), (10, 2)], layout="fa3", page_size=4, num_kv_heads=2, head_dim=64,
        dtype=cache_dtype, quant_group=32, device=device,
    )
    fill_history(gen, kv, batch)
    out = pagedkv.paged_load(kv.k_cache, batch.lookup_table, batch.seq_lens, scales=kv.k_scales,
                             quant_group=32)
    expected, _ = ref.contiguous_kv(kv.k_cache, kv.k_scales, batch.lookup_table, batch.seq_lens,
                                    quant_group=32)
    assert out.shape == (19, 2, 64)
    assert_bytes_equal(out, expected.to(out.dtype), "paged_load convenience")
    out16 = pagedkv.paged_load(kv.k_cache, batch.lookup_table, batch.seq_lens, scales=kv.k_scales,
                               out_dtype=torch.float16, quant_group=32)
    assert out16.dtype == torch.float16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("layout", ["separate", "collection", "continuous"])
def test_paged_load_whole_sequences_with_gaps(device, cache_dtype, out_dtype, layout):
    """Rows of 5, 0 and 33 tokens (groups of 64 over D = 128) into `out` with a gap of 1, 2, 3
    rows after each: the gaps keep their fill. The CUDA suite's byte-equality grid."""
    gen = generator(seed_from("load-gaps", str(cache_dtype), str(out_dtype), layout))
    kv, batch = make_setup(gen, [(5, 0), (0, 0), (33, 0)], layout=layout, page_size=16,
                           num_kv_heads=2, head_dim=128, dtype=cache_dtype, quant_group=64,
                           device=device)
    fill_history(gen, kv, batch)
    lens = batch.seq_lens
    offsets = torch.zeros(4, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lens.cpu(), 0) + torch.arange(1, 4, dtype=torch.int32)
    offsets = offsets.to(device)
    out = torch.full((int(offsets[-1]), 2, 128), -3.0, device=device).to(out_dtype)
    expected = out.clone()
    ref.paged_load(kv.k_cache, kv.k_scales, batch.lookup_table, lens, offsets, expected, 64)
    supported_or_skip(device, torch.ops.pagedkv.paged_load, kv.k_cache, kv.k_scales,
                      batch.lookup_table, lens, offsets, out, 64)
    assert_bytes_equal(out, expected, f"paged_load {layout}")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_load_strided_index_tensors(device):
    """A column slice of a preallocated table and seq_lens taken from wider metadata."""
    gen = generator(seed_from("strided-index"))
    kv, batch = make_setup(gen, [(5, 3), (0, 4), (9, 1)], layout="separate", page_size=4,
                           num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=device)
    fill_history(gen, kv, batch)
    table, _, _ = strided_index_tensors(batch, device)
    seq = torch.zeros((3, 2), dtype=torch.int32, device=device)
    seq[:, 0] = batch.seq_lens
    loaded = pagedkv.paged_load(kv.k_cache, table, seq[:, 0])
    reference_rows, _ = ref.contiguous_kv(kv.k_cache, None, batch.lookup_table, batch.seq_lens)
    assert_bytes_equal(loaded, reference_rows, "load with strided index tensors")


# ---------------------------------------------------------------------------------------------
# errors


def load_call(device, dtype=torch.float8_e4m3fn):
    gen, kv, batch = setup_call(device, dtype)
    seq_lens = batch.seq_lens  # [7, 2]
    args = dict(
        cache=kv.k_cache, scales=kv.k_scales, lookup_table=batch.lookup_table, seq_lens=seq_lens,
        output_row_offsets=torch.tensor([0, 7, 9], dtype=torch.int32, device=device),
        out=torch.zeros((10, HK, D), device=device), quant_group=G,
    )
    return kv, args


LOAD_ERRORS = index_errors("output_row_offsets", "seq_lens", "cache") + [
    ("seq_lens negative", set_("seq_lens", lambda t, a: _with(t, (1,), -1)), ["seq_lens"], []),
    ("seq_lens past max_pages*P", set_("seq_lens", lambda t, a: _with(t, (1,), 13)),
     ["seq_lens", "lookup_table", "output_row_offsets"], []),
    ("seq_lens past its output rows", set_("seq_lens", lambda t, a: _with(t, (0,), 8)),
     ["seq_lens", "output_row_offsets"], []),
    ("offsets[B] > out rows", set_("out", lambda t, a: t[:8]), ["output_row_offsets", "out"], []),
    ("out fp8", set_("out", lambda t, a: t.to(torch.float8_e4m3fn)), ["out"], []),
    ("out float64", set_("out", lambda t, a: t.double()), ["out"], []),
    ("out 2-D", set_("out", lambda t, a: t[:, 0]), ["out"], []),
    ("out Hk mismatch", set_("out", lambda t, a: t[:, :1]), ["out"], []),
    ("out D mismatch", set_("out", lambda t, a: t[..., :16]), ["out"], []),
    ("out stride(-1) != 1", set_("out", lambda t, a: strided_last(t)), ["out"], []),
    ("cache 3-D", set_("cache", lambda t, a: t[0]), ["cache"], []),
    ("cache stride(-1) != 1", set_("cache", lambda t, a: strided_last(t)), ["cache"], []),
    ("cache int32", set_("cache", lambda t, a: torch.zeros(t.shape, dtype=torch.int32,
                                                           device=t.device)), ["cache"], []),
    ("scales missing", set_("scales", lambda t, a: None), ["scales"], []),
    ("scales groups", set_("scales", lambda t, a: t[..., :1]), ["scales"], []),
    ("scales float64", set_("scales", lambda t, a: t.double()), ["scales"], []),
    ("quant_group 0", set_("quant_group", lambda t, a: 0), ["quant_group"], []),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", LOAD_ERRORS, ids=ids(LOAD_ERRORS))
def test_paged_load_errors(device, case):
    _, mutate, names, fragments = case
    kv, args = load_call(device)
    mutate(args, kv)
    expect_error(device, torch.ops.pagedkv.paged_load, kv, args, names, fragments)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_load_extra_scales(device):
    kv, args = load_call(device, torch.float16)
    args["scales"] = torch.ones((kv.num_pages, P, HK, 2), device=device)
    expect_error(device, torch.ops.pagedkv.paged_load, kv, args, ["scales"])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_load_python_wrapper_errors(device):
    kv, args = load_call(device)
    with pytest.raises((TypeError, ValueError, RuntimeError), match="seq_lens"):
        pagedkv.paged_load(args["cache"], args["lookup_table"], args["seq_lens"].long(),
                           scales=args["scales"], quant_group=G)
    with pytest.raises(RuntimeError, match="lookup_table"):
        pagedkv.paged_load(args["cache"], args["lookup_table"].long(), args["seq_lens"],
                           scales=args["scales"], quant_group=G)


@CUDA_ONLY
@pytest.mark.parametrize("moved", ["lookup_table", "seq_lens", "output_row_offsets", "out",
                                   "scales"])
def test_paged_load_mixed_devices(moved):
    kv, args = load_call("cuda")
    args[moved] = args[moved].cpu()
    expect_error("cuda", torch.ops.pagedkv.paged_load, kv, args, [moved, "device"])


@CUDA_ONLY
def test_paged_load_cuda_checks_raise_before_writing():
    """PAGEDKV_CHECK=1 on CUDA: seq_lens past the output rows raise on the host."""
    pagedkv.set_checks(True)
    k = torch.zeros((4, 8, 1, 64), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    out = torch.empty((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="output_row_offsets"):
        torch.ops.pagedkv.paged_load(k, None, torch.tensor([[1]], dtype=torch.int32, device="cuda"),
                                     torch.tensor([3], dtype=torch.int32, device="cuda"), offsets, out)


# ---------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", OPCHECK_DTYPES, ids=dtype_name)
def test_opcheck_paged_load(device, dtype):
    gen, kv, batch = small_setup(device, dtype)
    out = torch.zeros((int(batch.seq_lens.sum()), 2, 32), device=device)
    offsets = torch.tensor([0, 7, 7, 14], dtype=torch.int32, device=device)
    supported_or_skip(
        device, opcheck, torch.ops.pagedkv.paged_load.default,
        (kv.k_cache, kv.k_scales, batch.lookup_table, batch.seq_lens, offsets, out, 16),
        cache_dtype=dtype,
    )


# ---------------------------------------------------------------------------------------------
# seeded fuzz (CPU; scripts/test.sh also runs the `per_isa` tests on every CPU kernel path)


@pytest.mark.per_isa
@pytest.mark.parametrize("chunk", chunks("load"))
def test_paged_load_fuzz(chunk):
    run_chunk("load", chunk)


def test_paged_load_fuzz_chunks_run_every_case_once():
    seen = []
    for chunk in range(CHUNKS):
        run_chunk("load", chunk, case=lambda op, index: seen.append((op, index)))
    assert seen == [("load", i) for i in range(cases_for("load"))]


@pytest.mark.per_isa
def test_paged_load_meta_argument_is_rejected_by_name():
    """A meta tensor among CPU tensors dispatches to the fake kernel, which must not succeed silently."""
    cache = torch.zeros((2, 2, 1, 4))
    index = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([[1]], dtype=torch.int32).to("meta"))
    with pytest.raises(RuntimeError, match="lookup_table must be on the same device"):
        torch.ops.pagedkv.paged_load(cache, None, index[2], index[1] + 1, index[0], torch.empty((1, 1, 4)))
    assert cache.abs().sum() == 0


def test_paged_load_convenience_refuses_meta_seq_lens_by_name():
    meta = torch.zeros((4, 2, 1, 4), device="meta")
    table, lengths = torch.zeros((1, 2), dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_load: seq_lens must hold values"):
        pagedkv.paged_load(meta, table.to("meta"), lengths.to("meta"))
    # the op itself takes meta tensors throughout (its fake kernel: shapes only)
    torch.ops.pagedkv.paged_load(meta, None, table.to("meta"), lengths.to("meta"),
                                 torch.tensor([0, 3], dtype=torch.int32, device="meta"),
                                 torch.empty((3, 1, 4), device="meta"))


# Not per_isa: the per-ISA runs of scripts/test.sh always left out this subprocess test (up to 120 s).
def test_paged_load_walks_only_the_table_columns_rows_need():
    """A lookup table broadcast to 2^40 columns (legal, read-only) once made paged_load iterate
    B * cols work items (hours, and B * cols can overflow int64); it must read only the columns
    seq_lens cover. Run in a subprocess so a regression fails on the timeout instead of hanging."""
    code = (
        "import torch, pagedkv\n"
        "from pagedkv import reference as ref\n"
        "cache = torch.randn(4, 16, 2, 8)\n"
        "table = torch.tensor([[2], [1]], dtype=torch.int32).expand(2, 2**40)\n"
        "lens = torch.tensor([5, 16], dtype=torch.int32)\n"
        "offs = torch.tensor([0, 5, 21], dtype=torch.int32)\n"
        "out = torch.empty(21, 2, 8)\n"
        "torch.ops.pagedkv.paged_load(cache, None, table, lens, offs, out)\n"
        "want = torch.cat([cache[2, :5], cache[1, :16]])\n"
        "assert torch.equal(out, want), (out - want).abs().max()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.per_isa
@pytest.mark.parametrize("lengths", [[-1], [2**31 - 1], [8, -3]])
def test_paged_load_convenience_validates_seq_lens_before_allocating(lengths):
    cache = torch.zeros((4, 2, 1, 4))
    table = torch.zeros((len(lengths), 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens must be"):
        pagedkv.paged_load(cache, table, torch.tensor(lengths, dtype=torch.int32))



@pytest.mark.parametrize("out_dtype,error,message", [
    (torch.float64, ValueError, "got torch.float64"),
    (torch.int32, ValueError, "got torch.int32"),
    (torch.float8_e4m3fn, ValueError, "got torch.float8_e4m3fn"),
    ("float32", TypeError, "be a torch.dtype or None, got str"),
], ids=["float64", "int32", "e4m3", "str"])
def test_paged_load_convenience_names_a_bad_out_dtype(out_dtype, error, message):
    """out_dtype=torch.float64 was reported as "out must be float32, ..." (an argument the caller never
    passed); a str reached torch.empty's error. Both name out_dtype now; the float dtypes work."""
    kv, args = load_call("cpu", torch.float16)
    call = (args["cache"], args["lookup_table"], args["seq_lens"])
    with pytest.raises(error, match=rf"^paged_load: out_dtype must .*{message}"):
        pagedkv.paged_load(*call, scales=args["scales"], out_dtype=out_dtype, quant_group=G)
    expected, _ = ref.contiguous_kv(args["cache"], args["scales"], args["lookup_table"], args["seq_lens"],
                                    quant_group=G, out_dtype=torch.float32)
    for good in FLOAT_DTYPES:
        out = pagedkv.paged_load(*call, scales=args["scales"], out_dtype=good, quant_group=G)
        assert out.dtype == good
        assert_bytes_equal(out, expected.to(good), f"paged_load out_dtype={good}")
