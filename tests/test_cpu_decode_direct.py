"""The direct decode path (csrc/cpu/kernels/decode_direct.inc: AVX2, and AVX-512 on 16-lane vectors)
against the float64 reference.

Direct decode widens K/V rows in registers next to the products (e4m3 through f16 bits with the 2^8
folded into the scales, NaN codes found by a byte compare). The kernel option cpu_decode="packed"
(pagedkv.set_kernel_options) selects the packed tiles instead, read per call, so both paths run in this
process on the same inputs:
- 16-bit and FP8 caches, FP8 scales per row (folded) and per group of 8 / 32 elements,
- 3, 4 and 5 query heads per KV head (blocks of 4 query vectors and their remainders), D 72 (a half
  column block on AVX2; not a whole 16-lane vector, so the packed path on AVX-512), D 80 (a half column
  block on AVX-512) and 128, odd key counts, a split-KV row (1100 keys);
- e4m3 NaN codes in K (the KV head's query rows become NaN) and in V (those columns become NaN).
On the scalar kernels both settings run the packed path and the test still holds; on the AMX kernels
16-bit queries over bf16/e4m3 rows keep the AMX tiles.

With bf16 queries, the AVX-512 kernels on a CPU with AVX512_BF16 run the direct decode on bf16 dot
products (csrc/cpu/kernels/decode_dot.inc) for bf16 rows (D a multiple of 32, Dv of 64) and raw FP8
rows with one scale per row or per group of a multiple of 32 channels (D, Dv multiples of 64, VBMI);
cpu_decode="fma" keeps the float32
products there. So every test here runs for float32 and bf16 queries under all three settings:
"auto" (the default choice: the direct decode), "fma" and "packed".
"""

from __future__ import annotations

import zlib

import pytest
import torch
from conftest import assert_attention_close

import pagedkv
from pagedkv import reference as ref

CACHE_DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
PATHS = ["auto", "fma", "packed"]
Q_DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = [1, 77, 300, 1100]  # cached keys per row, the new token included: odd tiles, one split-KV row
PAGE = 16


def fp8_max(dtype):
    return 448.0 if dtype == torch.float8_e4m3fn else 57344.0


def make_cache(gen, num_pages, hk, d, dtype, group, spread=False):
    """Random cache [num_pages, PAGE, hk, d] of dtype with the contract's FP8 scales (None for 16-bit):
    ceil(d / group) per row, the last group shorter where group does not divide d. spread: the channels
    of group g times 8 ** (g % 3 - 1), so the groups' scales differ 64-fold and one applied to another's
    products shows."""
    x = torch.randn(num_pages, PAGE, hk, d, generator=gen)
    if spread:
        x = x * 8.0 ** (torch.arange(d) // group % 3 - 1).float()
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.to(dtype), None
    ng = (d + group - 1) // group
    g = torch.nn.functional.pad(x, (0, ng * group - d)).view(num_pages, PAGE, hk, ng, group)
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fp8_max(dtype), torch.ones_like(amax))
    codes = (g / scale).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype).view(num_pages, PAGE, hk, ng * group)
    return codes[..., :d].contiguous(), scale.squeeze(-1).contiguous()


