"""Every CPU kernel path (PAGEDKV_CPU_ISA=scalar|avx2|avx512|amx) against the others and a float64 reference.

The ISA is chosen once per process, so each path runs in a subprocess (this file with --worker) that
computes attention (decode rows, prefill chunks on a prefix, a long split-KV decode), paged_store and
paged_load over a grid and saves the outputs; the test process compares them:
- attention with float32 q: within 1e-5 (norm-wise relative and max-abs relative) of float64;
  bf16/f16 q (the bf16 dot-product and AMX tile paths): within the output dtype's rounding;
- paths against each other: float32 attention within 1e-5; store/load bit-for-bit;
- paged_store to FP8: codes and scales equal to the contract's rule computed with torch
  (amax / FP8_MAX, x / scale, clamp, cast), including NaN / inf / subnormal inputs;
- non-finite and extreme scores: a visible NaN key makes its query rows NaN (never a silently
  dropped key), a +inf score makes the row NaN as in the reference, rows that do not see the bad
  key stay exact, and scores near the float32 range still give the float64 softmax.
Paths the CPU cannot run fall back to the best it can, so the test runs anywhere; the AMX path is
skipped where the CPU has no AMX-BF16 (it would only repeat AVX-512). The workers run concurrently, and
page size x GQA are paired (each value of each still covered per ISA x dtype x head size) to keep CI short.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from conftest import rising_scores

HEAD_SIZES = [64, 80, 96, 128, 256]
CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
# (page size, query heads per KV head): every page size and GQA value, without their full product
PAGE_GQA = [(1, 4), (16, 8), (64, 1)]


def cpu_has_amx():
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags and "amx_tile" in flags


ISAS = ["scalar", "avx2", "avx512"] + (["amx"] if cpu_has_amx() else [])
ALL_ISAS = ["scalar", "avx2", "avx512", "amx"]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype):
    return 448.0 if dtype == torch.float8_e4m3fn else 57344.0


def quantize(x, dtype, group):
    """The contract's FP8 rule in torch (float32 throughout)."""
    d = x.shape[-1]
    ng = (d + group - 1) // group
    codes = torch.empty(x.shape, dtype=dtype)
    scales = torch.empty(*x.shape[:-1], ng)
    for g in range(ng):
        xs = x[..., g * group:(g + 1) * group].float()
        amax = xs.abs().amax(-1, keepdim=True)
        # contract: scale 1 only when amax == 0; a NaN amax gives a NaN scale
        s = torch.where(amax == 0, torch.ones_like(amax), amax / fp8_max(dtype))
        codes[..., g * group:(g + 1) * group] = (xs / s).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
        scales[..., g] = s[..., 0]
    return codes, scales


