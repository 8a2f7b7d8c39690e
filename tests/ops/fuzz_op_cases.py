"""The fuzz case builders of each op (paged_store, paged_load, flash_attn_paged) on the shared
machinery of fuzz_cases.py, and the chunked runner tests/ops/test_<op>.py call. See fuzz_cases.py
for what a case checks; a failure prints `PAGEDKV_FUZZ_REPLAY=<op>:<index>`, and with that variable
set the op's test file runs that one case instead of its chunks.
"""

from __future__ import annotations

import math
import random

import torch

import pagedkv
from pagedkv import reference as ref
from fuzz_cases import (
    BAD_FLOAT_DTYPES,
    BroadcastRow,
    FLOAT_DTYPES,
    FP8_DTYPES,
    FuzzFailure,
    assert_same_bits,
    cache_planes,
    choose_mutation,
    expect_error_or_ok,
    gen_rows,
    gen_table,
    geometry,
    int32_tensor,
    mutate_view,
    oracle_attn,
    oracle_load,
    oracle_store,
    perturb_lengths,
    perturb_offsets,
    perturb_table,
    pick,
    ragged,
    random_bytes_,
    snapshot,
    to_dtype,
    case_seed,
    OP_SHARES,
    TOTAL_CASES,
    REPLAY,
    CHUNKS,
)


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
    if specials:  # inf/NaN in K and V values and FP8 scales, at any key (masked ones included)
        views = views_fn(bases)
        first = Dv if mla else 0  # MLA: V is K's first Dv channels; specials only past them
        for name, lo, hi in (("k", first, D), ("v", 0, Dv), ("k_scales", 0, None), ("v_scales", 0, None)):
            view = views.get(name)
            if view is None or not view.numel() or (name == "v" and mla) or r.random() < 0.5:
                continue
            hi = view.shape[-1] if hi is None else hi
            if lo >= hi:
                continue
            for _ in range(r.randint(1, 3)):
                at = (r.randrange(N), r.randrange(P), r.randrange(Hk), r.randrange(lo, hi))
                # an infinite K scale only as NaN: the kernels fold a row's scale into its score, (q . k) * s,
                # where the contract's element value k * s gives inf - inf = NaN in q . k; both are fine
                value = math.nan if name == "k_scales" else pick(r, [math.inf, -math.inf, math.nan])
                view[at] = to_dtype(torch.tensor(value, dtype=torch.float64), view.dtype)
            desc.append(f"{name}_specials")
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
    """[T, Hq] bool: the query row sees a key whose score or value is not finite (float64 inputs)."""
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
        values = ref.gather_rows(v_cache, vs, table[b : b + 1], [total], quant_group=group, out_dtype=torch.float64)[0]
        # a key whose score or value is not finite (a row that sees a non-finite value may be non-finite
        # in more columns than the reference, e.g. 0 * inf where a probability rounds to 0)
        bad_key = ~torch.isfinite(keys).all(-1) | ~torch.isfinite(values).all(-1)  # [total, Hk]
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


def cases_for(op):
    return max(1, round(TOTAL_CASES * OP_SHARES[op]))


def chunk_cases(op, chunk):
    """The case indices chunk `chunk` of `op` runs: the chunks split [0, cases_for(op)) in order."""
    total = cases_for(op)
    per = -(-total // CHUNKS)
    return range(chunk * per, min(total, (chunk + 1) * per))


def chunks(op):
    """pytest params of an op's fuzz test: its chunks, or the one case PAGEDKV_FUZZ_REPLAY names."""
    if REPLAY:
        replay_op, index = REPLAY.split(":")
        return [f"replay{index}"] if replay_op == op else []
    return list(range(CHUNKS))


def run_chunk(op, chunk, case=None):
    """Run one chunk (or the replayed case) of `op`; `case` stands in for fuzz_case in tests of
    the chunking itself."""
    case = case or fuzz_case
    if isinstance(chunk, str):
        case(op, int(chunk[len("replay"):]))
        return
    for index in chunk_cases(op, chunk):
        case(op, index)