def random_table(gen, keys, spare):
    """A page table for rows of keys[b] keys in pages of a shuffled pool (`spare` pages more); (table, pages)."""
    pages = [(n + PAGE - 1) // PAGE for n in keys]
    num_pages = sum(pages) + spare
    table = torch.zeros(len(keys), max(pages), dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=gen)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    return table, num_pages


def decode_case(seed, dtype, group, q_heads, hk, d, q_dtype=torch.float32, spread=False):
    gen = torch.Generator().manual_seed(seed)
    table, num_pages = random_table(gen, LENGTHS, 3)
    k, ks = make_cache(gen, num_pages, hk, d, dtype, group, spread)
    v, vs = make_cache(gen, num_pages, hk, d, dtype, group, spread)
    q = torch.randn(len(LENGTHS), q_heads, d, generator=gen).to(q_dtype)
    offsets = torch.arange(len(LENGTHS) + 1, dtype=torch.int32)
    lengths = torch.tensor([n - 1 for n in LENGTHS], dtype=torch.int32)  # the new token is already stored
    kwargs = dict(k_scales=ks, v_scales=vs, quant_group=group)
    return q, (offsets, k, v, lengths, table), kwargs


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("q_heads,hk,d,group", [(6, 2, 128, 128), (8, 2, 72, 8), (5, 1, 128, 32), (4, 1, 80, 16),
                                                (8, 2, 64, 64), (3, 1, 192, 192), (7, 1, 96, 96), (7, 1, 128, 128),
                                                (16, 2, 64, 64)])
def test_direct_decode_matches_reference(kernel_options, q_dtype, path, dtype, q_heads, hk, d, group):
    """D 64 / 128 / 192 with one scale per row: the bf16 dot decode's bf16 and FP8 rows (QK and PV
    blocks of 4 query vectors and their remainders 1..3; GQA 7 and 8: two blocks); D 96 (V not whole
    64-column blocks) and FP8 groups smaller than D: the float32 products."""
    kernel_options(cpu_decode=path)
    seed = zlib.crc32(repr((str(dtype), q_heads, hk, d, group)).encode())
    q, args, kwargs = decode_case(seed, dtype, group, q_heads, hk, d, q_dtype)
    out = pagedkv.flash_attn_paged(q, *args, **kwargs)
    want = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert_attention_close(out, want, q_dtype, f"{path} q {q_dtype} {dtype} gqa {q_heads // hk} D {d} G {group}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kdt,vdt", [(torch.bfloat16, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.bfloat16)],
                         ids=["k_bf16-v_e4m3", "k_e4m3-v_bf16"])
def test_direct_decode_mixed_cache_dtypes(kernel_options, path, kdt, vdt):
    """K and V of different dtypes take their own conversions (the e4m3 side in its own slot order)."""
    kernel_options(cpu_decode=path)
    q, (offsets, k, _, lengths, table), kw = decode_case(11, kdt, 128, 8, 2, 128, torch.bfloat16)
    _, (_, _, v, _, _), vkw = decode_case(12, vdt, 128, 8, 2, 128, torch.bfloat16)  # same shapes, other values
    args = (offsets, k, v, lengths, table)
    scales = dict(k_scales=kw["k_scales"], v_scales=vkw["v_scales"], quant_group=128)
    out = pagedkv.flash_attn_paged(q, *args, **scales)
    want = ref.flash_attn_paged(q.double(), *args, **scales)
    assert_attention_close(out, want, torch.bfloat16, f"{path} K {kdt} V {vdt}")


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("group", [128, 32])
def test_direct_decode_e4m3_nan_codes(kernel_options, q_dtype, path, where, group):
    """NaN codes (0x7f, 0xff) in a visible K row make the query rows of that KV head NaN (a NaN key is
    never dropped: the CPU kernels' rule, tests/test_cpu_kernels_isa.py); in a V row they make those
    columns NaN (p * NaN, as in the reference). Everything else matches the reference."""
    kernel_options(cpu_decode=path)
    q, (offsets, k, v, lengths, table), kwargs = decode_case(7, torch.float8_e4m3fn, group, 8, 2, 128, q_dtype)
    cache = k if where == "k" else v
    bits = cache.view(torch.uint8)
    page, slot = int(table[2, 40 // PAGE]), 40 % PAGE  # row 2 (300 keys), key 40, KV head 1 (q heads 4..7)
    bits[page, slot, 1, 5] = 0x7F
    bits[page, slot, 1, 9] = 0xFF
    out = pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table, **kwargs)
    nan_where = torch.zeros(out.shape, dtype=torch.bool)
    if where == "k":
        nan_where[2, 4:8, :] = True
    else:
        nan_where[2, 4:8, [5, 9]] = True
    assert torch.equal(torch.isnan(out), nan_where), f"NaN at {torch.isnan(out).nonzero()[:8].tolist()}"
    clean = cache.clone()
    clean.view(torch.uint8)[page, slot, 1, [5, 9]] = 0
    k2, v2 = (clean, v) if where == "k" else (k, clean)
    want = ref.flash_attn_paged(q.double(), offsets, k2, v2, lengths, table, **kwargs)
    other = ~nan_where.any(-1)  # query rows without a NaN: the NaN key/columns do not reach them
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2  # bf16 output (and bf16 probabilities on the dot path)
    torch.testing.assert_close(out[other].double(), want[other], atol=tol, rtol=tol)


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2], ids=str)
def test_direct_decode_tiles_of_minus_inf_scores(kernel_options, q_dtype, path, dtype):
    """Keys whose every score is -inf (a -inf K element against a positive q element) get probability 0:
    whole 32-key tiles of them at the start of an item (row 3's 1100 keys are two split items, from key
    0 and from key 576), where the running max is still -inf, and in the middle of one. The softmax then
    scores that tile's rows against 0, not against the -inf max (-inf - -inf is NaN)."""
    kernel_options(cpu_decode=path)
    q, (offsets, k, v, lengths, table), kwargs = decode_case(21, dtype, 128, 8, 2, 128, q_dtype)
    q[:, :, 0] = q[:, :, 0].abs() + 0.5
    for key in list(range(0, 32)) + list(range(200, 232)) + list(range(576, 640)):
        k[int(table[3, key // PAGE]), key % PAGE, :, 0] = float("-inf")
    out = pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table, **kwargs)
    want = ref.flash_attn_paged(q.double(), offsets, k, v, lengths, table, **kwargs)
    assert not torch.isnan(out).any(), f"NaN at {torch.isnan(out).nonzero()[:8].tolist()}"
    assert_attention_close(out, want, q_dtype, f"{path} q {q_dtype} {dtype} -inf tiles")


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_direct_decode_every_fp8_code(kernel_options, q_dtype, path, dtype):
    """Every one of the 256 codes as a V value: a row with one key outputs its V row times the scale
    (probability 1), so each code's widening (the bf16 tables of the dot decode included) is checked
    exactly against torch's conversion, NaN and infinities too."""
    kernel_options(cpu_decode=path)
    d = 128
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(2, 1, 1, d)  # 2 rows of 128 codes
    v = torch.zeros(2, PAGE, 1, d, dtype=torch.uint8)
    v[:, :1] = codes
    v = v.view(dtype)
    k = torch.ones(2, PAGE, 1, d).to(dtype)
    ones = torch.ones(2, PAGE, 1, 1)
    q = torch.randn(2, 4, d, generator=torch.Generator().manual_seed(3)).to(q_dtype)
    offsets = torch.arange(3, dtype=torch.int32)
    lengths = torch.zeros(2, dtype=torch.int32)  # one key: the new token
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    out = pagedkv.flash_attn_paged(q, offsets, k, v, lengths, table, k_scales=ones, v_scales=ones, quant_group=d)
    want = v[:, 0, 0].float().unsqueeze(1).expand(2, 4, d)  # exact in bf16 and float32
    torch.testing.assert_close(out.float(), want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("hk", [8, 5, 12, 20])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_direct_decode_row_scales_of_many_heads(kernel_options, path, dtype, hk, layout):
    """The per-row FP8 scales of all the KV heads of a decode item, read once per tile (head_scales in
    decode_direct.inc): 8 heads (a whole 8 x 8 transpose of [key][head] loads), 5 (heads past the
    item's masked off), 12 and 20 (two and three transposes, the last one's heads past the item's masked
    off), scales whose heads are not neighbours (a [..., :1] view of a wider tensor: the gathers), short
    last tiles (77 keys)."""
    kernel_options(cpu_decode=path)
    seed = zlib.crc32(repr((str(dtype), hk, layout)).encode())
    q, (offsets, k, v, lengths, table), kw = decode_case(seed, dtype, 128, 2 * hk, hk, 128, torch.bfloat16)
    ks, vs = kw["k_scales"], kw["v_scales"]
    if layout == "strided":  # stride(2) == 3: each head's scale three floats after the previous one's
        ks = torch.cat([ks, torch.full_like(ks, float("nan")).expand(*ks.shape[:3], 2)], -1)[..., :1]
        vs = torch.cat([vs, torch.full_like(vs, float("nan")).expand(*vs.shape[:3], 2)], -1)[..., :1]
        assert ks.stride(2) == 3 and vs.stride(2) == 3
    args = (offsets, k, v, lengths, table)
    out = pagedkv.flash_attn_paged(q, *args, k_scales=ks, v_scales=vs, quant_group=128)
    want = ref.flash_attn_paged(q.double(), *args, k_scales=ks, v_scales=vs, quant_group=128)
    assert_attention_close(out, want, torch.bfloat16, f"{path} {dtype} hk {hk} {layout} scales")


@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("q_heads,hk,d,group", [(8, 2, 128, 64), (4, 1, 256, 128), (7, 1, 192, 64), (6, 2, 128, 96),
                                                (3, 1, 128, 32), (16, 8, 128, 64), (8, 4, 128, 32), (32, 8, 128, 32)])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_direct_decode_fp8_scale_groups(kernel_options, q_dtype, path, dtype, q_heads, hk, d, group, layout):
    """FP8 rows with a scale per group of channels (G < D, a multiple of 32): with bf16 queries the dot
    decode scores each group apart and scales its partial scores (dot_qk_fp8_groups), and takes one bf16
    probability row per V group (dot_pv_fp8_groups). 2-4 groups per row, D 256 at the default G 128,
    G 96 (a last group of 32 channels: a 64-column V block whose halves have groups of their own), GQA 3,
    4 and 7 (blocks of 4 query vectors and remainders), 8 KV heads x 2 groups and 4 x 4 (16 scales per key:
    two 8 x 8 transposes), 8 x 4 (32: four), and scales whose heads are not neighbours (the gathers). The
    groups' values differ 64-fold (make_cache's spread), so a scale applied to the wrong group shows."""
    kernel_options(cpu_decode=path)
    seed = zlib.crc32(repr((str(dtype), q_heads, hk, d, group)).encode())
    q, args, kwargs = decode_case(seed, dtype, group, q_heads, hk, d, q_dtype, spread=True)
    if layout == "strided":  # each head's scales two floats after the end of the previous head's
        for name in ("k_scales", "v_scales"):
            x = kwargs[name]
            kwargs[name] = torch.cat([x, torch.full_like(x[..., :1], float("nan")).expand(*x.shape[:3], 2)], -1)[..., :x.shape[-1]]
            assert kwargs[name].stride(2) == x.shape[-1] + 2
    out = pagedkv.flash_attn_paged(q, *args, **kwargs)
    want = ref.flash_attn_paged(q.double(), *args, **kwargs)
    assert_attention_close(out, want, q_dtype, f"{path} q {q_dtype} {dtype} gqa {q_heads // hk} D {d} G {group} {layout}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("kdt,vdt", [(torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e5m2, torch.bfloat16),
                                     (torch.bfloat16, torch.float8_e4m3fn)], ids=["e4m3", "k_e5m2-v_bf16", "k_bf16-v_e4m3"])
def test_direct_decode_fp8_groups_rows_and_softcap(kernel_options, path, softcap, kdt, vdt):
    """Grouped FP8 scales (G 32, D 128) where the softmax runs row by row: a softcap, and three new tokens
    per sequence (causal: each query row sees keys up to its own; after 31 and 62 cached keys the first
    rows see none of the last tile's, whose probabilities must be 0 in every V group's row); K and V of
    different dtypes (grouped on one side only). Without the softcap, K that can hold -inf (e5m2, bf16)
    gets whole tiles of -inf scores at the start of the longest row (the running max still -inf there:
    zero probabilities in every V group's row)."""
    kernel_options(cpu_decode=path)
    gen = torch.Generator().manual_seed(5)
    rows, hk, heads, d, group = 3, 2, 2, 128, 32
    # cached keys before the 3 new tokens: after 31 and 62 the last 32-key tile lies past the first rows' keys
    lengths = torch.tensor([0, 31, 62, 300, 1100], dtype=torch.int32)
    table, num_pages = random_table(gen, [int(n) + rows for n in lengths], 2)
    k, ks = make_cache(gen, num_pages, hk, d, kdt, group, spread=True)
    v, vs = make_cache(gen, num_pages, hk, d, vdt, group, spread=True)
    q = torch.randn(len(lengths) * rows, hk * heads, d, generator=gen).to(torch.bfloat16)
    offsets = torch.arange(0, len(lengths) * rows + 1, rows, dtype=torch.int32)
    if softcap == 0.0 and kdt != torch.float8_e4m3fn:  # e4m3 has no infinity
        q[:, :, 0] = q[:, :, 0].abs() + 0.5
        for key in range(64):
            k[int(table[4, key // PAGE]), key % PAGE, :, 0] = float("-inf")
    args = (q, offsets, k, v, lengths, table)
    kwargs = dict(k_scales=ks, v_scales=vs, quant_group=group, softcap=softcap)
    out = pagedkv.flash_attn_paged(*args, **kwargs)
    want = ref.flash_attn_paged(q.double(), *args[1:], **kwargs)
    assert_attention_close(out, want, torch.bfloat16, f"{path} {kdt} {vdt} softcap {softcap} rows {rows}")