def attn_cases():
    cases = []
    for d in HEAD_SIZES:
        for p, g in PAGE_GQA:
            for cdt in CACHE_DTYPES:
                qdts = [torch.float32] + ([torch.bfloat16] if cdt in (torch.bfloat16,) + FP8 else [])
                qdts += [torch.float16] if cdt == torch.float16 else []
                for qdt in qdts:
                    group = 32 if (cdt in FP8 and d == 96) else 128  # G < D and G >= D both covered
                    cases.append(dict(d=d, p=p, gqa=g, cdt=cdt, qdt=qdt, group=group, new=[1, 37, 0], cached=[150, 30, 5]))
    # a long prefill chunk: several full 64-key tiles and 32-row tile pairs per item (AMX)
    for cdt in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        qdt = torch.float16 if cdt == torch.float16 else torch.bfloat16
        cases.append(dict(d=128, p=16, gqa=4, cdt=cdt, qdt=qdt, group=128, new=[150], cached=[70], hk=2))
    # short prefill chunks (16 <= rows x gqa < 256 query vectors per KV head): several KV heads per item
    # on AVX2/AVX-512, one per item on AMX (its tile path takes one head); a 32-row chunk over 9000
    # keys is split into >= 4096-key pieces merged by log-sum-exp
    for cdt in (torch.bfloat16, torch.float8_e4m3fn):
        cases.append(dict(d=128, p=16, gqa=4, cdt=cdt, qdt=torch.bfloat16, group=128, new=[8, 32], cached=[300, 70],
                          hk=3))
    cases.append(dict(d=128, p=16, gqa=4, cdt=torch.bfloat16, qdt=torch.bfloat16, group=128, new=[32], cached=[9000],
                      hk=2))
    # decode on 32-slot pages (AMX decode loads 16-key K blocks in place from the page), with and
    # without a softcap (the AMX decode softmax gathers S^T columns; softcap reads transposed rows)
    for cdt in (torch.bfloat16, torch.float8_e4m3fn):
        for softcap in (0.0, 5.0):
            cases.append(dict(d=128, p=32, gqa=4, cdt=cdt, qdt=torch.bfloat16, group=128, new=[1, 1, 1],
                              cached=[200, 77, 16], hk=3, softcap=softcap))
    # decode where 16-key K blocks are not evenly spaced (pages under 16 slots, short blocks): the AMX
    # decode scores every head of the item per key, heads in groups of 16 // gqa columns. Groups of
    # 1 to 3 heads, several groups, odd key counts, and more than 16 KV heads (the row-copy path)
    for p, gqa, hk, d in ((1, 4, 8, 128), (8, 8, 6, 64), (1, 3, 7, 96), (4, 5, 4, 128), (1, 1, 20, 64)):
        cases.append(dict(d=d, p=p, gqa=gqa, cdt=torch.bfloat16, qdt=torch.bfloat16, group=128, new=[1, 1],
                          cached=[100, 33], hk=hk))
    # long decode: few items -> split-KV with a log-sum-exp merge
    for cdt in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        for qdt in (torch.float32, torch.bfloat16):
            cases.append(dict(d=128, p=16, gqa=4, cdt=cdt, qdt=qdt, group=128, new=[1], cached=[3000], hk=2))
    return cases


def make_attn(case, seed):
    gen = torch.Generator().manual_seed(seed)
    d, p, gqa, cdt = case["d"], case["p"], case["gqa"], case["cdt"]
    hk = case.get("hk", 2)
    hq = hk * gqa
    new, cached = case["new"], case["cached"]
    b = len(new)
    total = [c + n for c, n in zip(cached, new)]
    maxp = max((t + p - 1) // p for t in total)
    n_pages = b * maxp + 2
    table = torch.randperm(n_pages, generator=gen)[: b * maxp].to(torch.int32).view(b, maxp)
    kf = torch.randn(n_pages, p, hk, d, generator=gen)
    vf = torch.randn(n_pages, p, hk, d, generator=gen)
    ks = vs = None
    if cdt in FP8:
        kc, ks = quantize(kf, cdt, case["group"])
        vc, vs = quantize(vf, cdt, case["group"])
    else:
        kc, vc = kf.to(cdt), vf.to(cdt)
    offsets = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(offsets[-1]) + 1, hq, d, generator=gen).to(case["qdt"])  # + one padding row
    lengths = torch.tensor(cached, dtype=torch.int32)
    return q, offsets, kc, vc, lengths, table, ks, vs


