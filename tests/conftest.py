"""Shared test helpers: devices, seeded data, the four cache layouts of CONTRACT.md, poison fills,
batches and the attention tolerance.

Where each kind of test lives (see also tests/README.md):
- tests/ops/test_<op>.py: one file per op (paged_store, paged_load, copy_pages, merge_attn_states,
  flash_attn_paged_lse, flash_attn_paged_sparse; flash_attn_paged with its .out variant in three
  files by concern: grid, kernel paths, errors): the op's grid, its error cases, its opcheck and its
  seeded fuzz chunks, every test parametrized over `DEVICES` (CPU always, CUDA when present) and
  compared with `pagedkv.reference`, the way ggml's test-backend-ops compares every backend with the
  CPU. Tests of CUDA-only behaviour (graph capture, PAGEDKV_CHECK=1, loaders, tile image) sit with
  them, marked `CUDA_ONLY`.
- tests/ops/grid_cases.py, error_cases.py, fuzz_cases.py: the case builders those files share;
  tests/ops/op_helpers.py: the one import that gives a test file these and this module's helpers.
- tests/test_<concern>.py: what is not one op: the reference itself, the CPU ISA paths against
  each other, pools over 2^31 elements, threads, torch.compile of a layer, the host allocator, the
  cache objects, the page manager, the demo, the benchmark harness; tests/hf/ the transformers
  integration (one file per concern).

A `PagedKV` holds the storage tensors ("bases") of one layout and rebuilds the strided per-layer
views from them, so a test can clone the whole storage, run the reference on the clone and the real
op on the original, and compare every byte of every base (which also proves that nothing outside the
addressed slots changed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from typing import Callable

import pytest
import torch

import pagedkv
from pagedkv import _C
from pagedkv import reference as ref

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
LAYOUTS = ("collection", "fa3", "separate", "continuous")

# Channels of padding added to the head dim (and one extra scale group) for non-contiguous views.
NONCONTIG_PAD = 8
# Layer used inside multi-layer layouts, so views never start at the base's first element.
VIEW_LAYER = 1
NUM_LAYERS = 2


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "per_isa: cheap op tests scripts/test.sh reruns under every PAGEDKV_CPU_ISA (kernel path)"
    )
    config.addinivalue_line(
        "markers", "soak: seeded load runs of the serving loop (tests/test_serving_soak.py, about a minute)"
    )


def _cuda_usable() -> bool:
    return torch.cuda.is_available() and bool(getattr(_C, "with_cuda", False))


HAS_CUDA = _cuda_usable()
CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of pagedkv")
# Every op test runs on each of these; the CUDA param skips where there is no GPU.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA_ONLY)]
# The shims' refusals: "... not supported on CUDA", "... not supported by the CUDA attention kernels yet".
UNSUPPORTED_ON_CUDA = ("not supported on CUDA", "not supported by the CUDA")


def supported_or_skip(device, op, *args, **kwargs):
    """Call `op`; on CUDA, a configuration the CUDA kernels do not implement (float32 caches,
    head sizes other than 64/96/128/256, ...: the shim raises "not supported on CUDA" after the
    shared argument checks) skips the case, as ggml's test-backend-ops skips what a backend does
    not support. On the CPU every configuration must run. (Any exception type: opcheck wraps the
    op's RuntimeError in its own.)"""
    try:
        return op(*args, **kwargs)
    except Exception as error:
        if device == "cuda" and any(marker in str(error) for marker in UNSUPPORTED_ON_CUDA):
            pytest.skip(str(error))
        raise


@pytest.fixture
def cuda_knobs():
    """Puts back the process-wide kernel options a test may change (forced K/V loader, host checks, split
    count, opt-in paths: pagedkv.set_kernel_options) to their values before the test."""
    previous = pagedkv.kernel_options()
    yield
    pagedkv.set_kernel_options(**previous)


@pytest.fixture
def kernel_options(cuda_knobs):
    """pagedkv.set_kernel_options for one test: every option is put back after it."""
    return pagedkv.set_kernel_options


@contextlib.contextmanager
def index_value_checks(device):
    """CONTRACT.md: index values are checked on CPU always, on CUDA when checks are on; error tests
    turn them on for CUDA so every device must reject the same calls."""
    if device == "cuda":
        pagedkv.set_checks(True)
    try:
        yield
    finally:
        pagedkv.set_checks(False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def seed_from(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


@pytest.fixture
def rng(request) -> torch.Generator:
    """A torch.Generator seeded from the test id: reproducible and different per test."""
    return generator(seed_from(request.node.nodeid))


def randn(gen, shape, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def poison_(t: torch.Tensor, kind: str = "nan", gen: torch.Generator | None = None) -> torch.Tensor:
    """Fill a (contiguous) tensor with NaN, or with random bytes (`kind="bytes"`)."""
    if kind == "nan":
        t.fill_(float("nan") if t.dtype.is_floating_point else -1)
    elif kind == "bytes":
        raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
        t.view(torch.uint8).copy_(raw.view(t.view(torch.uint8).shape).to(t.device))
    else:
        raise ValueError(kind)
    return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor"):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    a, e = as_bytes(actual).cpu(), as_bytes(expected).cpu()
    if torch.equal(a, e):
        return
    diff = (a != e).reshape(actual.shape + (-1,) if actual.dim() else (-1,)).any(-1)
    idx = diff.nonzero()[:5].tolist()
    first = tuple(idx[0])
    raise AssertionError(
        f"{what}: {int(diff.sum())} of {actual.numel()} elements differ; first at {idx}: "
        f"got {actual[first].float().item() if actual.dim() else actual.item()!r} "
        f"expected {expected[first].float().item() if expected.dim() else expected.item()!r}"
    )


# --------------------------------------------------------------------------------------------
# Layouts


@dataclasses.dataclass
class PagedKV:
    """Storage of one layout plus a function rebuilding the op views from it."""

    layout: str
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    quant_group: int
    k_only: bool
    noncontig: bool
    bases: dict[str, torch.Tensor]
    make_views: Callable[[dict], tuple]

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def views(self):
        """(k_cache, v_cache, k_scales, v_scales); v_* None for K-only, scales None for floats."""
        return self.make_views(self.bases)

    k_cache = property(lambda self: self.views[0])
    v_cache = property(lambda self: self.views[1])
    k_scales = property(lambda self: self.views[2])
    v_scales = property(lambda self: self.views[3])

    def clone(self) -> "PagedKV":
        return dataclasses.replace(self, bases={k: v.clone() for k, v in self.bases.items()})

    def poison_(self, kind="nan", gen=None) -> "PagedKV":
        for base in self.bases.values():
            poison_(base, kind, gen)
        return self

    def assert_equal(self, other: "PagedKV", what=""):
        for name in self.bases:
            assert_bytes_equal(self.bases[name], other.bases[name], f"{what} base {name!r}")

    def snapshot(self) -> dict:
        return {k: v.clone() for k, v in self.bases.items()}


def make_paged_kv(
    layout: str,
    *,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    quant_group: int = 128,
    k_only: bool = False,
    noncontig: bool = False,
    device="cpu",
) -> PagedKV:
    """Allocate one of the four layouts of CONTRACT.md and describe its views.

    - "collection": [N, 2|1, L, P, Hk, D] , views blocks[:, i, VIEW_LAYER]
    - "fa3":        [2|1, N, P, Hk, D]    , views blocks[i]
    - "separate":   K and V pools [N, P, Hk, D]; noncontig: one [N, P, 2, Hk, D] (K/V interleaved)
    - "continuous": [slots, 2|1, L, max_len, Hk, D], P = max_len, views blocks[:, i, VIEW_LAYER]
    `noncontig` pads the head dim (and the scale groups) so rows are not dense.
    The storage starts as NaN (-1 for integers) everywhere.
    """
    num_kv = 1 if k_only else 2
    pad = NONCONTIG_PAD if noncontig else 0
    groups = ref.num_scale_groups(head_dim, quant_group)
    fp8 = dtype in FP8_DTYPES
    N, P, H, D = num_pages, page_size, num_kv_heads, head_dim

    def alloc(lead, last, dt):
        return poison_(torch.empty((*lead, last), dtype=dt, device=device))

    if layout in ("collection", "continuous"):
        lead = (N, num_kv, NUM_LAYERS, P, H)
        bases = {"k": alloc(lead, D + pad, dtype)}
        if fp8:
            bases["ks"] = alloc(lead, groups + (1 if noncontig else 0), torch.float32)

        def views(b):
            kv = [b["k"][:, i, VIEW_LAYER, ..., :D] for i in range(num_kv)]
            sc = [b["ks"][:, i, VIEW_LAYER, ..., :groups] for i in range(num_kv)] if fp8 else []
            return _pack(kv, sc)

    elif layout == "fa3":
        lead = (num_kv, N, P, H)
        bases = {"k": alloc(lead, D + pad, dtype)}
        if fp8:
            bases["ks"] = alloc(lead, groups + (1 if noncontig else 0), torch.float32)

        def views(b):
            kv = [b["k"][i, ..., :D] for i in range(num_kv)]
            sc = [b["ks"][i, ..., :groups] for i in range(num_kv)] if fp8 else []
            return _pack(kv, sc)

    elif layout == "separate":
        if noncontig:
            lead = (N, P, num_kv, H)
            bases = {"k": alloc(lead, D + pad, dtype)}
            if fp8:
                bases["ks"] = alloc(lead, groups + 1, torch.float32)

            def views(b):
                kv = [b["k"][:, :, i, :, :D] for i in range(num_kv)]
                sc = [b["ks"][:, :, i, :, :groups] for i in range(num_kv)] if fp8 else []
                return _pack(kv, sc)

        else:
            lead = (N, P, H)
            names = ["k", "v"][:num_kv]
            bases = {n: alloc(lead, D, dtype) for n in names}
            if fp8:
                bases.update({n + "s": alloc(lead, groups, torch.float32) for n in names})

            def views(b):
                kv = [b[n] for n in names]
                sc = [b[n + "s"] for n in names] if fp8 else []
                return _pack(kv, sc)

    else:
        raise ValueError(f"unknown layout {layout!r}")
    return PagedKV(layout, N, P, H, D, dtype, quant_group, k_only, noncontig, bases, views)


def _pack(kv, sc):
    k = kv[0]
    v = kv[1] if len(kv) > 1 else None
    ks = sc[0] if sc else None
    vs = sc[1] if len(sc) > 1 else None
    return k, v, ks, vs


# --------------------------------------------------------------------------------------------
# Batches


@dataclasses.dataclass
class Batch:
    """Per-step metadata: rows (cache_length, new_tokens) and their int32 tensors."""

    rows: list  # [(cache_length, new_tokens)]
    num_tokens: int  # T >= offsets[B] (the rest is padding)
    input_row_offsets: torch.Tensor  # int32 [B+1]
    cache_lengths: torch.Tensor  # int32 [B]
    lookup_table: torch.Tensor  # int32 [B, max_pages]

    @property
    def seq_lens(self) -> torch.Tensor:  # int32 [B], lengths after the store
        return torch.tensor([c + n for c, n in self.rows], dtype=torch.int32).to(
            self.cache_lengths.device
        )

    @property
    def used_tokens(self) -> int:
        return sum(n for _, n in self.rows)


def pages_needed(rows, page_size):
    return [math.ceil((c + n) / page_size) for c, n in rows]


def make_batch(
    gen,
    rows,
    *,
    page_size: int,
    num_pages: int | None = None,
    padding: int = 0,
    extra_columns: int = 1,
    unused: str = "random",
    layout: str = "collection",
    device="cpu",
):
    """Build offsets, cache lengths and a lookup table over a random permutation of pages.

    `unused` fills table entries past each row's last page: "random" (valid ids of other pages),
    "garbage" (-1, N, INT32_MAX), or "zero". For "continuous" the table is [B, 1] (one slot per row).
    Returns (batch, num_pages).
    """
    counts = pages_needed(rows, page_size)
    if layout == "continuous":
        assert all(c <= 1 for c in counts), "continuous rows must fit one slot"
        counts = [1] * len(rows)
        extra_columns = 0
    total = sum(counts)
    if num_pages is None:
        num_pages = total + 3
    assert num_pages >= total
    perm = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(counts, default=0) + extra_columns
    max_pages = max(max_pages, 1)
    table = torch.empty((len(rows), max_pages), dtype=torch.int32)
    if unused == "random":
        table.copy_(torch.randint(0, num_pages, table.shape, generator=gen, dtype=torch.int32))
    elif unused == "garbage":
        choices = torch.tensor([-1, num_pages, 2**31 - 1, -(2**31)], dtype=torch.int32)
        table.copy_(choices[torch.randint(0, 4, table.shape, generator=gen)])
    elif unused == "zero":
        table.zero_()
    else:
        raise ValueError(unused)
    next_page = 0
    for b, count in enumerate(counts):
        table[b, :count] = torch.tensor(perm[next_page : next_page + count], dtype=torch.int32)
        next_page += count
    offsets = [0]
    for _, n in rows:
        offsets.append(offsets[-1] + n)
    batch = Batch(
        rows=list(rows),
        num_tokens=offsets[-1] + padding,
        input_row_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        cache_lengths=torch.tensor([c for c, _ in rows], dtype=torch.int32, device=device),
        lookup_table=table.to(device),
    )
    return batch, num_pages


def make_setup(
    gen,
    rows,
    *,
    layout,
    page_size,
    num_kv_heads,
    head_dim,
    dtype,
    quant_group=128,
    k_only=False,
    noncontig=False,
    padding=0,
    unused="random",
    extra_columns=1,
    device="cpu",
):
    """A layout sized for `rows` and its batch. For "continuous" P becomes the slot length."""
    if layout == "continuous":
        page_size = max([c + n for c, n in rows], default=0) + 3
    batch, num_pages = make_batch(
        gen, rows, page_size=page_size, padding=padding, unused=unused, layout=layout,
        extra_columns=extra_columns, device=device,
    )
    kv = make_paged_kv(
        layout,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        quant_group=quant_group,
        k_only=k_only,
        noncontig=noncontig,
        device=device,
    )
    return kv, batch


def ragged_inputs(gen, num_tokens, num_heads, head_dim, dtype, device="cpu", noncontig=False):
    """Random [T, H, D] input; `noncontig` slices it out of a wider fused tensor (like qkv)."""
    if not noncontig:
        return randn(gen, (num_tokens, num_heads, head_dim), dtype, device)
    fused = randn(gen, (num_tokens, num_heads + 3, head_dim + 4), dtype, device)
    return fused[:, 1 : num_heads + 1, 2 : head_dim + 2]


def fill_history(gen, kv: PagedKV, batch: Batch, key_dtype=torch.float32, v_head_dim=None):
    """Write random K/V for every position [0, cache_length + new) of every row (reference store)."""
    totals = [c + n for c, n in batch.rows]
    offsets = [0]
    for t in totals:
        offsets.append(offsets[-1] + t)
    device = batch.lookup_table.device
    key = randn(gen, (offsets[-1], kv.num_kv_heads, kv.head_dim), key_dtype, device)
    value = None
    if not kv.k_only:
        value = randn(gen, (offsets[-1], kv.num_kv_heads, kv.head_dim), key_dtype, device)
    k, v, ks, vs = kv.views
    ref.paged_store(
        key,
        value,
        k,
        v,
        torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.zeros(len(totals), dtype=torch.int32, device=device),
        batch.lookup_table,
        ks,
        vs,
        kv.quant_group,
    )


def strided_index_tensors(batch: Batch, device):
    """The batch's lookup table as a column slice of a wider preallocated table (its spare columns
    INT32_MAX), and its offsets and lengths as columns of wider metadata: none is contiguous.
    Returns (lookup_table, input_row_offsets, cache_lengths)."""
    rows, cols = batch.lookup_table.shape
    wide = torch.full((rows, 2 * cols), 2**31 - 1, dtype=torch.int32, device=device)
    wide[:, :cols] = batch.lookup_table
    table = wide[:, :cols]
    meta = torch.zeros((rows + 1, 3), dtype=torch.int32, device=device)
    meta[:, 0] = batch.input_row_offsets
    meta[:rows, 1] = batch.cache_lengths
    offsets, lengths = meta[:, 0], meta[:rows, 1]
    assert not (table.is_contiguous() or offsets.is_contiguous() or lengths.is_contiguous())
    return table, offsets, lengths


def rising_scores(qdt, step, device="cpu", new=(1, 40)):
    """Scores that rise tile after tile (64 keys per tile) by `step` natural-log units per tile: the
    running maximum moves by less than the kernels' lazy-rescale slack (2^8) per tile for small steps
    and by far more for large ones; both must match the float64 softmax. Rows: by default one decode
    token and a prefill chunk of 40 tokens (`new`), over 300 cached keys, 16-slot pages, bf16 cache.
    Built on the CPU (the same values on every device), returned on `device`."""
    gen = torch.Generator().manual_seed(13)
    p, hk, gqa, d, cached, new = 16, 2, 4, 64, 300, list(new)
    b, total = len(new), [cached + n for n in new]
    pages = max((t + p - 1) // p for t in total)
    table = torch.randperm(b * pages, generator=gen).to(torch.int32).view(b, pages)
    direction = torch.randn(d, generator=gen)
    direction /= direction.norm()
    q = torch.randn(sum(new), hk * gqa, d, generator=gen) * 0.1 + direction * math.sqrt(d)
    k = torch.randn(b * pages, p, hk, d, generator=gen) * 0.1
    v = torch.randn(b * pages, p, hk, d, generator=gen)
    for row in range(b):  # key position j scores about step * j / 64 (q.k / sqrt(d))
        pos = torch.arange(pages * p, dtype=torch.float32).view(pages, p, 1, 1)
        k[table[row].long()] += direction * (step * pos / 64)
    offsets = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    lengths = torch.full((b,), cached, dtype=torch.int32)
    tensors = (q.to(qdt), offsets, k.to(torch.bfloat16), v.to(torch.bfloat16), lengths, table)
    return tuple(t.to(device) for t in tensors)


# --------------------------------------------------------------------------------------------
# Tolerances


def effective_q_dtype(q_dtype: torch.dtype, device, q16_on_cuda: bool = False) -> torch.dtype:
    """The query precision a kernel attends with. q16_on_cuda: the op is dense attention, whose CUDA
    kernels run float32 queries through a 16-bit copy (bf16 or the cache's float16), so their accuracy
    is 16-bit's there. Strict by default: the sparse kernels and the merge compute in float32."""
    if q16_on_cuda and torch.device(device).type == "cuda" and q_dtype == torch.float32:
        return torch.bfloat16
    return q_dtype


def attention_tolerance(q_dtype: torch.dtype) -> float:
    return 1e-5 if q_dtype == torch.float32 else 2e-2


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, q_dtype, what="", q16_on_cuda=False):
    """Per-query-row relative L2 error <= tolerance; rows the reference zeroes must be exact 0."""
    assert out.dtype == q_dtype, f"{what}: output dtype {out.dtype}, expected {q_dtype}"
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(expected.shape)}"
    got = out.detach().cpu().to(torch.float64)
    exp = expected.detach().cpu().to(torch.float64)
    assert torch.isfinite(got).all(), f"{what}: non-finite output at {(~torch.isfinite(got)).nonzero()[:5].tolist()}"
    zero_rows = (exp == 0).flatten(1).all(1)
    if zero_rows.any():
        bad = (got[zero_rows] != 0).flatten(1).any(1)
        assert not bad.any(), (
            f"{what}: rows {zero_rows.nonzero().flatten()[bad].tolist()} must be exactly zero"
        )
    live = ~zero_rows
    if live.any():
        err = (got[live] - exp[live]).flatten(1).norm(dim=1)
        rel = err / exp[live].flatten(1).norm(dim=1)
        tol = attention_tolerance(effective_q_dtype(q_dtype, out.device, q16_on_cuda))
        worst = int(rel.argmax())
        assert rel.max() <= tol, (
            f"{what}: relative error {rel.max().item():.3e} > {tol:.0e} at token "
            f"{live.nonzero().flatten()[worst].item()}"
        )


def lse_tolerance(q_dtype: torch.dtype) -> float:
    # absolute, in natural-log units: float32 softmax sums vs bf16-accurate probabilities (AMX) for
    # half-precision queries, whose relative error 2e-2 on the sum is ~2e-2 on its log
    return 1e-4 if q_dtype == torch.float32 else 2e-2


def assert_lse_close(got: torch.Tensor, expected: torch.Tensor, q_dtype, what="", q16_on_cuda=False):
    assert got.dtype == torch.float32 and got.shape == expected.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    device = got.device
    got, expected = got.cpu().double(), expected.cpu().double()
    infinite = torch.isinf(expected)
    assert torch.equal(got[infinite], expected[infinite]), f"{what}: -inf entries differ"
    assert torch.isfinite(got[~infinite]).all(), f"{what}: non-finite lse where the reference is finite"
    tol = lse_tolerance(effective_q_dtype(q_dtype, device, q16_on_cuda))
    err = (got[~infinite] - expected[~infinite]).abs().max().item() if (~infinite).any() else 0.0
    assert err <= tol, f"{what}: lse error {err:.3e} > {tol:.0e}"


# rows (cached, new): decode rows, a prefill row, an empty row, and one long decode row that the CPU
