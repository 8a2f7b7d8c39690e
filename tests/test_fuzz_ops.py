"""Seeded property/fuzz tests of the three ops against the plain-torch reference.

Every case builds a tiny random call (shapes, layouts and strides, dtypes, page tables, lengths,
offsets, special values), optionally breaks one descriptor rule (dtype, rank, size, stride,
device, option) and perturbs index values. An independent oracle in this file decides from the
final index values whether the contract makes the call valid, invalid, or leaves it open. Then:

- valid call: it must succeed and match the reference (store/load bit-exact, NaNs compared as
  NaN; attention within a tolerance derived from the data, non-finite exactly where the
  reference is non-finite), and every byte of every storage tensor outside the addressed slots
  must be unchanged;
- invalid call: it must raise RuntimeError/ValueError/TypeError whose message names one of the
  offending arguments, and every storage tensor (caches, scales, out, including every other
  sequence's pages and the padding around strided views) must be bit-identical to before.

Case counts: PAGEDKV_FUZZ_CASES (default 10000, split over the ops) and PAGEDKV_FUZZ_SEED. A
failure prints `PAGEDKV_FUZZ_REPLAY=<op>:<index>`, which reruns that single case.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import zlib

import pytest
import torch

import pagedkv
from pagedkv import reference as ref

TOTAL_CASES = int(os.environ.get("PAGEDKV_FUZZ_CASES", "10000"))
BASE_SEED = int(os.environ.get("PAGEDKV_FUZZ_SEED", "20250101"))
REPLAY = os.environ.get("PAGEDKV_FUZZ_REPLAY", "")
# Share of the cases per op; attention costs most per case, store has the most rules.
OP_SHARES = {"store": 0.4, "load": 0.25, "attn": 0.35}
# Each op's cases are split into chunks so progress and failures are visible per test.
CHUNKS = 10

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
# Dtypes that no tensor of the contract accepts in a float role.
BAD_FLOAT_DTYPES = (torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8, torch.bool, torch.complex64)
BAD_INDEX_DTYPES = (torch.int64, torch.int16, torch.uint8, torch.int8, torch.float32, torch.bool)
ERRORS = (RuntimeError, ValueError, TypeError)


class FuzzFailure(AssertionError):
    pass


# ----------------------------------------------------------------------------------------------
# small helpers


def case_seed(op: str, index: int) -> int:
    return zlib.crc32(f"{BASE_SEED}:{op}:{index}".encode()) & 0x7FFFFFFF


def randn(gen, shape, scale=1.0):
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def to_dtype(x: torch.Tensor, dtype):
    """float64 -> dtype; FP8 saturates instead of producing NaN for out-of-range values."""
    if dtype in FP8_DTYPES:
        m = ref.fp8_max(dtype)
        x = x.clamp(-m, m)
    return x.to(dtype)


def random_bytes_(t: torch.Tensor, gen) -> torch.Tensor:
    if t.numel():
        raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
        t.view(torch.uint8).view(-1).copy_(raw)
    return t


def nan_mask(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.isnan(t.float() if t.dtype in FP8_DTYPES else t)
    return torch.zeros(t.shape, dtype=torch.bool)


def bits_differ(a: torch.Tensor, b: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """Elementwise: raw bits differ (and, unless strict, not both NaN)."""
    ab = a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1)
    bb = b.reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    diff = (ab != bb).any(-1).reshape(a.shape)
    return diff if strict else diff & ~(nan_mask(a) & nan_mask(b))


def assert_same_bits(got: dict, expected: dict, what: str, strict: bool = False):
    """Byte comparison of storage tensors; NaN equals any NaN unless `strict`."""
    for name in expected:
        a, e = got[name], expected[name]
        if a.numel() == 0:
            continue
        if torch.equal(a.view(torch.uint8), e.view(torch.uint8)):
            continue
        diff = bits_differ(a, e, strict)
        if diff.any():
            idx = diff.nonzero()[:4].tolist()
            first = tuple(idx[0])
            raise FuzzFailure(
                f"{what}: storage {name!r}: {int(diff.sum())} of {a.numel()} elements differ, first at {idx}: "
                f"got {a[first].float().item()!r}, expected {e[first].float().item()!r}"
            )


def snapshot(bases: dict) -> dict:
    return {k: v.clone() for k, v in bases.items()}


def pick(r: random.Random, items, weights=None):
    return r.choices(items, weights=weights)[0] if weights else r.choice(items)


# ----------------------------------------------------------------------------------------------
# storage: caches and scales in the layouts of CONTRACT.md, rebuilt as views from their bases

LAYOUTS_SHARED = ("separate", "collection", "fa3", "interleaved", "transposed", "strided_pages")
LAYOUTS_SINGLE = ("separate", "transposed", "strided_pages")


def make_planes(r, gen, planes, N, P, Hk, layout, fill):
    """Allocate storage for `planes` = [(name, dtype, last_dim)] (all the same dtype and last dim
    for the shared layouts) and return (bases, views_fn) with views_fn(bases) -> {name: view}.

    fill(t, dtype) initialises a base tensor in place."""
    bases = {}
    if layout in ("collection", "fa3", "interleaved"):
        dtype, last = planes[0][1], planes[0][2]
        pad = r.choice([0, 0, 3])
        count = len(planes)
        if layout == "collection":
            layers = 2
            layer = r.randrange(layers)
            base = torch.empty((N, count, layers, P, Hk, last + pad), dtype=dtype)

            def view(b, i, layer=layer):
                return b[:, i, layer, ..., :last]

        elif layout == "fa3":
            base = torch.empty((count, N, P, Hk, last + pad), dtype=dtype)

            def view(b, i):
                return b[i, ..., :last]

        else:  # K and V interleaved per token: [N, P, 2, Hk, D]
            base = torch.empty((N, P, count, Hk, last + pad), dtype=dtype)

            def view(b, i):
                return b[:, :, i, :, :last]

        fill(base, dtype)
        key = "shared:" + "+".join(p[0] for p in planes)
        bases[key] = base
        names = [p[0] for p in planes]

        def views(b):
            return {n: view(b[key], i) for i, n in enumerate(names)}

        return bases, views

    makers = {}
    for name, dtype, last in planes:
        if layout == "transposed":  # storage [N, Hk, P, D]: stride(token) < stride(head)
            base = torch.empty((N, Hk, P, last), dtype=dtype)
            makers[name] = lambda b: b.transpose(1, 2)
        elif layout == "strided_pages":  # every other page of a bigger pool
            base = torch.empty((2 * N + 1, P, Hk, last), dtype=dtype)
            makers[name] = lambda b: b[1::2][:N]
        else:
            base = torch.empty((N, P, Hk, last), dtype=dtype)
            makers[name] = lambda b: b
        fill(base, dtype)
        bases[name] = base

    def views(b):
        return {n: makers[n](b[n]) for n in makers}

    return bases, views


def cache_fill_bytes(gen):
    def fill(t, dtype):
        random_bytes_(t, gen)

    return fill


def cache_fill_values(gen, r, scales: bool = False):
    """Finite random values: FP8 codes within range, or positive scales."""

    def fill(t, dtype):
        if scales:
            t.copy_(torch.rand(t.shape, generator=gen, dtype=torch.float64) * 0.5 + 0.01)
            return
        x = randn(gen, t.shape, scale=pick(r, [1.0, 1.0, 4.0]) if dtype not in FP8_DTYPES else 100.0)
        t.copy_(to_dtype(x, dtype))

    return fill


def cache_planes(r, gen, N, P, Hk, specs, group, *, fill_kind, allow_shared=True):
    """specs: [(name, dtype, D)]. Returns (bases, views_fn) with views for caches and, for FP8
    caches, f"{name}_scales" views [N, P, Hk, ceil(D/G)]."""
    same = len({(s[1], s[2]) for s in specs}) == 1
    layout = pick(r, LAYOUTS_SHARED if (same and allow_shared) else LAYOUTS_SINGLE)
    if fill_kind == "bytes":
        fill_c = fill_s = cache_fill_bytes(gen)
    else:
        fill_c = cache_fill_values(gen, r)
        fill_s = cache_fill_values(gen, r, scales=True)
    bases, views_c = make_planes(r, gen, specs, N, P, Hk, layout, fill_c)
    scale_specs = [(n + "_scales", torch.float32, ref.num_scale_groups(d, group)) for n, dt, d in specs if dt in FP8_DTYPES]
    views_s = None
    if scale_specs:
        same_s = len({s[2] for s in scale_specs}) == 1
        s_layout = layout if (layout in LAYOUTS_SINGLE or same_s) else "separate"
        sb, views_s = make_planes(r, gen, scale_specs, N, P, Hk, s_layout, fill_s)
        bases.update(sb)
    description = f"layout={layout}"

    def views(b):
        v = views_c(b)
        if views_s is not None:
            v.update(views_s(b))
        return v

    return bases, views, description


# ----------------------------------------------------------------------------------------------
# index values: generation, perturbation and the independent oracle


def gen_rows(r, P, max_new=12, max_cached=24, allow_empty=True):
    B = pick(r, [0, 1, 1, 2, 2, 3, 4, 5] if allow_empty else [1, 1, 2, 3, 4])
    rows = []
    for _ in range(B):
        cached = pick(r, [0, 0, r.randint(0, 3 * P), r.randint(0, max_cached)])
        new = pick(r, [0, 1, 1, 2, r.randint(0, max_new), P, P + 1])
        rows.append([cached, new])
    return rows


def gen_table(r, rows, P, extra_pages=None):
    """Distinct random pages for every used position; unused entries random (valid or garbage)."""
    counts = [-(-(c + n) // P) for c, n in rows]
    cols = max(counts, default=0) + r.choice([0, 0, 1, 2])
    if cols == 0 and r.random() < 0.5:
        cols = 1
    N = sum(counts) + (extra_pages if extra_pages is not None else r.choice([0, 1, 3]))
    perm = list(range(N))
    r.shuffle(perm)
    garbage = r.choice(["valid", "garbage", "zero"])
    table, k = [], 0
    for count in counts:
        row = perm[k : k + count]
        k += count
        for _ in range(cols - count):
            if garbage == "valid" and N > 0:
                row.append(r.randrange(N))
            elif garbage == "zero":
                row.append(0)
            else:
                row.append(pick(r, [-1, N, INT32_MAX, INT32_MIN]))
        table.append(row)
    return table, cols, N


class BroadcastRow:
    """A lookup-table row whose every entry is `page` (a stride-0 view of one column)."""

    def __init__(self, page):
        self.page = page

    def __getitem__(self, j):
        return self.page


def perturb_table(r, table, rows, P, N, desc):
    if not table or not table[0]:
        return
    b = r.randrange(len(table))
    j = r.randrange(len(table[b]))
    kind = pick(r, ["neg", "oob", "max", "min", "dup", "dup", "other_row"])
    if kind == "neg":
        table[b][j] = -1
    elif kind == "oob":
        table[b][j] = N
    elif kind == "max":
        table[b][j] = INT32_MAX
    elif kind == "min":
        table[b][j] = INT32_MIN
    elif kind == "dup":
        table[b][j] = table[b][r.randrange(len(table[b]))]
    else:
        b2 = r.randrange(len(table))
        table[b][j] = table[b2][r.randrange(len(table[b2]))]
    desc.append(f"table[{b},{j}]={kind}")


def perturb_lengths(r, lengths, cap, desc, name="cache_lengths"):
    if not lengths:
        return
    b = r.randrange(len(lengths))
    kind = pick(r, ["neg", "min", "cap", "cap+1", "max", "inc", "dec"])
    lengths[b] = {
        "neg": -1,
        "min": INT32_MIN,
        "cap": cap,
        "cap+1": cap + 1,
        "max": INT32_MAX,
        "inc": lengths[b] + 1,
        "dec": lengths[b] - 1,
    }[kind]
    desc.append(f"{name}[{b}]={kind}")


def perturb_offsets(r, offsets, desc, name):
    B = len(offsets) - 1
    kind = pick(r, ["first", "decrease", "last+1", "last-1", "shift"])
    if kind == "first":
        offsets[0] = pick(r, [1, -1])
    elif kind == "decrease" and B >= 1:
        b = r.randrange(1, B + 1)
        offsets[b] = offsets[b - 1] - 1
    elif kind == "last+1":
        offsets[B] += 1
    elif kind == "last-1":
        offsets[B] -= 1
    elif kind == "shift" and B >= 1:
        b = r.randrange(1, B + 1)
        offsets[b] += pick(r, [-2, 1, 3])
    desc.append(f"{name}:{kind}")


def oracle_offsets(offsets, rows_available, name, rows_name, errors):
    if offsets[0] != 0 or any(offsets[i + 1] < offsets[i] for i in range(len(offsets) - 1)):
        errors.add(name)
        return False
    if offsets[-1] > rows_available:
        errors.update({name, rows_name})
        return False
    return True


def pages_valid(table_row, first, end, N):
    return all(0 <= table_row[j] < N for j in range(first, end))


def oracle_store(offsets, lengths, table, cols, T, N, P):
    """(hard errors, soft errors) for paged_store's index values, from the contract."""
    hard, soft = set(), set()
    if not oracle_offsets(offsets, T, "input_row_offsets", "key", hard):
        return hard, soft
    slots = set()
    collision = False
    for b, cached in enumerate(lengths):
        new = offsets[b + 1] - offsets[b]
        if cached < 0 or cached + new > cols * P:
            hard.update({"cache_lengths"})
            continue
        if new and not pages_valid(table[b], cached // P, -(-(cached + new) // P), N):
            hard.add("lookup_table")
            continue
        for pos in range(cached, cached + new):
            slot = (table[b][pos // P], pos % P)
            collision |= slot in slots
            slots.add(slot)
    if collision:
        hard.add("lookup_table")
    return hard, soft


def oracle_attn(offsets, lengths, table, cols, T, N, P):
    hard, soft = set(), set()
    if not oracle_offsets(offsets, T, "input_row_offsets", "q", hard):
        return hard, soft
    for b, cached in enumerate(lengths):
        new = offsets[b + 1] - offsets[b]
        if cached < 0:
            hard.add("cache_lengths")
        elif cached + new > cols * P:
            # a row without queries reads nothing: rejecting its length is allowed, not required
            (hard if new else soft).add("cache_lengths")
        elif new and not pages_valid(table[b], 0, -(-(cached + new) // P), N):
            hard.add("lookup_table")
    return hard, soft


def oracle_load(offsets, seq_lens, table, cols, T_out, N, P):
    hard, soft = set(), set()
    if not oracle_offsets(offsets, T_out, "output_row_offsets", "out", hard):
        return hard, soft
    for b, length in enumerate(seq_lens):
        if length < 0 or length > cols * P:
            hard.add("seq_lens")
        elif length > offsets[b + 1] - offsets[b]:
            hard.update({"seq_lens", "output_row_offsets"})
        elif not pages_valid(table[b], 0, -(-length // P), N):
            hard.add("lookup_table")
    return hard, soft


# ----------------------------------------------------------------------------------------------
# index tensors with representation variants


def int32_tensor(r, values, shape, name, mut, names):
    """Build an int32 index tensor from python ints; `mut` may break its descriptor (then the
    error must name `name`) or pick a harmless strided representation."""
    t = torch.tensor(values, dtype=torch.int64).reshape(shape).to(torch.int32)
    form = pick(r, ["plain", "plain", "plain", "strided"])
    if form == "strided" and t.numel():
        big = torch.zeros((*shape[:-1], shape[-1] * 2 + 1), dtype=torch.int32) if len(shape) else None
        if big is not None:
            big[..., 1::2][..., : shape[-1]] = t
            t = big[..., 1::2][..., : shape[-1]]
    if len(shape) == 2 and r.random() < 0.2:
        t = t.t().contiguous().t()  # column-major table
    if mut == f"dtype:{name}":
        names.add(name)
        return t.to(pick(r, BAD_INDEX_DTYPES))
    if mut == f"dims:{name}":
        names.add(name)
        options = [t.unsqueeze(0), t.unsqueeze(-1)]
        options.append(t.reshape(-1) if t.dim() == 2 else torch.zeros((), dtype=torch.int32))
        return pick(r, options)
    if mut == f"size:{name}":
        names.add(name)
        extra = torch.zeros((1, *t.shape[1:]), dtype=torch.int32)
        return torch.cat([t, extra]) if r.random() < 0.5 or t.shape[0] == 0 else t[:-1]
    if mut == f"meta:{name}":
        names.add(name)
        return t.to("meta")
    if mut == f"list:{name}":
        names.add(name)
        return t.tolist()
    return t


# ----------------------------------------------------------------------------------------------
# ragged float inputs (key, value, q) with representation variants


def special_values_(r, x: torch.Tensor, dtype, nan=True):
    """Inject inf/NaN/huge/tiny values into a float64 tensor about to be cast to dtype."""
    if x.numel() == 0 or r.random() > 0.15:
        return x
    big = {torch.float16: 6.0e4, torch.bfloat16: 1.0e30, torch.float32: 1.0e30}.get(dtype, 1.0e30)
    choices = [big, -big, 1e-40, -1e-45, 5.9e-8, -0.0, 0.0, 1e-30, math.inf, -math.inf]
    if nan:
        choices.append(math.nan)
    flat = x.view(-1)
    for _ in range(r.randint(1, 4)):
        flat[r.randrange(flat.numel())] = pick(r, choices)
    if r.random() < 0.1:
        x.zero_()  # a whole tensor of zeros: FP8 scale 1
    return x


def ragged(r, gen, T, H, D, dtype, name, mut, names, *, nan=True, bad_heads=None):
    x = special_values_(r, randn(gen, (T, H, D), scale=pick(r, [1.0, 1.0, 10.0, 1e-3])), dtype, nan)
    form = pick(r, ["plain", "plain", "fused", "transposed", "broadcast"])
    if form == "fused":  # a slice of a wider fused tensor (qkv)
        fused = torch.zeros((T, H + 2, D + 3), dtype=dtype)
        fused[:, 1 : H + 1, 2 : D + 2] = x.to(dtype)
        t = fused[:, 1 : H + 1, 2 : D + 2]
    elif form == "transposed":
        t = x.to(dtype).transpose(0, 1).contiguous().transpose(0, 1)
    elif form == "broadcast" and T > 1:  # every row the same (stride 0 on T): read-only, legal
        t = x[:1].to(dtype).expand(T, H, D)
    else:
        t = x.to(dtype)
    if mut == f"dtype:{name}":
        names.add(name)
        bad = pick(r, BAD_FLOAT_DTYPES + FP8_DTYPES)
        return to_dtype(t.to(torch.float64), bad) if bad in FP8_DTYPES else t.to(bad)
    if mut == f"dims:{name}":
        names.add(name)
        return pick(r, [t.reshape(T, H * D), t.unsqueeze(0)])
    if mut == f"stride:{name}" and D > 1:
        names.add(name)
        wide = torch.zeros((T, H, 2 * D), dtype=dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if mut == f"heads:{name}":
        bad = H + 1 if bad_heads is None else bad_heads
        if bad is not None and bad >= 0:
            names.add(name)
            return torch.zeros((T, bad, D), dtype=dtype)
    if mut == f"dim:{name}":
        names.add(name)
        return torch.zeros((T, H, D + 1), dtype=dtype)
    if mut == f"rows:{name}":
        names.add(name)
        return torch.zeros((T + 1, H, D), dtype=dtype)
    if mut == f"meta:{name}":
        names.add(name)
        return t.to("meta")
    return t


# ----------------------------------------------------------------------------------------------
# descriptor mutations of caches and scales


def mutate_view(r, t: torch.Tensor, name, mut, names, *, written):
    """Break (or harmlessly vary) the descriptor of a cache/scales view."""
    if mut == f"dtype:{name}":
        names.add(name)
        return torch.zeros(t.shape, dtype=pick(r, BAD_FLOAT_DTYPES))
    if mut == f"dims:{name}":
        names.add(name)
        return pick(
            r,
            [t.unsqueeze(0), t.reshape(t.shape[0], -1) if t.numel() else t.reshape(t.shape[0], 0), t.unsqueeze(-2),
             t.reshape(*t.shape, 1, 1, 1)],  # 7-D: more dims than any descriptor holds
        )
    if mut == f"stride:{name}" and t.shape[-1] > 1:
        names.add(name)
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        return wide[..., ::2]
    if mut == f"broadcast:{name}" and t.shape[0] > 1:
        if written:
            names.add(name)
        return t[:1].expand(t.shape)  # stride 0 on the page dim: every page is page 0
    if mut == f"zero:{name}":
        names.add(name)
        shape = list(t.shape)
        shape[r.choice([1, 2, 3])] = 0
        return torch.zeros(shape, dtype=t.dtype)
    if mut == f"pages:{name}":
        names.add(name)
        shape = list(t.shape)
        shape[r.choice([0, 1, 2])] += 1
        return torch.zeros(shape, dtype=t.dtype)
    if mut == f"groups:{name}":
        names.add(name)
        shape = list(t.shape)
        shape[3] += pick(r, [1, -1]) if shape[3] > 1 else 1
        return torch.zeros(shape, dtype=t.dtype)
    if mut == f"meta:{name}":
        names.add(name)
        return t.to("meta")
    return t


# ----------------------------------------------------------------------------------------------
# running one case


def expect_error_or_ok(run, snapshot_before, bases, hard, soft, names, desc):
    """Call `run`; returns True if it succeeded. Enforces the error contract when it raised."""
    try:
        result = run()
    except ERRORS as e:
        msg = str(e).split("\n")[0]
        if not hard and not soft:
            raise FuzzFailure(f"valid call raised {type(e).__name__}: {msg}\n  case: {desc}") from e
        acceptable = hard | soft
        if not any(n in msg for n in acceptable):
            raise FuzzFailure(
                f"error message names none of {sorted(acceptable)}: {type(e).__name__}: {msg}\n  case: {desc}"
            ) from e
        assert_same_bits(bases, snapshot_before, f"storage changed by a failed call ({msg}); case: {desc}",
                         strict=True)
        return False, None
    if hard:
        raise FuzzFailure(f"invalid call accepted (expected an error naming one of {sorted(hard)})\n  case: {desc}")
    return True, result


def fuzz_case(op: str, index: int):
    seed = case_seed(op, index)
    r = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    desc = [f"PAGEDKV_FUZZ_REPLAY={op}:{index}"]
    try:
        {"store": store_case, "load": load_case, "attn": attn_case}[op](r, gen, desc)
    except FuzzFailure:
        raise
    except Exception as e:  # anything else (a crash of the reference, an unexpected exception type)
        raise FuzzFailure(f"{type(e).__name__}: {e}\n  case: {' '.join(desc)}") from e


def choose_mutation(r, candidates, p=0.55):
    return pick(r, candidates) if r.random() < p else "none"


# ---- paged_store ----

STORE_MUTATIONS = [
    "dtype:k_cache", "dims:k_cache", "stride:k_cache", "broadcast:k_cache", "zero:k_cache",
    "dtype:v_cache", "stride:v_cache", "pages:v_cache", "broadcast:v_cache",
    "dtype:key", "dims:key", "stride:key", "heads:key", "dim:key", "meta:key",
    "dtype:value", "dim:value", "rows:value",
    "missing:k_scales", "extra:k_scales", "dtype:k_scales", "groups:k_scales", "pages:k_scales",
    "stride:k_scales", "broadcast:k_scales", "missing:v_scales",
    "none:value", "none:v_cache", "orphan:v_scales", "group:quant_group",
    "dtype:lookup_table", "dims:lookup_table", "size:lookup_table", "meta:lookup_table",
    "dtype:cache_lengths", "dims:cache_lengths", "list:cache_lengths",
    "dtype:input_row_offsets", "size:input_row_offsets", "meta:input_row_offsets",
    "meta:k_cache",
]


def geometry(r, allow_mla=True):
    P = pick(r, [1, 1, 2, 3, 4, 5, 8, 16])
    Hk = pick(r, [1, 1, 2, 3])
    D = pick(r, [1, 2, 3, 4, 5, 8, 16, 32])
    Dv = D if (not allow_mla or r.random() < 0.8) else pick(r, [1, 2, 4, 8, 16])
    k_dtype = pick(r, CACHE_DTYPES)
    v_dtype = k_dtype if r.random() < 0.8 else pick(r, CACHE_DTYPES)
    group = pick(r, [1, 2, 3, 4, 8, 16, 128, D, D + 1, 2**62, 2**63 - 1])
    return P, Hk, D, Dv, k_dtype, v_dtype, group


def store_case(r, gen, desc):
    P, Hk, D, Dv, k_dtype, v_dtype, group = geometry(r)
    k_only = r.random() < 0.2
    mut = choose_mutation(r, STORE_MUTATIONS)
    names: set = set()
    desc.append(f"P={P} Hk={Hk} D={D} Dv={Dv} k={k_dtype} v={v_dtype} G={group} k_only={k_only} mut={mut}")
    rows = gen_rows(r, P)
    table, cols, N = gen_table(r, rows, P)
    lengths = [c for c, _ in rows]
    offsets = [0]
    for _, n in rows:
        offsets.append(offsets[-1] + n)
    T = offsets[-1] + pick(r, [0, 0, 0, 1, 3])
    if r.random() < 0.35:
        perturb_table(r, table, rows, P, N, desc)
    if r.random() < 0.2:
        perturb_lengths(r, lengths, cols * P, desc)
    if r.random() < 0.15:
        perturb_offsets(r, offsets, desc, "input_row_offsets")
    if r.random() < 0.05:
        T = max(0, offsets[-1] - 1)
        desc.append("T<offsets[B]")
    hard, soft = oracle_store(offsets, lengths, table, cols, T, N, P)

    specs = [("k", k_dtype, D)] + ([] if k_only else [("v", v_dtype, Dv)])
    bases, views_fn, layout = cache_planes(r, gen, N, P, Hk, specs, group, fill_kind="bytes")
    desc.append(layout)
    key_dtype = pick(r, FLOAT_DTYPES)
    key = ragged(r, gen, T, Hk, D, key_dtype, "key", mut, names)
    value = None if k_only else ragged(r, gen, T, Hk, Dv, pick(r, FLOAT_DTYPES), "value", mut, names)
    t_offsets = int32_tensor(r, offsets, [len(offsets)], "input_row_offsets", mut, names)
    t_lengths = int32_tensor(r, lengths, [len(lengths)], "cache_lengths", mut, names)
    t_table = int32_tensor(r, sum(table, []), [len(table), cols], "lookup_table", mut, names)
    quant_group = group
    if mut == "group:quant_group":
        quant_group = pick(r, [0, -1, -128])
        names.add("quant_group")

    # the mutation helpers draw from their own stream so build() is repeatable for the reference
    sub_seed = r.getrandbits(32)

    def build(b):
        r2 = random.Random(sub_seed)
        v = views_fn(b)
        k_cache = mutate_view(r2, v["k"], "k_cache", mut, names, written=True)
        v_cache = None if k_only else mutate_view(r2, v["v"], "v_cache", mut, names, written=True)
        ks, vs = v.get("k_scales"), v.get("v_scales")
        if ks is not None:
            ks = mutate_view(r2, ks, "k_scales", mut, names, written=True)
        if vs is not None:
            vs = mutate_view(r2, vs, "v_scales", mut, names, written=True)
        val = value
        if mut == "missing:k_scales" and ks is not None:
            ks, _ = None, names.add("k_scales")
        if mut == "missing:v_scales" and vs is not None:
            vs, _ = None, names.add("v_scales")
        if mut == "extra:k_scales" and ks is None:
            ks, _ = torch.ones((*v["k"].shape[:3], 1)), names.add("k_scales")
        if mut == "none:value" and not k_only:
            val, _ = None, names.update({"value", "v_cache"})
        if mut == "none:v_cache" and not k_only:
            v_cache, vs, _ = None, None, names.update({"value", "v_cache"})
        if mut == "orphan:v_scales" and k_only:
            vs, _ = torch.ones((*v["k"].shape[:3], 1)), names.add("v_scales")
        return (key, val, k_cache, v_cache, t_offsets, t_lengths, t_table, ks, vs, quant_group)

    before = snapshot(bases)
    args = build(bases)
    if names:
        hard = hard | names
    ok, _ = expect_error_or_ok(lambda: pagedkv.paged_store(*args), before, bases, hard, soft, names,
                               " ".join(desc))
    if not ok:
        return
    expected = snapshot(before)
    ref_args = build(expected)
    ref.paged_store(*ref_args)
    assert_same_bits(bases, expected, "paged_store vs reference; case: " + " ".join(desc))


# ---- paged_load ----

LOAD_MUTATIONS = [
    "dtype:cache", "dims:cache", "stride:cache", "broadcast:cache", "zero:cache", "meta:cache",
    "missing:scales", "extra:scales", "dtype:scales", "groups:scales", "pages:scales", "stride:scales",
    "broadcast:scales", "group:quant_group",
    "dtype:out", "dims:out", "stride:out", "heads:out", "dim:out", "broadcast:out", "meta:out",
    "dtype:lookup_table", "dims:lookup_table", "size:lookup_table",
    "dtype:seq_lens", "dims:seq_lens", "meta:seq_lens",
    "dtype:output_row_offsets", "size:output_row_offsets", "list:output_row_offsets",
]


def load_case(r, gen, desc):
    P, Hk, D, _, dtype, _, group = geometry(r, allow_mla=False)
    convenience = r.random() < 0.25
    mut = "none" if convenience else choose_mutation(r, LOAD_MUTATIONS)
    names: set = set()
    desc.append(f"P={P} Hk={Hk} D={D} cache={dtype} G={group} convenience={convenience} mut={mut}")
    rows = [[c + n, 0] for c, n in gen_rows(r, P)]
    table, cols, N = gen_table(r, rows, P)
    seq_lens = [c for c, _ in rows]
    offsets = [0]
    for n in seq_lens:
        offsets.append(offsets[-1] + n + pick(r, [0, 0, 0, 1, 2]))
    T_out = offsets[-1] + pick(r, [0, 0, 2])
    if r.random() < 0.3:
        perturb_table(r, table, rows, P, N, desc)
    if r.random() < 0.2:
        perturb_lengths(r, seq_lens, cols * P, desc, "seq_lens")
    if not convenience and r.random() < 0.15:
        perturb_offsets(r, offsets, desc, "output_row_offsets")
    if not convenience and r.random() < 0.05:
        T_out = max(0, offsets[-1] - 1)
        desc.append("T_out<offsets[B]")
    if convenience:
        offsets = [0]
        for n in seq_lens:
            offsets.append(offsets[-1] + n)
        T_out = max(offsets[-1], 0)
    hard, soft = oracle_load(offsets, seq_lens, table, cols, T_out, N, P)
    if convenience and any(n < 0 for n in seq_lens):
        hard = {"seq_lens"}  # the convenience derives offsets from seq_lens

    bases, views_fn, layout = cache_planes(r, gen, N, P, Hk, [("c", dtype, D)], group, fill_kind="bytes")
    desc.append(layout)
    out_dtype = pick(r, FLOAT_DTYPES)
    out_form = pick(r, ["plain", "plain", "strided"])
    if convenience:  # the op allocates its output; T_out may be absurd when seq_lens are

        def out_view(b):
            return None

    elif out_form == "strided":  # out rows inside a wider buffer: the op may touch only the view
        bases["out"] = random_bytes_(torch.empty((T_out, Hk + 1, D + 2), dtype=out_dtype), gen)

        def out_view(b):
            return b["out"][:, 1:, 1 : D + 1]

    else:
        bases["out"] = random_bytes_(torch.empty((T_out, Hk, D), dtype=out_dtype), gen)

        def out_view(b):
            return b["out"]

    t_offsets = int32_tensor(r, offsets, [len(offsets)], "output_row_offsets", mut, names)
    t_lens = int32_tensor(r, seq_lens, [len(seq_lens)], "seq_lens", mut, names)
    t_table = int32_tensor(r, sum(table, []), [len(table), cols], "lookup_table", mut, names)
    quant_group = group
    if mut == "group:quant_group":
        quant_group = pick(r, [0, -5])
        names.add("quant_group")
    sub_seed = r.getrandbits(32)

    def build(b):
        r2 = random.Random(sub_seed)
        v = views_fn(b)
        cache = mutate_view(r2, v["c"], "cache", mut, names, written=False)
        scales = v.get("c_scales")
        if scales is not None:
            scales = mutate_view(r2, scales, "scales", mut, names, written=False)
        if mut == "missing:scales" and scales is not None:
            scales, _ = None, names.add("scales")
        if mut == "extra:scales" and scales is None:
            scales, _ = torch.ones((*v["c"].shape[:3], 1)), names.add("scales")
        out = out_view(b)
        if mut == "dtype:out":
            out, _ = torch.zeros(out.shape, dtype=pick(r2, BAD_FLOAT_DTYPES + FP8_DTYPES)), names.add("out")
        elif mut == "dims:out":
            out, _ = out.unsqueeze(0), names.add("out")
        elif mut == "stride:out" and D > 1:
            out, _ = torch.zeros((T_out, Hk, 2 * D), dtype=out_dtype)[..., ::2], names.add("out")
        elif mut == "heads:out":
            out, _ = torch.zeros((T_out, Hk + 1, D), dtype=out_dtype), names.add("out")
        elif mut == "dim:out":
            out, _ = torch.zeros((T_out, Hk, D + 1), dtype=out_dtype), names.add("out")
        elif mut == "broadcast:out" and T_out > 1:
            out, _ = torch.zeros((1, Hk, D), dtype=out_dtype).expand(T_out, Hk, D), names.add("out")
        elif mut == "meta:out":
            out, _ = out.to("meta"), names.add("out")
        return cache, scales, t_table, t_lens, t_offsets, out, quant_group

    before = snapshot(bases)
    args = build(bases)
    hard = hard | names
    if convenience:
        cache, scales, t_table, t_lens = args[:4]

        def run():
            return pagedkv.paged_load(cache, t_table, t_lens, scales=scales, out_dtype=out_dtype,
                                      quant_group=quant_group)
    else:

        def run():
            return torch.ops.pagedkv.paged_load(*args)

    ok, result = expect_error_or_ok(run, before, bases, hard, soft, names, " ".join(desc))
    if not ok:
        return
    expected = snapshot(before)
    ref_args = build(expected)
    if convenience:
        assert_same_bits(bases, before, "paged_load changed its cache; case: " + " ".join(desc))
        want = torch.zeros((T_out, Hk, D), dtype=out_dtype)
        ref.paged_load(*ref_args[:5], want, quant_group)
        assert_same_bits({"out": result}, {"out": want}, "paged_load (convenience) vs reference; case: "
                         + " ".join(desc))
        return
    ref.paged_load(*ref_args)
    assert_same_bits(bases, expected, "paged_load vs reference; case: " + " ".join(desc))


# ---- flash_attn_paged ----

ATTN_MUTATIONS = [
    "dtype:k_cache", "dims:k_cache", "stride:k_cache", "zero:k_cache", "broadcast:k_cache",
    "dtype:v_cache", "pages:v_cache", "stride:v_cache", "meta:v_cache",
    "dtype:q", "dims:q", "stride:q", "dim:q", "heads:q", "meta:q",
    "missing:k_scales", "extra:v_scales", "dtype:k_scales", "groups:v_scales", "pages:k_scales",
    "broadcast:k_scales", "group:quant_group",
    "dtype:out", "shape:out", "stride:out", "broadcast:out",
    "window:window_left", "nan:softcap", "neg:softcap", "inf:softcap", "nan:scale", "inf:scale",
    "dtype:lookup_table", "size:lookup_table", "dtype:cache_lengths", "dims:cache_lengths",
    "meta:cache_lengths", "dtype:input_row_offsets", "dims:input_row_offsets", "size:input_row_offsets",
]


def attn_case(r, gen, desc):
    P, Hk, D, Dv, k_dtype, v_dtype, group = geometry(r)
    q_dtype = pick(r, FLOAT_DTYPES)
    Hq = Hk * pick(r, [1, 1, 2, 3])
    mut = choose_mutation(r, ATTN_MUTATIONS)
    names: set = set()
    rows = gen_rows(r, P)
    table, cols, N = gen_table(r, rows, P)
    lengths = [c for c, _ in rows]
    offsets = [0]
    for _, n in rows:
        offsets.append(offsets[-1] + n)
    T = offsets[-1] + pick(r, [0, 0, 0, 2])
    if r.random() < 0.25:
        perturb_table(r, table, rows, P, N, desc)
    if r.random() < 0.15:
        perturb_lengths(r, lengths, cols * P, desc)
    if r.random() < 0.1:
        perturb_offsets(r, offsets, desc, "input_row_offsets")
    # a table broadcast from its first column to 2^40 columns (read-only: legal for attention);
    # its capacity cols * P overflows int64 in a naive check
    wide_table = cols >= 1 and r.random() < 0.03
    if wide_table:
        table = [BroadcastRow(row[0]) for row in table]
        cols = 2**40
        desc.append("wide_table")
    hard, soft = oracle_attn(offsets, lengths, table, cols, T, N, P)
    causal = r.random() < 0.7
    window_left = pick(r, [-1, -1, -1, 0, 1, 3, 2**40])
    softcap = pick(r, [0.0, 0.0, 0.0, 5.0, 30.0])
    scale = pick(r, [None, None, 0.3, 0.0, -0.5, 2.0])
    use_out = r.random() < 0.3 or mut.endswith(":out")
    mla = Dv < D and k_dtype == v_dtype and r.random() < 0.5  # V is the first Dv channels of K
    specials = r.random() < 0.1
    desc.append(
        f"P={P} Hk={Hk} Hq={Hq} D={D} Dv={Dv} k={k_dtype} v={v_dtype} q={q_dtype} G={group} mla={mla} "
        f"causal={causal} window={window_left} softcap={softcap} scale={scale} out={use_out} mut={mut}"
    )
    if mla:
        specs = [("k", k_dtype, D)]
    else:
        specs = [("k", k_dtype, D), ("v", v_dtype, Dv)]
    bases, views_fn, layout = cache_planes(r, gen, N, P, Hk, specs, group, fill_kind="values")
    desc.append(layout)
    if specials:  # inf/NaN in K only: the reference multiplies masked V rows by 0 (0 * inf = NaN)
        k_view = views_fn(bases)["k"]
        first = Dv if mla else 0
        if k_view.numel() and first < D:
            for _ in range(r.randint(1, 3)):
                at = (r.randrange(N), r.randrange(P), r.randrange(Hk), r.randrange(first, D))
                k_view[at] = to_dtype(torch.tensor(pick(r, [math.inf, -math.inf, math.nan]), dtype=torch.float64),
                                      k_dtype)
            desc.append("k_specials")
    # Hq must be a positive multiple of Hk: 0 heads, or (when Hk > 1) a non-multiple, is invalid
    bad_hq = pick(r, [0, Hk + 1]) if Hk > 1 else 0
    q = ragged(r, gen, T, Hq, D, q_dtype, "q", mut, names, bad_heads=bad_hq)
    if use_out:
        bases["out"] = random_bytes_(torch.empty((T, Hq, Dv), dtype=q_dtype), gen)
    t_offsets = int32_tensor(r, offsets, [len(offsets)], "input_row_offsets", mut, names)
    t_lengths = int32_tensor(r, lengths, [len(lengths)], "cache_lengths", mut, names)
    if wide_table:
        t_table = torch.tensor([[row[0]] for row in table], dtype=torch.int32).reshape(-1, 1).expand(len(table), cols)
        if mut == "dtype:lookup_table":  # int64, still a stride-0 view (never materialised)
            t_table, _ = t_table[:, :1].long().expand(len(table), cols), names.add("lookup_table")
        elif mut == "size:lookup_table":
            t_table, _ = t_table[:-1] if len(table) else torch.zeros((1, 1), dtype=torch.int32).expand(1, cols), \
                names.add("lookup_table")
    else:
        t_table = int32_tensor(r, sum(table, []), [len(table), cols], "lookup_table", mut, names)
    quant_group = group
    if mut == "group:quant_group":
        quant_group, _ = pick(r, [0, -2]), names.add("quant_group")
    if mut == "window:window_left":
        window_left, _ = pick(r, [-2, -(2**40)]), names.add("window_left")
    if mut.endswith(":softcap"):
        softcap = {"nan:softcap": math.nan, "neg:softcap": -1.0, "inf:softcap": math.inf}[mut]
        names.add("softcap")
    if mut in ("nan:scale", "inf:scale"):
        scale, _ = (math.nan if mut == "nan:scale" else -math.inf), names.add("scale")
    sub_seed = r.getrandbits(32)

    def build(b):
        r2 = random.Random(sub_seed)
        v = views_fn(b)
        k_cache = v["k"]
        v_cache = v["k"][..., :Dv] if mla else v["v"]
        ks = v.get("k_scales")
        vs = (ks[..., : ref.num_scale_groups(Dv, group)] if ks is not None else None) if mla else v.get("v_scales")
        k_cache = mutate_view(r2, k_cache, "k_cache", mut, names, written=False)
        v_cache = mutate_view(r2, v_cache, "v_cache", mut, names, written=False)
        if ks is not None:
            ks = mutate_view(r2, ks, "k_scales", mut, names, written=False)
        if vs is not None:
            vs = mutate_view(r2, vs, "v_scales", mut, names, written=False)
        if mut == "missing:k_scales" and ks is not None:
            ks, _ = None, names.add("k_scales")
        if mut == "extra:v_scales" and vs is None:
            vs, _ = torch.ones((*v["k"].shape[:3], 1)), names.add("v_scales")
        out = b.get("out")
        if out is not None:
            if mut == "dtype:out":
                out, _ = torch.zeros(out.shape, dtype=pick(r2, [d for d in FLOAT_DTYPES if d != q_dtype])), names.add(
                    "out")
            elif mut == "shape:out":
                out, _ = torch.zeros((T, Hq, Dv + 1), dtype=q_dtype), names.add("out")
            elif mut == "stride:out" and Dv > 1:
                out, _ = torch.zeros((T, Hq, 2 * Dv), dtype=q_dtype)[..., ::2], names.add("out")
            elif mut == "broadcast:out" and T > 1:
                out, _ = torch.zeros((1, Hq, Dv), dtype=q_dtype).expand(T, Hq, Dv), names.add("out")
        return (q, t_offsets, k_cache, v_cache, t_lengths, t_table, scale, causal, ks, vs, quant_group,
                window_left, softcap), out

    before = snapshot(bases)
    args, out = build(bases)
    hard = hard | names
    if out is not None:
        run = lambda: pagedkv.flash_attn_paged(*args, out=out)  # noqa: E731
    else:
        run = lambda: pagedkv.flash_attn_paged(*args)  # noqa: E731
    ok, result = expect_error_or_ok(run, before, bases, hard, soft, names, " ".join(desc))
    if not ok:
        return
    # attention reads the caches only
    written = {k: v for k, v in bases.items() if k != "out"}
    assert_same_bits(written, {k: before[k] for k in written}, "flash_attn_paged changed a cache; case: "
                     + " ".join(desc))
    if out is not None and result is not out:
        raise FuzzFailure("flash_attn_paged(out=) must return out; case: " + " ".join(desc))
    if wide_table:  # the reference materialises table rows: give it the columns it reads
        news = [offsets[b + 1] - offsets[b] for b in range(len(lengths))]
        narrow = max([-(-(c + n) // P) for c, n in zip(lengths, news) if n > 0] + [1])
        args = args[:5] + (args[5][:, :narrow],) + args[6:]
    expected = ref.flash_attn_paged(*args, compute_dtype=torch.float64)
    assert_attention_matches(result, expected, args, " ".join(desc))


def assert_attention_matches(got, expected, args, desc):
    (q, offsets, k_cache, v_cache, lengths, table, scale, causal, ks, vs, group, window_left, softcap) = args
    if got.dtype != q.dtype or got.shape != expected.shape:
        raise FuzzFailure(f"output {got.dtype} {tuple(got.shape)}, expected {q.dtype} {tuple(expected.shape)}; {desc}")
    g = got.to(torch.float64)
    e = expected.to(torch.float64)
    e_nonfinite = ~torch.isfinite(e)
    g_nonfinite = ~torch.isfinite(g)
    if (e_nonfinite & ~g_nonfinite).any():
        idx = (e_nonfinite & ~g_nonfinite).nonzero()[:4].tolist()
        first = tuple(idx[0])
        raise FuzzFailure(f"reference is non-finite but got {g[first].item()!r} at {idx}; {desc}")
    # Rows whose scores are non-finite (inf/NaN in q or in a visible key) may legitimately be NaN
    # where the reference's zero-denominator guard turns NaN probabilities into zeros.
    poisoned = poisoned_rows(args) if (g_nonfinite & ~e_nonfinite).any() else torch.zeros(e.shape[:2], dtype=torch.bool)
    extra = g_nonfinite & ~e_nonfinite & ~poisoned.unsqueeze(-1)
    if extra.any():
        idx = extra.nonzero()[:4].tolist()
        first = tuple(idx[0])
        raise FuzzFailure(f"non-finite output {g[first].item()!r} where the reference is {e[first].item()!r} and the "
                          f"inputs are finite, at {idx}; {desc}")
    finite = ~e_nonfinite & ~poisoned.unsqueeze(-1)
    if not finite.any():
        return
    # zero rows (no visible key, padding) must be exact zeros
    zero = (e == 0) & finite
    if (g[zero] != 0).any():
        raise FuzzFailure(f"entries that the reference zeroes are not zero; {desc}")
    # tolerance: the output is a convex combination of V rows, so errors scale with max|V|; the
    # float32 score error grows with D * |scale| * max|q| * max|k|
    qf = q.to(torch.float64)
    qmax = float(qf[torch.isfinite(qf)].abs().max()) if torch.isfinite(qf).any() and qf.numel() else 0.0
    kmax = _max_finite_cache(k_cache, ks, group)
    vmax = _max_finite_cache(v_cache, vs, group)
    D = q.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else abs(scale)
    score_bound = s * D * qmax * kmax
    base = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}[q.dtype]
    tol = base + 8 * D * 1.2e-7 * score_bound
    diff = (g - e).abs()
    bad = finite & (diff > tol * vmax + base * e.abs())
    if bad.any():
        idx = bad.nonzero()[:4].tolist()
        first = tuple(idx[0])
        raise FuzzFailure(
            f"attention mismatch at {idx}: got {g[first].item()!r}, reference {e[first].item()!r} "
            f"(tol {tol:.2e} * max|V| {vmax:.2e}); {desc}"
        )


def poisoned_rows(args):
    """[T, Hq] bool: the query row's scores include a non-finite value (float64 inputs)."""
    (q, offsets, k_cache, v_cache, lengths, table, scale, causal, ks, vs, group, window_left, softcap) = args
    T, Hq, _ = q.shape
    Hk = k_cache.shape[2]
    out = torch.zeros((T, Hq), dtype=torch.bool)
    qf = q.to(torch.float64)
    offs, lens = offsets.tolist(), lengths.tolist()
    for b in range(len(lens)):
        new = offs[b + 1] - offs[b]
        if new <= 0:
            continue
        total = lens[b] + new
        keys = ref.gather_rows(k_cache, ks, table[b : b + 1], [total], quant_group=group, out_dtype=torch.float64)[0]
        bad_key = ~torch.isfinite(keys).all(-1)  # [total, Hk]
        for i in range(new):
            p = lens[b] + i
            hi = min(p + 1, total) if causal else total
            lo = max(p - window_left, 0) if window_left >= 0 else 0
            row = offs[b] + i
            for h in range(Hq):
                kh = h // (Hq // Hk)
                out[row, h] = bool(~torch.isfinite(qf[row, h]).all()) or bool(bad_key[lo:hi, kh].any())
    return out


def _max_finite_cache(cache, scales, group):
    x = cache.float() if cache.dtype in FP8_DTYPES else cache.to(torch.float32)
    if scales is not None and x.numel():
        idx = torch.arange(cache.shape[-1]) // group
        x = x.to(torch.float64) * scales.to(torch.float64).index_select(-1, idx)
    x = x.to(torch.float64)
    fin = torch.isfinite(x)
    return float(x[fin].abs().max()) if fin.any() else 0.0


# ----------------------------------------------------------------------------------------------
# regressions found by the fuzzer


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


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("values", [[math.nan, 1.0], [1.0, math.nan], [math.nan]], ids=["first", "last", "alone"])
def test_fp8_store_nan_group(values, dtype):
    """Contract: amax = max|x| is NaN, so scale = amax / FP8_MAX is NaN and every element is NaN.
    (Found by this fuzzer: the kernel used to drop a NaN that was not the group's last element.)"""
    cache, scales, want_cache, want_scales = _store_one_group(values, dtype)
    assert torch.isnan(scales).all() and torch.isnan(want_scales).all()
    assert torch.isnan(cache.float()).all() and torch.isnan(want_cache.float()).all()


@pytest.mark.parametrize("op", ["store", "load", "attn"])
def test_meta_argument_is_rejected_by_name(op):
    """A meta tensor among CPU tensors dispatches to the fake kernel, which must not succeed silently."""
    cache = torch.zeros((2, 2, 1, 4))
    index = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([[1]], dtype=torch.int32).to("meta"))
    with pytest.raises(RuntimeError, match="lookup_table must be on the same device"):
        if op == "store":
            pagedkv.paged_store(torch.ones((1, 1, 4)), None, cache, None, *index)
        elif op == "load":
            torch.ops.pagedkv.paged_load(cache, None, index[2], index[1] + 1, index[0], torch.empty((1, 1, 4)))
        else:
            pagedkv.flash_attn_paged(torch.ones((1, 1, 4)), index[0], cache, cache, index[1], index[2])
    assert cache.abs().sum() == 0


def test_load_walks_only_the_table_columns_rows_need():
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


def test_rank_above_descriptor_limit_names_the_argument():
    cache = torch.zeros((2, 2, 1, 4, 1, 1, 1))
    with pytest.raises(RuntimeError, match="k_cache must be 4-D"):
        pagedkv.paged_store(torch.ones((1, 1, 4)), None, cache, None, torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([0], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32))


def test_infinite_softcap_is_rejected():
    cache = torch.ones((1, 1, 1, 4))
    index = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="softcap must be finite"):
        pagedkv.flash_attn_paged(torch.ones((1, 1, 4)), index[0], cache, cache, index[1],
                                 torch.tensor([[0]], dtype=torch.int32), softcap=math.inf)


@pytest.mark.parametrize("lengths", [[-1], [2**31 - 1], [8, -3]])
def test_load_convenience_validates_seq_lens_before_allocating(lengths):
    cache = torch.zeros((4, 2, 1, 4))
    table = torch.zeros((len(lengths), 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens must be"):
        pagedkv.paged_load(cache, table, torch.tensor(lengths, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# pytest entry points


def _cases_for(op):
    return max(1, round(TOTAL_CASES * OP_SHARES[op]))


def _run_chunk(op, chunk):
    total = _cases_for(op)
    per = -(-total // CHUNKS)
    for index in range(chunk * per, min(total, (chunk + 1) * per)):
        fuzz_case(op, index)


@pytest.mark.skipif(bool(REPLAY), reason="replaying one case")
@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("op", list(OP_SHARES))
def test_fuzz(op, chunk):
    _run_chunk(op, chunk)


@pytest.mark.skipif(not REPLAY, reason="set PAGEDKV_FUZZ_REPLAY=<op>:<index> to replay one case")
def test_replay():
    op, index = REPLAY.split(":")
    fuzz_case(op, int(index))


def test_case_count_meets_the_ci_floor():
    assert sum(_cases_for(op) for op in OP_SHARES) >= min(TOTAL_CASES, 10000)
