"""flash_attn_paged_sparse (top-k attention over listed tokens) against the reference.

Grid: every cache dtype, half and full precision queries, one list per KV head or one shared list, GQA,
softcap, sinks, duplicates and -1 entries, rows that list nothing, the four layouts, and K-only (MLA)
caches with V as the first 512 columns of K. scripts/test.sh reruns the `per_isa` tests on every
other CPU kernel path.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from op_helpers import *  # noqa: F403  (pagedkv, ref and the shared helpers: op_helpers.__all__)

NUM_KV_HEADS = 2
TOKENS = 5


def random_indices(gen, num_tokens, lists, listed, num_tokens_in_pool, device):
    """[T, lists, K] encoded tokens with duplicates and -1 entries; the last row lists nothing."""
    ix = torch.randint(0, num_tokens_in_pool, (num_tokens, lists, listed), generator=gen, dtype=torch.int32)
    ix[:, :, 0] = ix[:, :, 1]  # a duplicate in every list
    holes = torch.rand((num_tokens, lists, listed), generator=gen) < 0.2
    ix[holes] = -1
    ix[-1] = -1
    return ix.to(device)


def fill_pool(gen, kv):
    """Random values in every slot of the pool (quantized with scales for FP8)."""
    k, v, ks, vs = kv.views
    n, p = k.shape[0], k.shape[1]
    keys = randn(gen, (n * p, k.shape[2], k.shape[3]))
    values = None if v is None else randn(gen, (n * p, v.shape[2], v.shape[3]))
    table = torch.arange(n, dtype=torch.int32, device=k.device).view(1, n)
    offsets = torch.tensor([0, n * p], dtype=torch.int32, device=k.device)
    zero = torch.zeros(1, dtype=torch.int32, device=k.device)
    ref.paged_store(keys.to(k.device), None if values is None else values.to(k.device), k, v, offsets, zero, table,
                    ks, vs, kv.quant_group)


CASES = [
    dict(q_dtype=q, cache_dtype=c, layout=layout, gqa=gqa, shared=shared, softcap=cap, sinks=sinks)
    for (q, c), layout, gqa, shared, cap, sinks in itertools.product(
        [(torch.float32, c) for c in CACHE_DTYPES] + [(torch.bfloat16, torch.bfloat16)],
        ["separate"], [4], [False, True], [0.0], [False],
    )
] + [
    dict(q_dtype=torch.float32, cache_dtype=torch.bfloat16, layout=layout, gqa=gqa, shared=False, softcap=cap,
         sinks=sinks)
    for layout, gqa, (cap, sinks) in itertools.product(
        [lay for lay in LAYOUTS if lay != "continuous"], [1, 4], [(0.0, True), (2.0, False), (2.0, True)]
    )
]


def case_name(case):
    return "-".join(f"{k}={dtype_name(v) if isinstance(v, torch.dtype) else v}" for k, v in case.items())


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_sparse_matches_reference(device, case):
    gen = generator(seed_from("sparse", case_name(case)))
    kv = make_paged_kv(case["layout"], num_pages=9, page_size=8, num_kv_heads=NUM_KV_HEADS, head_dim=64,
                       dtype=case["cache_dtype"], quant_group=32, device=device)
    fill_pool(gen, kv)
    hq = NUM_KV_HEADS * case["gqa"]
    q = randn(gen, (TOKENS, hq, 64), case["q_dtype"], device)
    indices = random_indices(gen, TOKENS, 1 if case["shared"] else NUM_KV_HEADS, 23, 9 * 8, device)
    sinks = randn(gen, (hq,), torch.float32, device, scale=2.0) if case["sinks"] else None
    args = (q, kv.k_cache, kv.v_cache, indices, None, kv.k_scales, kv.v_scales, 32, case["softcap"], sinks)
    before = kv.snapshot()
    out = pagedkv.flash_attn_paged_sparse(*args)
    expected = ref.flash_attn_paged_sparse(q.double(), *args[1:])
    assert_attention_close(out, expected, case["q_dtype"], case_name(case))
    assert (out[-1] == 0).all(), "a row that lists no token outputs zeros"
    for name, base in before.items():
        assert_bytes_equal(kv.bases[name], base, f"cache {name} after a read-only op")


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=dtype_name)
def test_sparse_k_only_mla(device, cache_dtype):
    """MLA: one 576-wide latent cache; V is its first 512 columns (a view, no copy). The CPU kernel
    converts each row once for both (float32: reads it in place)."""
    gen = generator(seed_from("mla", dtype_name(cache_dtype)))
    kv = make_paged_kv("separate", num_pages=6, page_size=16, num_kv_heads=1, head_dim=576, dtype=cache_dtype,
                       quant_group=128, k_only=True, device=device)
    fill_pool(gen, kv)
    k_scales = kv.k_scales
    v_cache = kv.k_cache[..., :512]
    v_scales = None if k_scales is None else k_scales[..., :4]
    q = randn(gen, (3, 8, 576), torch.bfloat16, device)
    indices = random_indices(gen, 3, 1, 40, 6 * 16, device)
    args = (q, kv.k_cache, v_cache, indices, 0.05, k_scales, v_scales, 128)
    out = pagedkv.flash_attn_paged_sparse(*args)
    expected = ref.flash_attn_paged_sparse(q.double(), *args[1:])
    assert out.shape == (3, 8, 512)
    assert_attention_close(out, expected, torch.bfloat16, "MLA sparse")


# The CPU kernel's edges: head sizes that leave a vector tail (36, 72, 40 are not multiples of 16,
# 36 not of 8; 36 with FP8 groups of 32 ends in a 4-wide group), lists longer than one 32-entry chunk
# and not a multiple of it, GQA groups of 1, 3 (padded to a pass of 4), 8 (one pass) and 16 (two
# passes), a page size that is not a power of two, float32 rows read in place or converted.
EDGE_CASES = [
    dict(head_dim=36, gqa=8, cache_dtype=torch.float32, page_size=6, softcap=0.0, sinks=False),
    dict(head_dim=64, gqa=1, cache_dtype=torch.float32, page_size=6, softcap=0.0, sinks=True),
    dict(head_dim=36, gqa=1, cache_dtype=FP8_DTYPES[0], page_size=8, softcap=0.0, sinks=False),
    dict(head_dim=72, gqa=3, cache_dtype=torch.bfloat16, page_size=8, softcap=3.0, sinks=False),
    dict(head_dim=40, gqa=16, cache_dtype=torch.float16, page_size=16, softcap=0.0, sinks=True),
]


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", EDGE_CASES, ids=case_name)
def test_sparse_vector_tails_long_lists_and_head_groups(device, case):
    gen = generator(seed_from("sparse-edges", case_name(case)))
    d, hk, tokens, num_pages = case["head_dim"], 2, 4, 20
    kv = make_paged_kv("separate", num_pages=num_pages, page_size=case["page_size"], num_kv_heads=hk, head_dim=d,
                       dtype=case["cache_dtype"], quant_group=32, device=device)
    fill_pool(gen, kv)
    hq = hk * case["gqa"]
    q = randn(gen, (tokens, hq, d), torch.float32, device)
    indices = random_indices(gen, tokens, hk, 70, num_pages * case["page_size"], device)
    sinks = randn(gen, (hq,), torch.float32, device, scale=2.0) if case["sinks"] else None
    args = (q, kv.k_cache, kv.v_cache, indices, None, kv.k_scales, kv.v_scales, 32, case["softcap"], sinks)
    out = pagedkv.flash_attn_paged_sparse(*args)
    expected = ref.flash_attn_paged_sparse(q.double(), *args[1:])
    assert_attention_close(out, expected, torch.float32, case_name(case))
    assert (out[-1] == 0).all(), "a row that lists no token outputs zeros"


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_equals_dense_over_the_same_tokens(device):
    """Listing every token of a row's pages in any order equals non-causal flash_attn_paged over them
    (float32 on the CPU; on CUDA, whose dense kernels take 16-bit queries and head sizes 64-256, bf16
    at D 64, to the bf16 attention tolerance: the two kernels round probabilities differently)."""
    gen = generator(9)
    dtype, d = (torch.float32, 32) if device == "cpu" else (torch.bfloat16, 64)
    kv = make_paged_kv("collection", num_pages=6, page_size=4, num_kv_heads=2, head_dim=d, dtype=dtype,
                       device=device)
    fill_pool(gen, kv)
    pages = torch.tensor([[4, 1, 3]], dtype=torch.int32, device=device)
    tokens = (pages[0].long().view(-1, 1) * 4 + torch.arange(4, device=device)).flatten()
    order = torch.randperm(tokens.numel(), generator=gen).to(device)
    q = randn(gen, (1, 4, d), dtype, device)
    sparse = pagedkv.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, tokens[order].view(1, 1, -1).to(torch.int32))
    dense = pagedkv.flash_attn_paged(q, torch.tensor([0, 1], dtype=torch.int32, device=device), kv.k_cache,
                                     kv.v_cache, torch.tensor([11], dtype=torch.int32, device=device), pages,
                                     causal=False)
    if device == "cpu":
        torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    else:
        assert_attention_close(sparse, dense.double(), dtype, "sparse vs dense")


def small(device="cpu"):
    gen = generator(2)
    kv = make_paged_kv("separate", num_pages=4, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                       device=device)
    fill_pool(gen, kv)
    q = randn(gen, (3, 4, 16), torch.float32, device)
    return kv, q


@pytest.mark.parametrize(
    "indices,match",
    [
        (torch.zeros(3, 2, 5, dtype=torch.int64), "indices must be int32, got int64"),
        (torch.zeros(3, 5, dtype=torch.int32), "indices must be 3-D"),
        (torch.zeros(2, 2, 5, dtype=torch.int32), r"indices.size\(0\) must be 3 \(T of q\)"),
        (torch.zeros(3, 3, 5, dtype=torch.int32), r"indices.size\(1\) must be 2 \(Hk"),
        (torch.tensor([0, 16, 1], dtype=torch.int32).view(3, 1, 1), r"indices\[1, 0, 0\] must be -1 .* \[0, 16\)"),
        (torch.tensor([0, 1, -2], dtype=torch.int32).view(3, 1, 1), r"indices\[2, 0, 0\] .* got -2"),
    ],
)
def test_bad_indices_name_the_argument(indices, match):
    kv, q = small()
    before = kv.snapshot()
    with pytest.raises(RuntimeError, match=match):
        pagedkv.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, indices)
    for name, base in before.items():
        assert_bytes_equal(kv.bases[name], base, name)


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,listed", [(3, 0), (0, 5), (0, 0)])
def test_sparse_empty_lists_and_batches(device, rows, listed):
    """Empty lists (K = 0: every row sees no token, zeros out, sinks or not) and an empty batch (T = 0).
    Such tensors may have no data pointer at all: the fuzzer found address arithmetic on one."""
    kv, q = small(device)
    q = q[:rows]
    indices = torch.empty((rows, 2, listed), dtype=torch.int32, device=device)
    for sinks in (None, torch.randn(4, device=device)):
        out = pagedkv.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, indices, sinks=sinks)
        expected = ref.flash_attn_paged_sparse(q, kv.k_cache, kv.v_cache, indices, sinks=sinks)
        assert out.shape == (rows, 4, 16) and out.dtype == q.dtype
        torch.testing.assert_close(out, expected.to(out.dtype))
        assert not out.any(), "a row that sees no token outputs zeros"


FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_opcheck_and_compile(device):
    kv, q = small(device)
    indices = torch.tensor([[[0, 5, -1], [3, 3, 15]]] * 3, dtype=torch.int32, device=device)
    sinks = torch.randn(4, device=device)
    args = (q, kv.k_cache, kv.v_cache, indices, 0.3, None, None, 128, 1.5, sinks)
    torch.library.opcheck(torch.ops.pagedkv.flash_attn_paged_sparse.default, args)
    compiled = torch.compile(lambda *a: pagedkv.flash_attn_paged_sparse(*a) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), pagedkv.flash_attn_paged_sparse(*args) * 2)


def test_fp8_opcheck():
    gen = generator(4)
    kv = make_paged_kv("separate", num_pages=4, page_size=4, num_kv_heads=2, head_dim=16,
                       dtype=FP8_DTYPES[0], quant_group=8)
    fill_pool(gen, kv)
    q = randn(gen, (2, 4, 16), torch.float32)
    indices = torch.tensor([[[0, 5]], [[9, -1]]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.pagedkv.flash_attn_paged_sparse.default,
                          (q, kv.k_cache, kv.v_cache, indices, None, kv.k_scales, kv.v_scales, 8),
                          test_utils=FP8_OPCHECK_UTILS)


# FP8 rows with one scale per (token, head) (quant_group >= D): the CPU kernels fold that scale into
# the score or the probability instead of scaling each element (for e4m3 also the widening's 2^8), on
# long lists (several chunks), GQA 1, 4 and 8, float32 and bf16 queries; one e4m3 K row and one V row
# hold a NaN code, which must reach exactly the outputs the reference makes NaN.
@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_sparse_fp8_row_scales(device, cache_dtype, gqa, q_dtype):
    gen = generator(seed_from("sparse-fp8-rows", dtype_name(cache_dtype), str(gqa), dtype_name(q_dtype)))
    d, hk, tokens, num_pages, page = 64, 2, 4, 12, 16
    kv = make_paged_kv("separate", num_pages=num_pages, page_size=page, num_kv_heads=hk, head_dim=d,
                       dtype=cache_dtype, quant_group=128, device=device)
    fill_pool(gen, kv)
    if cache_dtype == torch.float8_e4m3fn:  # NaN codes: K of token 5 head 0, V of token 17 head 1
        kv.k_cache.view(torch.uint8)[0, 5, 0, 3] = 0x7F
        kv.v_cache.view(torch.uint8)[1, 1, 1, 10] = 0xFF
    hq = hk * gqa
    q = randn(gen, (tokens, hq, d), q_dtype, device)
    indices = random_indices(gen, tokens, hk, 90, num_pages * page, device)
    indices[0, :, 2] = 5  # rows 0 and 1 list the NaN tokens
    indices[1, :, 7] = 16 + 1
    args = (q, kv.k_cache, kv.v_cache, indices, None, kv.k_scales, kv.v_scales, 128)
    out = pagedkv.flash_attn_paged_sparse(*args)
    expected = ref.flash_attn_paged_sparse(q.double(), *args[1:])
    assert torch.equal(out.isnan().cpu(), expected.isnan().cpu()), "NaN outputs differ from the reference's"
    finite = ~expected.isnan()
    assert_attention_close(torch.where(finite, out, 0), torch.where(finite, expected, 0).to(out.dtype), q_dtype,
                           f"{dtype_name(cache_dtype)} gqa={gqa}")
    assert (out[-1] == 0).all(), "a row that lists no token outputs zeros"
