"""CUDA backend tests: every CUDA op against the reference (pagedkv.reference when it
provides the op, else the CPU ops, which implement the same contract), CUDA vs CPU
byte equality for the copy ops, each compiled K/V loader against the others, CUDA-graph
capture with new lengths on replay, the shared-memory tile image of every loader, and
PAGEDKV_CHECK=1 errors. Without a CUDA device (or a CPU-only build) everything skips.
"""

from __future__ import annotations

import math

import pytest
import torch

import pagedkv
from pagedkv import _C

HAS_CUDA = torch.cuda.is_available() and bool(getattr(_C, "with_cuda", False))
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of pagedkv")

ops = torch.ops.pagedkv
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
LOADERS = (0, 1, 2)  # cp.async, tma-pages, tma-gather4
LOADER_NAMES = {0: "cp.async", 1: "tma-pages", 2: "tma-gather4"}


def reference_op(name):
    """pagedkv.reference's op when it exists (another developer writes it), else the CPU op."""
    ref = getattr(pagedkv, "reference", None)
    fn = getattr(ref, name, None) if ref is not None else None
    return fn


def available_loaders(device=0):
    if not HAS_CUDA:
        return []
    return [l for l in LOADERS if _C.cuda_loader_available(device, l)]


@pytest.fixture(autouse=True)
def _reset_knobs():
    yield
    if HAS_CUDA:
        _C.set_cuda_loader(-1)
        pagedkv.set_checks(False)


# ----------------------------------------------------------------------------- case builder


class Case:
    """A paged K/V pool filled through the CPU paged_store, with random page placement.

    layout: "separate" ([N, P, Hk, D] each), "collection" (layer 1 of [N, 2, L, P, Hk, D]),
    "continuous" (P = max_len, one page per row).
    """

    def __init__(self, cached, new, page_size, hk, d, kv_dtype, layout="separate", group=128, pad_rows=0,
                 seed=0, fill=0.0):
        g = torch.Generator().manual_seed(seed)
        self.b = len(cached)
        self.cached = torch.tensor(cached, dtype=torch.int32)
        self.new = torch.tensor(new, dtype=torch.int32)
        totals = [c + n for c, n in zip(cached, new)]
        if layout == "continuous":
            page_size = max(max(totals), 1)
        pages = [max(1, math.ceil(t / page_size)) for t in totals]
        max_pages = max(pages) + 1
        n_pages = sum(pages) + 3
        perm = torch.randperm(n_pages, generator=g).to(torch.int32)
        # entries past a row's last used page are garbage: they must never be read
        table = torch.full((self.b, max_pages), 1 << 30, dtype=torch.int32)
        at = 0
        for i, p in enumerate(pages):
            table[i, :p] = perm[at:at + p]
            at += p
        self.table = table
        self.page_size, self.hk, self.d, self.group = page_size, hk, d, group
        self.kv_dtype = kv_dtype
        ng = math.ceil(d / group)
        if layout == "collection":
            blocks = torch.full((n_pages, 2, 2, page_size, hk, d), fill, dtype=torch.float32).to(kv_dtype)
            self.k, self.v = blocks[:, 0, 1], blocks[:, 1, 1]
            if kv_dtype in FP8:
                sb = torch.ones((n_pages, 2, 2, page_size, hk, ng), dtype=torch.float32)
                self.ks, self.vs = sb[:, 0, 1], sb[:, 1, 1]
            else:
                self.ks = self.vs = None
        else:
            self.k = torch.full((n_pages, page_size, hk, d), fill, dtype=torch.float32).to(kv_dtype)
            self.v = self.k.clone()
            if kv_dtype in FP8:
                self.ks = torch.ones((n_pages, page_size, hk, ng), dtype=torch.float32)
                self.vs = self.ks.clone()
            else:
                self.ks = self.vs = None
        # write every token of every row (positions [0, total)) with the CPU store
        keys = torch.randn((sum(totals), hk, d), generator=g)
        values = torch.randn((sum(totals), hk, d), generator=g)
        offsets = torch.zeros(self.b + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(torch.tensor(totals, dtype=torch.int32), 0)
        ops.paged_store(keys, values, self.k, self.v, offsets, torch.zeros(self.b, dtype=torch.int32), self.table,
                        self.ks, self.vs, group)
        self.offsets = torch.zeros(self.b + 1, dtype=torch.int32)
        self.offsets[1:] = torch.cumsum(self.new, 0)
        self.t = int(self.offsets[-1]) + pad_rows

    def tensors(self, device):
        names = ["k", "v", "ks", "vs", "table", "cached", "offsets"]
        return {n: (getattr(self, n).to(device) if getattr(self, n) is not None else None) for n in names}


def attn(case, q, device, **kw):
    t = case.tensors(device)
    return ops.flash_attn_paged(q.to(device), t["offsets"], t["k"], t["v"], t["cached"], t["table"],
                                kw.get("scale"), kw.get("causal", True), t["ks"], t["vs"], case.group,
                                kw.get("window_left", -1), kw.get("softcap", 0.0))


def attn_expected(case, q, **kw):
    ref = reference_op("flash_attn_paged")
    t = case.tensors("cpu")
    args = (q, t["offsets"], t["k"], t["v"], t["cached"], t["table"], kw.get("scale"), kw.get("causal", True),
            t["ks"], t["vs"], case.group, kw.get("window_left", -1), kw.get("softcap", 0.0))
    if ref is not None:
        return ref(*args)
    return ops.flash_attn_paged(*args)


def tol(dtype):
    return {torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]


def assert_close_attn(got, want, dtype, fp8=False):
    a = tol(dtype) * (2 if fp8 else 1)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=a, rtol=a)