def reference_attn(q, offsets, kc, vc, lengths, table, ks, vs, group, softcap=0.0):
    t_rows, hq, d = q.shape
    _, p, hk, _ = kc.shape

    def deq(c, s):
        x = c.to(torch.float64)
        if s is not None:
            x = x * s.to(torch.float64)[..., torch.arange(c.shape[-1]) // group]
        return x

    K, V = deq(kc, ks), deq(vc, vs)
    out = torch.zeros(t_rows, hq, d, dtype=torch.float64)
    scale = 1.0 / math.sqrt(d)
    for b in range(lengths.numel()):
        n = int(offsets[b + 1] - offsets[b])
        total = int(lengths[b]) + n
        if n == 0:
            continue
        pages = table[b, : (total + p - 1) // p].long()
        kb = K[pages].reshape(-1, hk, d)[:total].repeat_interleave(hq // hk, 1)
        vb = V[pages].reshape(-1, hk, d)[:total].repeat_interleave(hq // hk, 1)
        qq = q[int(offsets[b]):int(offsets[b + 1])].to(torch.float64)
        s = torch.einsum("ihd,jhd->hij", qq, kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = int(lengths[b]) + torch.arange(n)
        s = s.masked_fill(torch.arange(total)[None, :] > pos[:, None], float("-inf"))
        out[int(offsets[b]):int(offsets[b + 1])] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vb)
    return out


def store_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    t, hk, d, p = 70, 3, 80, 16
    key = torch.randn(t, hk, d, generator=gen) * 3
    key[0, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-30, -0.0])
    key[1, 1, 7] = float("nan")  # a NaN mid-group
    key[2, 2, :] = 0.0  # amax == 0: scale 1
    key[3, 0, :] = torch.randn(d, generator=gen) * 1e-6  # e4m3 subnormals
    key[4, 1, :] = torch.randn(d, generator=gen) * 1e5  # f16 overflow / bf16 rounding
    key[5, 2, :] = torch.tensor([65519.0, 65520.0, 2.0 ** -25, 3 * 2.0 ** -26] * (d // 4))
    value = torch.randn(t, hk, d, generator=gen)
    offsets = torch.tensor([0, 20, 21, 70], dtype=torch.int32)
    lengths = torch.tensor([5, 40, 0], dtype=torch.int32)
    table = torch.randperm(12, generator=gen)[:12].to(torch.int32).view(3, 4)
    return key, value, offsets, lengths, table, p


def run_store_load(src_dtype, cache_dtype, group):
    key, value, offsets, lengths, table, p = store_inputs(7)
    key, value = key.to(src_dtype), value.to(src_dtype)
    hk, d = key.shape[1:]
    kc = torch.zeros(12, p, hk, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    ks = vs = None
    if cache_dtype in FP8:
        ng = (d + group - 1) // group
        ks, vs = torch.zeros(12, p, hk, ng), torch.zeros(12, p, hk, ng)
    import pagedkv

    pagedkv.paged_store(key, value, kc, vc, offsets, lengths, table, ks, vs, group)
    seq = lengths + (offsets[1:] - offsets[:-1])
    loads = {}
    for odt in (torch.float32, torch.bfloat16, torch.float16):
        out_offsets = torch.tensor([0] + seq.cumsum(0).tolist(), dtype=torch.int32)
        out = torch.empty(int(out_offsets[-1]), hk, d, dtype=odt)
        torch.ops.pagedkv.paged_load(kc, ks, table, seq, out_offsets, out, group)
        loads[str(odt)] = out
    return dict(k=kc, v=vc, ks=ks, vs=vs, loads=loads)


STORE_CASES = [(s, c, g) for s in (torch.float32, torch.bfloat16, torch.float16)
               for c in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
               for g in ((128, 32) if c in FP8 else (128,))]


# Non-finite / extreme scores, one batch row each, 8 new tokens on 40 cached (so with Hq/Hk = 2,
# 16 query vectors per KV head: the AMX tile path runs for bf16):
#  row 0: key 44 holds a NaN: query rows 4..7 see it (causal), rows 0..3 do not;
#  row 1: key 10 has +inf in channel 0 and q's channel 0 is positive: a +inf score for every row;
#  row 2: q and k scaled by 2^60 so |q.k| reaches ~1e37 (finite in float32, one-hot softmax;
#         2^6 for float16).
SPECIAL_NEW, SPECIAL_CACHED, SPECIAL_D = 8, 40, 64


def special_attn(qdt, cdt):
    gen = torch.Generator().manual_seed(11)
    p, hk, hq, d, b = 16, 1, 2, SPECIAL_D, 3
    total = SPECIAL_CACHED + SPECIAL_NEW
    pages = (total + p - 1) // p
    table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    k = torch.randn(b * pages, p, hk, d, generator=gen)
    v = torch.randn(b * pages, p, hk, d, generator=gen)
    q = torch.randn(b * SPECIAL_NEW, hq, d, generator=gen)
    k[table[0, 44 // p], 44 % p, 0, 5] = float("nan")
    q[SPECIAL_NEW:2 * SPECIAL_NEW, :, 0] = q[SPECIAL_NEW:2 * SPECIAL_NEW, :, 0].abs() + 0.5
    k[table[1, 10 // p], 10 % p, 0, 0] = float("inf")
    big = 2.0 ** 6 if qdt == torch.float16 else 2.0 ** 60  # float16 tops out at 65504
    k[table[2].long()] *= big
    q[2 * SPECIAL_NEW:] *= big
    offsets = torch.arange(0, (b + 1) * SPECIAL_NEW, SPECIAL_NEW, dtype=torch.int32)
    lengths = torch.full((b,), SPECIAL_CACHED, dtype=torch.int32)
    return q.to(qdt), offsets, k.to(cdt), v.to(cdt), lengths, table


def special_split_decode(qdt):
    """One decode token over 3000 keys (split-KV: partials merged by log-sum-exp), a NaN in key 1000
    of head 0: head 0's query rows are NaN, head 1's match the reference."""
    gen = torch.Generator().manual_seed(12)
    p, hk, gqa, d, cached = 16, 2, 4, SPECIAL_D, 3000
    pages = (cached + 1 + p - 1) // p
    table = torch.randperm(pages, generator=gen).to(torch.int32).view(1, pages)
    k = torch.randn(pages, p, hk, d, generator=gen)
    v = torch.randn(pages, p, hk, d, generator=gen)
    k[table[0, 1000 // p], 1000 % p, 0, 3] = float("nan")
    q = torch.randn(1, hk * gqa, d, generator=gen).to(qdt)
    offsets = torch.tensor([0, 1], dtype=torch.int32)
    return q, offsets, k, v, torch.tensor([cached], dtype=torch.int32), table


RISING = [(qdt, step) for qdt in (torch.float32, torch.bfloat16) for step in (1.0, 4.0, 60.0)]


SPECIAL_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


def worker(path):
    import pagedkv

    res = {"attn": [], "store": [], "special": []}
    for qdt, cdt in SPECIAL_DTYPES:
        q, offsets, kc, vc, lengths, table = special_attn(qdt, cdt)
        res["special"].append(pagedkv.flash_attn_paged(q, offsets, kc, vc, lengths, table))
    res["rising"] = [pagedkv.flash_attn_paged(*rising_scores(qdt, step)) for qdt, step in RISING]
    res["split"] = [pagedkv.flash_attn_paged(*special_split_decode(qdt)) for qdt in (torch.float32, torch.bfloat16)]
    for i, case in enumerate(attn_cases()):
        res["attn"].append(run_attn_case(pagedkv, case, i))
    for s, c, g in STORE_CASES:
        res["store"].append(run_store_load(s, c, g))
    # the float16 cases again on the other decode paths (packed tiles, float32 FMA products)
    res["f16"] = {}
    for decode in ("packed", "fma"):
        pagedkv.set_kernel_options(cpu_decode=decode)
        res["f16"][decode] = {i: run_attn_case(pagedkv, case, i) for i, case in enumerate(attn_cases())
                              if case["qdt"] == torch.float16}
    pagedkv.set_kernel_options(cpu_decode="auto")
    torch.save(res, path)


def run_attn_case(pagedkv, case, i):
    q, offsets, kc, vc, lengths, table, ks, vs = make_attn(case, i)
    return pagedkv.flash_attn_paged(q, offsets, kc, vc, lengths, table, k_scales=ks, v_scales=vs,
                                    quant_group=case["group"], softcap=case.get("softcap", 0.0))


@pytest.fixture(scope="module")
def outputs():
    outs = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryDirectory() as tmp:
        procs = {}
        for isa in ISAS:
            path = os.path.join(tmp, isa + ".pt")
            procs[isa] = (path, subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", path],
                                                 env=dict(env, PAGEDKV_CPU_ISA=isa)))
        for isa, (path, proc) in procs.items():
            assert proc.wait(timeout=1200) == 0, f"{isa} worker failed"
            outs[isa] = torch.load(path)
    return outs


def close(out, ref, tol):
    diff = (out.double() - ref).abs()
    norm = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    mx = (diff.max() / ref.abs().max().clamp_min(1e-30)).item()
    return norm <= tol and mx <= tol, (norm, mx)


@pytest.fixture(scope="module")
def references():
    refs = []
    for i, case in enumerate(attn_cases()):
        q, offsets, kc, vc, lengths, table, ks, vs = make_attn(case, i)
        refs.append((reference_attn(q, offsets, kc, vc, lengths, table, ks, vs, case["group"], case.get("softcap", 0.0)),
                     int(offsets[-1])))
    return refs


def need(isa):
    if isa not in ISAS:
        pytest.skip(f"this CPU has no {isa}")


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_attention_against_float64(outputs, references, isa):
    need(isa)
    bad = []
    for i, case in enumerate(attn_cases()):
        ref, used_rows = references[i]
        out = outputs[isa]["attn"][i]
        assert torch.all(out[used_rows:] == 0), "padding rows must be zeros"
        tol = 1e-5 if case["qdt"] == torch.float32 else 1e-2
        ok, err = close(out, ref, tol)
        if not ok:
            bad.append((case, err))
    assert not bad, f"{len(bad)} cases off: {bad[:3]}"


# float16 at float16 precision (issue 48): the norm of the error against the float64 reference,
# relative to the reference's, for float16 queries over float16 caches. The output's own rounding
# to float16 is 2^-12 (2.4e-4) relative on average; tiles that round to bfloat16 gave 3.1e-3.
F16_TOL = 5e-4


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_float16_at_float16_precision(outputs, references, isa):
    need(isa)
    bad, seen = [], 0
    for i, case in enumerate(attn_cases()):
        if case["qdt"] != torch.float16:
            continue
        ref, used_rows = references[i]
        runs = {"auto": outputs[isa]["attn"][i], **{k: v[i] for k, v in outputs[isa]["f16"].items()}}
        for decode, out in runs.items():
            seen += 1
            err = ((out[:used_rows].double() - ref[:used_rows]).norm() / ref[:used_rows].norm()).item()
            if not err <= F16_TOL:
                bad.append((decode, case, err))
    assert seen >= 3 * 10, f"only {seen} float16 runs"
    assert not bad, f"{len(bad)} float16 runs over {F16_TOL}: {bad[:3]}"


@pytest.mark.parametrize("isa", ["avx2", "avx512", "amx"])
def test_paths_agree(outputs, isa):
    need(isa)
    for i, case in enumerate(attn_cases()):
        a, b = outputs["scalar"]["attn"][i], outputs[isa]["attn"][i]
        if case["qdt"] == torch.float32:
            ok, err = close(a, b.double(), 1e-5)
            assert ok, (case, err)
    for (s, c, g), x, y in zip(STORE_CASES, outputs["scalar"]["store"], outputs[isa]["store"]):
        for name in ("k", "v", "ks", "vs"):
            if x[name] is not None:
                assert torch.equal(x[name].view(torch.uint8), y[name].view(torch.uint8)), (s, c, g, name)
        for odt in x["loads"]:
            assert torch.equal(x["loads"][odt].view(torch.uint8), y["loads"][odt].view(torch.uint8)), (s, c, g, odt)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_non_finite_and_extreme_scores(outputs, isa):
    need(isa)
    n = SPECIAL_NEW
    for (qdt, cdt), got in zip(SPECIAL_DTYPES, outputs[isa]["special"]):
        q, offsets, kc, vc, lengths, table = special_attn(qdt, cdt)
        ref = reference_attn(q, offsets, kc, vc, lengths, table, None, None, 128)
        what = f"{isa} q={qdt} cache={cdt}"
        assert torch.isnan(got[4:n]).all(), f"{what}: rows seeing the NaN key must be NaN, got {got[4:n, 0, :4]}"
        assert torch.isnan(got[n:2 * n]).all(), f"{what}: rows with a +inf score must be NaN (as the reference)"
        assert torch.isnan(ref[n:2 * n]).all()
        clean = torch.cat([got[:4], got[2 * n:]]).double()
        want = torch.cat([ref[:4], ref[2 * n:]])
        tol = 1e-5 if qdt == torch.float32 else 1e-2
        ok, err = close(clean, want, tol)
        assert ok, f"{what}: rows without bad keys (incl. |q.k| ~ 1e37) off by {err}"
    for qdt, got in zip((torch.float32, torch.bfloat16), outputs[isa]["split"]):
        q, offsets, kc, vc, lengths, table = special_split_decode(qdt)
        ref = reference_attn(q, offsets, kc, vc, lengths, table, None, None, 128)
        assert torch.isnan(got[:, :4]).all(), f"{isa} q={qdt}: split-KV merge dropped a NaN key"
        ok, err = close(got[:, 4:].double(), ref[:, 4:], 1e-5 if qdt == torch.float32 else 1e-2)
        assert ok, f"{isa} q={qdt}: split-KV head without the NaN key off by {err}"


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_rising_scores_rescale(outputs, isa):
    need(isa)
    for (qdt, step), got in zip(RISING, outputs[isa]["rising"]):
        q, offsets, kc, vc, lengths, table = rising_scores(qdt, step)
        ref = reference_attn(q, offsets, kc, vc, lengths, table, None, None, 128)
        # float32 scores of size ~5 * step carry an absolute rounding error of ~5 * step * 2^-24,
        # which becomes the probabilities' relative error
        tol = max(1e-5, 5 * step * 2.0 ** -22) if qdt == torch.float32 else 1e-2
        ok, err = close(got, ref, tol)
        assert ok, f"{isa} q={qdt} step={step}: off by {err}"


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_store_matches_contract_rule(outputs, isa):
    need(isa)
    key, value, offsets, lengths, table, p = store_inputs(7)
    for (s, c, g), got in zip(STORE_CASES, outputs[isa]["store"]):
        for x, cache, scales in ((key.to(s), got["k"], got["ks"]), (value.to(s), got["v"], got["vs"])):
            for b in range(3):
                for i in range(int(offsets[b]), int(offsets[b + 1])):
                    pos = int(lengths[b]) + i - int(offsets[b])
                    page, slot = int(table[b, pos // p]), pos % p
                    if c in FP8:
                        codes, sc = quantize(x[i].float(), c, g)
                        assert torch.equal(cache[page, slot].view(torch.uint8), codes.view(torch.uint8)), (s, c, g, i)
                        have_nan, want_nan = scales[page, slot].isnan(), sc.isnan()
                        assert torch.equal(have_nan, want_nan), (s, c, g, i)
                        assert torch.equal(scales[page, slot][~have_nan], sc[~want_nan]), (s, c, g, i)
                    else:  # round to nearest even; NaN payloads are not part of the rule
                        want, have = x[i].to(c), cache[page, slot]
                        finite = ~want.isnan()
                        assert torch.equal(have[finite].view(torch.uint8), want[finite].view(torch.uint8)), (s, c, i)
                        assert torch.equal(have.isnan(), want.isnan()), (s, c, i)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit(pytest.main([__file__, "-q"]))
