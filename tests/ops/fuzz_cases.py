"""Seeded property/fuzz cases of the three ops against the plain-torch reference: the shared part
(storage layouts, index generation and the independent oracle, descriptor mutations, the error
contract). The per-op case builders are in fuzz_op_cases.py; each tests/ops/test_<op>.py runs its
op's cases in chunks (CPU tensors: every CPU kernel path runs them, see scripts/test.sh).

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
import zlib

import torch

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



def choose_mutation(r, candidates, p=0.55):
    return pick(r, candidates) if r.random() < p else "none"



def geometry(r, allow_mla=True):
    P = pick(r, [1, 1, 2, 3, 4, 5, 8, 16])
    Hk = pick(r, [1, 1, 2, 3])
    D = pick(r, [1, 2, 3, 4, 5, 8, 16, 32])
    Dv = D if (not allow_mla or r.random() < 0.8) else pick(r, [1, 2, 4, 8, 16])
    k_dtype = pick(r, CACHE_DTYPES)
    v_dtype = k_dtype if r.random() < 0.8 else pick(r, CACHE_DTYPES)
    group = pick(r, [1, 2, 3, 4, 8, 16, 128, D, D + 1, 2**62, 2**63 - 1])
    return P, Hk, D, Dv, k_dtype, v_dtype, group