# ----------------------------------------------------------------------------- paged_store / paged_load

STORE_SRC = [torch.float32, torch.float16, torch.bfloat16]
STORE_CACHE = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("src_dtype", STORE_SRC)
@pytest.mark.parametrize("cache_dtype", STORE_CACHE)
@pytest.mark.parametrize("page_size,group,d", [(16, 128, 128), (1, 32, 64), (7, 48, 96), (16, 1, 32), (5, 256, 80)])
def test_store_matches_cpu_bytes(src_dtype, cache_dtype, page_size, group, d):
    """Same inputs, same initial (NaN-poisoned) cache: CUDA and CPU write identical bytes, nothing else changes."""
    g = torch.Generator().manual_seed(1)
    cached, new, hk = [3, 0, 17, 40], [5, 1, 0, 9], 2
    pages = [math.ceil((c + n) / page_size) for c, n in zip(cached, new)]
    n_pages = sum(pages) + 2
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)
    table = torch.full((4, max(pages)), 1 << 30, dtype=torch.int32)  # unused entries are garbage
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[at:at + p]
        at += p
    key = (torch.randn((sum(new) + 2, hk, d), generator=g) * 3).to(src_dtype)
    value = torch.randn((sum(new) + 2, hk, d), generator=g).to(src_dtype)
    offsets = torch.tensor([0] + torch.cumsum(torch.tensor(new), 0).tolist(), dtype=torch.int32)
    lengths = torch.tensor(cached, dtype=torch.int32)
    k = torch.full((n_pages, page_size, hk, d), float("nan")).to(cache_dtype)
    v = k.clone()
    ks = vs = None
    if cache_dtype in FP8:
        ks = torch.full((n_pages, page_size, hk, math.ceil(d / group)), -7.0)
        vs = ks.clone()
    cpu = [k, v, ks, vs]
    gpu = [x.cuda() if x is not None else None for x in cpu]
    ops.paged_store(key, value, k, v, offsets, lengths, table, ks, vs, group)
    ops.paged_store(key.cuda(), value.cuda(), gpu[0], gpu[1], offsets.cuda(), lengths.cuda(), table.cuda(), gpu[2],
                    gpu[3], group)
    for c, gt in zip(cpu, gpu):
        if c is not None:
            assert torch.equal(_bits(c), _bits(gt.cpu()))


def _bits(x):
    return x.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


