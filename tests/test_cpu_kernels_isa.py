"""Every CPU kernel path (PAGEDKV_CPU_ISA=scalar|avx2|avx512) against the others and a float64 reference.

The ISA is chosen once per process, so each path runs in a subprocess (this file with --worker) that
computes attention (decode rows, prefill chunks on a prefix, a long split-KV decode), paged_store and
paged_load over a grid and saves the outputs; the test process compares them:
- attention with float32 q: within 1e-5 (norm-wise relative and max-abs relative) of float64;
  bf16/f16 q (the bf16 dot-product path): within the output dtype's rounding;
- paths against each other: float32 attention within 1e-5; store/load bit-for-bit;
- paged_store to FP8: codes and scales equal to the contract's rule computed with torch
  (amax / FP8_MAX, x / scale, clamp, cast), including NaN / inf / subnormal inputs.
Paths the CPU cannot run fall back to the best it can, so the test runs anywhere.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

HEAD_SIZES = [64, 80, 96, 128, 256]
PAGE_SIZES = [1, 16, 64]
GQA = [1, 4, 8]
CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
ISAS = ["scalar", "avx2", "avx512"]
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
        for p in PAGE_SIZES:
            for g in GQA:
                for cdt in CACHE_DTYPES:
                    qdts = [torch.float32] + ([torch.bfloat16] if cdt in (torch.bfloat16,) + FP8 else [])
                    for qdt in qdts:
                        group = 32 if (cdt in FP8 and d == 96) else 128  # G < D and G >= D both covered
                        cases.append(dict(d=d, p=p, gqa=g, cdt=cdt, qdt=qdt, group=group, new=[1, 37, 0], cached=[150, 30, 5]))
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


def reference_attn(q, offsets, kc, vc, lengths, table, ks, vs, group):
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


def worker(path):
    import pagedkv

    res = {"attn": [], "store": []}
    for i, case in enumerate(attn_cases()):
        q, offsets, kc, vc, lengths, table, ks, vs = make_attn(case, i)
        res["attn"].append(pagedkv.flash_attn_paged(q, offsets, kc, vc, lengths, table, k_scales=ks, v_scales=vs,
                                                    quant_group=case["group"]))
    for s, c, g in STORE_CASES:
        res["store"].append(run_store_load(s, c, g))
    torch.save(res, path)


@pytest.fixture(scope="module")
def outputs():
    outs = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryDirectory() as tmp:
        for isa in ISAS:
            path = os.path.join(tmp, isa + ".pt")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", path],
                           env=dict(env, PAGEDKV_CPU_ISA=isa), check=True, timeout=1200)
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
        refs.append((reference_attn(q, offsets, kc, vc, lengths, table, ks, vs, case["group"]), int(offsets[-1])))
    return refs


@pytest.mark.parametrize("isa", ISAS)
def test_attention_against_float64(outputs, references, isa):
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


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_paths_agree(outputs, isa):
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


@pytest.mark.parametrize("isa", ISAS)
def test_store_matches_contract_rule(outputs, isa):
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