@pytest.mark.parametrize("cache_dtype", STORE_CACHE)
@pytest.mark.parametrize("out_dtype", STORE_SRC)
@pytest.mark.parametrize("layout", ["separate", "collection", "continuous"])
def test_load_matches_cpu_bytes(cache_dtype, out_dtype, layout):
    case = Case([5, 0, 33], [0, 0, 0], 16, 2, 128, cache_dtype, layout=layout, group=64)
    lens = case.cached.clone()
    offs = torch.zeros(case.b + 1, dtype=torch.int32)
    offs[1:] = torch.cumsum(lens, 0) + torch.arange(1, case.b + 1, dtype=torch.int32)  # gaps stay untouched
    out = torch.full((int(offs[-1]), 2, 128), -3.0).to(out_dtype)
    out_gpu = out.cuda()
    ops.paged_load(case.k, case.ks, case.table, lens, offs, out, case.group)
    ops.paged_load(case.k.cuda(), case.ks.cuda() if case.ks is not None else None, case.table.cuda(), lens.cuda(),
                   offs.cuda(), out_gpu, case.group)
    assert torch.equal(_bits(out), _bits(out_gpu.cpu()))


def test_store_skips_out_of_range_indices_without_checks():
    """With host checks off, bad page ids / lengths are skipped on the device, nothing else is written."""
    pagedkv.set_checks(False)
    k = torch.full((4, 8, 1, 64), 5.0, dtype=torch.bfloat16, device="cuda")
    v = k.clone()
    key = torch.randn((3, 1, 64), dtype=torch.bfloat16, device="cuda")
    table = torch.tensor([[-1, 9], [100, 2], [1, 1]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([0, 0, 10_000], dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    ops.paged_store(key, key, k, v, offsets, lengths, table)
    torch.cuda.synchronize()
    assert bool((k == 5.0).all()) and bool((v == 5.0).all())


# ----------------------------------------------------------------------------- flash_attn_paged

HEAD_DIMS = [64, 96, 128, 256]
Q_DTYPES = [torch.float16, torch.bfloat16]


def kv_dtypes_for(q_dtype):
    return [q_dtype, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("kv_kind", ["same", "e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [1, 16, 64, 5])
def test_decode_grid(d, q_dtype, kv_kind, page_size):
    kv = {"same": q_dtype, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kv_kind]
    case = Case([0, 37, 300, 129], [1, 1, 1, 1], page_size, 2, d, kv, group=128 if d != 96 else 32, pad_rows=2)
    q = torch.randn((case.t, 8, d)).to(q_dtype)
    got = attn(case, q, "cuda")
    want = attn_expected(case, q)
    assert_close_attn(got, want, q_dtype, fp8=kv in FP8)
    assert bool((got[-2:] == 0).all()), "padding rows must be zeros"


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_and_chunked_prefill(d, q_dtype, hq, hk, causal):
    # row 0: fresh prefill, row 1: chunk appended to a prefix, row 2: empty, row 3: long chunk
    case = Case([0, 100, 7, 30], [70, 33, 0, 150], 16, hk, d, q_dtype, pad_rows=3, seed=2)
    q = torch.randn((case.t, hq, d)).to(q_dtype)
    got = attn(case, q, "cuda", causal=causal)
    want = attn_expected(case, q, causal=causal)
    assert_close_attn(got, want, q_dtype)


@pytest.mark.parametrize("window_left", [0, 5, 64])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_window_and_softcap(window_left, softcap):
    case = Case([10, 200], [40, 1], 16, 2, 128, torch.bfloat16, seed=3)
    q = (torch.randn((case.t, 4, 128)) * 4).to(torch.bfloat16)
    got = attn(case, q, "cuda", window_left=window_left, softcap=softcap)
    want = attn_expected(case, q, window_left=window_left, softcap=softcap)
    assert_close_attn(got, want, torch.bfloat16)


@pytest.mark.parametrize("layout", ["separate", "collection", "continuous"])
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_layouts(layout, kv):
    case = Case([20, 64, 0], [3, 1, 17], 16, 2, 128, kv, layout=layout, seed=4)
    q = torch.randn((case.t, 4, 128)).to(torch.bfloat16)
    assert_close_attn(attn(case, q, "cuda"), attn_expected(case, q), torch.bfloat16, fp8=kv in FP8)


@pytest.mark.parametrize("group", [16, 32, 100, 128, 1000])
def test_fp8_groups(group):
    case = Case([50, 3], [2, 9], 16, 1, 128, torch.float8_e4m3fn, group=group, seed=5)
    q = torch.randn((case.t, 2, 128)).to(torch.float16)
    assert_close_attn(attn(case, q, "cuda"), attn_expected(case, q), torch.float16, fp8=True)


def test_nan_in_unused_slots_never_reaches_output():
    """Unwritten slots (tails of last pages, spare pages) hold NaN; outputs stay finite."""
    for kv in (torch.bfloat16, torch.float8_e5m2):
        case = Case([13, 1, 0], [1, 1, 5], 16, 2, 128, kv, fill=float("nan"), seed=6)
        q = torch.randn((case.t, 4, 128)).to(torch.bfloat16)
        got = attn(case, q, "cuda")
        assert bool(torch.isfinite(got.float()).all())
        assert_close_attn(got, attn_expected(case, q), torch.bfloat16, fp8=kv in FP8)


def test_long_decode_uses_split_kv():
    """B = 1 with a long row: split-KV plus the log-sum-exp merge must match."""
    case = Case([20_000], [1], 16, 1, 128, torch.bfloat16, seed=7)
    q = torch.randn((case.t, 8, 128)).to(torch.bfloat16)
    assert_close_attn(attn(case, q, "cuda"), attn_expected(case, q), torch.bfloat16)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("page_size", [16, 64, 128, 3])
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_each_loader_matches(loader, page_size, kv):
    if loader not in available_loaders():
        pytest.skip(f"{LOADER_NAMES[loader]} is not available on this device")
    case = Case([0, 77, 130], [40, 1, 2], page_size, 2, 128, kv, seed=8)
    q = torch.randn((case.t, 8, 128)).to(torch.bfloat16)
    want = attn_expected(case, q)
    _C.set_cuda_loader(loader)
    try:
        got = attn(case, q, "cuda")
    except RuntimeError as e:  # this page size does not fit the TMA loader
        assert "does not fit" in str(e)
        return
    assert_close_attn(got, want, torch.bfloat16, fp8=kv in FP8)


def test_out_variant_and_strided_q():
    case = Case([9, 40], [4, 2], 16, 2, 64, torch.float16, seed=9)
    base = torch.randn((case.t, 8, 96)).to(torch.float16)
    q = base[:, :, 16:80]  # not contiguous, 16-byte aligned rows are not guaranteed
    want = attn_expected(case, q.contiguous())
    out = torch.full((case.t, 8, 64), 9.0, dtype=torch.float16, device="cuda")
    t = case.tensors("cuda")
    pagedkv.flash_attn_paged(q.cuda(), t["offsets"], t["k"], t["v"], t["cached"], t["table"], out=out)
    assert_close_attn(out, want, torch.float16)


def test_unsupported_raises():
    case = Case([4], [1], 16, 1, 128, torch.bfloat16)
    with pytest.raises(RuntimeError, match="not supported on CUDA"):
        attn(case, torch.randn((1, 1, 128)), "cuda")  # float32 queries
    case = Case([4], [1], 16, 1, 80, torch.bfloat16)
    with pytest.raises(RuntimeError, match="not supported on CUDA"):
        attn(case, torch.randn((1, 1, 80)).to(torch.bfloat16), "cuda")


# ----------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_decode_replay_with_new_lengths():
    d, hq, hk, b, p = 128, 8, 2, 4, 16
    case = Case([100, 5, 60, 250], [1, 1, 1, 1], p, hk, d, torch.bfloat16, seed=10)
    t = case.tensors("cuda")
    q = torch.randn((b, hq, d), device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    lengths = t["cached"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture
            ops.flash_attn_paged.out(q, t["offsets"], t["k"], t["v"], lengths, t["table"], out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.flash_attn_paged.out(q, t["offsets"], t["k"], t["v"], lengths, t["table"], out=out)
    for new_lengths in ([100, 5, 60, 250], [1, 31, 0, 17], [255, 200, 128, 2]):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(torch.randn((b, hq, d)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.flash_attn_paged(q, t["offsets"], t["k"], t["v"], lengths, t["table"])
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


# ----------------------------------------------------------------------------- shared-memory tile image


def expected_tile_image(cache, table, seq_len, b, head, first_key, rows):
    """The layout of tile.cuh: [row_bytes / 128 chunks][rows][128 B], unit j of row r at j ^ (r & 7)."""
    es = cache.element_size()
    d = cache.shape[-1]
    row_bytes = math.ceil(d * es / 128) * 128
    img = torch.zeros((row_bytes // 128, rows, 8, 16), dtype=torch.uint8)
    n_pages, p = cache.shape[0], cache.shape[1]
    for r in range(rows):
        key = first_key + r
        if key >= seq_len:
            continue
        page = int(table[b, key // p])
        if page < 0 or page >= n_pages:
            continue
        raw = cache[page, key % p, head].contiguous().view(torch.uint8)
        for j in range(d * es // 16):
            img[j // 8, r, (j % 8) ^ (r % 8)] = raw[16 * j: 16 * j + 16]
    # flatten to the kernel's [rows, row_bytes] view of the same bytes
    return img.reshape(-1).reshape(rows, row_bytes)


@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_tile_image_same_for_every_loader(kv, page_size, d):
    case = Case([150, 70], [0, 0], page_size, 2, d, kv, fill=float("nan"), seed=11)
    table = case.table.clone()
    table[0, 1] = 10_000  # an out-of-range page id inside the row: masked rows read as zeros
    rows = 64 if d <= 128 else 32
    cache_gpu, table_gpu, lens_gpu = case.k.cuda(), table.cuda(), case.cached.cuda()
    for first_key in (0, rows, 128):
        want = expected_tile_image(case.k, table, int(case.cached[0]), 0, 1, first_key, rows)
        for loader in available_loaders():
            try:
                got = ops.debug_load_tile(cache_gpu, table_gpu, lens_gpu, 0, 1, first_key, loader)
            except RuntimeError as e:
                assert "not supported" in str(e) or "does not fit" in str(e)
                continue
            assert torch.equal(got.cpu().reshape(-1), want.reshape(-1)), LOADER_NAMES[loader]


# ----------------------------------------------------------------------------- PAGEDKV_CHECK=1


def test_checks_raise_before_writing():
    pagedkv.set_checks(True)
    k = torch.zeros((4, 8, 1, 64), dtype=torch.bfloat16, device="cuda")
    key = torch.randn((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([0], dtype=torch.int32, device="cuda")
    bad_table = torch.tensor([[7]], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"lookup_table\[0, 0\] = 7"):
        ops.paged_store(key, None, k, None, offsets, lengths, bad_table)
    assert bool((k == 0).all())
    with pytest.raises(RuntimeError, match="cache_lengths"):
        ops.paged_store(key, None, k, None, offsets, torch.tensor([-1], dtype=torch.int32, device="cuda"),
                        torch.tensor([[1]], dtype=torch.int32, device="cuda"))
    q = torch.randn((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="lookup_table"):
        ops.flash_attn_paged(q, offsets, k, k, lengths, bad_table)
    with pytest.raises(RuntimeError, match="output_row_offsets"):
        ops.paged_load(k, None, torch.tensor([[1]], dtype=torch.int32, device="cuda"), torch.tensor(
            [3], dtype=torch.int32, device="cuda"), offsets, torch.empty((2, 1, 64), dtype=torch.bfloat16,
                                                                        device="cuda"))


def test_descriptor_errors_without_checks():
    pagedkv.set_checks(False)
    k = torch.zeros((4, 8, 1, 64), dtype=torch.bfloat16, device="cuda")
    key = torch.randn((2, 1, 64), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_store(key, None, k, None, torch.tensor([0, 2], device="cuda"),
                        torch.tensor([0], dtype=torch.int32, device="cuda"),
                        torch.tensor([[1]], dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="same device"):
        ops.paged_store(key, None, k, None, torch.tensor([0, 2], dtype=torch.int32),
                        torch.tensor([0], dtype=torch.int32, device="cuda"),
                        torch.tensor([[1]], dtype=torch.int32, device="cuda"))
