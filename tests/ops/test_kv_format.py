"""Packed MLA rows (CONTRACT v1.2 `kv_format`: "fp8_ds_mla", "fp8_rope") through every op.

paged_store writes the bytes of `reference.pack_mla_rows` exactly and paged_load returns
`reference.unpack_mla_rows` exactly; rows another producer wrote (its own scales, any positive
finite float32) read the same way; attention (dense with causal, window, softcap, sinks, lse and
.out; sparse) matches the float64 reference over the logical keys and values; every rule of the
format raises a RuntimeError naming its argument with the cache unchanged; opcheck and the fakes.
Every test runs on CUDA too where there is one (attention on its portable kernels; a configuration
the CUDA kernels refuse skips there).
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_batch
from op_helpers import *  # noqa: F403
from pagedkv.kv_formats import KEY_DIM, KV_FORMATS, LATENT_DIM

FORMATS = list(KV_FORMATS)
Q_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PAGE_SIZES_MLA = [1, 16, 64]
GQA_HEADS = [16, 128]  # query heads over the one latent head
ROPE_SCALE = 0.02  # fp8_rope's per-tensor scale in stored caches: N(0, 1) latents reach |x / s| ~ 200


def tensor_scale(kv_format, device="cpu", value=ROPE_SCALE):
    """k_scales of a packed cache: fp8_rope's one float32 element, None for fp8_ds_mla."""
    return torch.tensor([value], dtype=torch.float32, device=device) if KV_FORMATS[kv_format].per_tensor_scale else None


def random_bytes(gen, shape, device="cpu"):
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(device)


def producer_rows(gen, kv_format, shape, scale=None):
    """Packed rows as another producer may write them (its own rounding of its own scales): per group a
    random positive scale in [2^-7, 2^-1], codes fp8(N(0, 1) / scale) so the logical latent is about
    N(0, 1); fp8_rope codes use the per-tensor `scale`; the rope random bfloat16. uint8 [*shape, row]."""
    layout = KV_FORMATS[kv_format]
    rows = torch.zeros((*shape, layout.row_bytes), dtype=torch.uint8)
    latent = torch.randn((*shape, LATENT_DIM), generator=gen)
    if layout.per_tensor_scale:
        per_channel = scale.cpu().reshape(()).expand(LATENT_DIM)
    else:
        scales = torch.exp2(-1 - 6 * torch.rand((*shape, 4), generator=gen))
        rows[..., layout.scales_offset : layout.rope_offset] = scales.view(torch.uint8)
        per_channel = scales.repeat_interleave(LATENT_DIM // 4, dim=-1)
    rows[..., :LATENT_DIM] = (latent / per_channel).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    rope = torch.randn((*shape, KEY_DIM - LATENT_DIM), generator=gen).to(torch.bfloat16)
    rows[..., layout.rope_offset :] = rope.view(torch.uint8)
    return rows


def packed_setup(gen, kv_format, rows, page_size, device, padding=0):
    """A batch over `rows` [(cached, new)] and a pool of producer rows; unused pages hold random bytes."""
    batch, num_pages = make_batch(gen, rows, page_size=page_size, padding=padding, device=device)
    scale = tensor_scale(kv_format)
    cache = producer_rows(gen, kv_format, (num_pages, page_size, 1), scale)
    unused = torch.ones(num_pages, dtype=torch.bool)
    for b, (cached, new) in enumerate(rows):
        unused[batch.lookup_table[b, : -(-(cached + new) // page_size)].long().cpu()] = False
    cache[unused] = random_bytes(gen, cache[unused].shape)
    return cache.to(device), None if scale is None else scale.to(device), batch


def logical_keys(gen, num_tokens, dtype=torch.float32, device="cpu"):
    """Keys [T, 1, 576] whose latent groups span scales (a zero group, a large one) and rope values."""
    key = randn(gen, (num_tokens, 1, KEY_DIM), torch.float32)
    key[:, :, 128:256] *= 30.0
    key[:, :, 384:512] *= 1e-3
    if num_tokens > 1:
        key[1, :, :128] = 0  # amax 0: scale 1, codes 0
    return key.to(dtype).to(device)


# ---------------------------------------------------------------------------------------------
# paged_store / paged_load


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("key_dtype", Q_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_store_writes_the_reference_bytes(device, kv_format, key_dtype, page_size):
    gen = generator(seed_from("store", kv_format, key_dtype, page_size))
    rows = [(0, 5), (3, 4), (0, 0), (17, 1)]
    batch, num_pages = make_batch(gen, rows, page_size=page_size, padding=2, device=device)
    cache = random_bytes(gen, (num_pages, page_size, 1, KV_FORMATS[kv_format].row_bytes), device)
    expected = cache.cpu().clone()  # the bytes before the store; the reference writes them on the CPU
    # 0.002 clamps the large latent group of fp8_rope at +-448
    scale = tensor_scale(kv_format, device, 0.002)
    key = logical_keys(gen, batch.num_tokens, key_dtype, device)
    scale_before = None if scale is None else scale.clone()
    pagedkv.paged_store(key, None, cache, None, batch.input_row_offsets, batch.cache_lengths, batch.lookup_table,
                        scale, kv_format=kv_format)
    ref.paged_store(key.cpu(), None, expected, None, batch.input_row_offsets.cpu(), batch.cache_lengths.cpu(),
                    batch.lookup_table.cpu(), None if scale is None else scale.cpu(), kv_format=kv_format)
    assert_bytes_equal(cache.cpu(), expected.cpu(), f"{kv_format} rows")
    if scale is not None:
        assert torch.equal(scale, scale_before), "paged_store must only read fp8_rope's per-tensor scale"


def test_pack_mla_rows_layout():
    """The reference packer against the byte layout written out by hand."""
    gen = generator(3)
    key = logical_keys(gen, 3)
    rows = ref.pack_mla_rows(key, "fp8_ds_mla")
    assert rows.shape == (3, 1, 656) and rows.dtype == torch.uint8
    scales = rows[..., 512:528].contiguous().view(torch.float32)
    amax = key[..., :512].unflatten(-1, (4, 128)).abs().amax(-1)
    assert torch.equal(scales, torch.where(amax == 0, torch.ones_like(amax), amax / 448))
    codes = rows[..., :512].contiguous().view(torch.float8_e4m3fn)
    expected = (key[..., :512] / scales.repeat_interleave(128, -1)).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(rows[..., 528:].contiguous().view(torch.bfloat16), key[..., 512:].to(torch.bfloat16))
    rope_rows = ref.pack_mla_rows(key, "fp8_rope", torch.tensor([0.5]))
    assert rope_rows.shape == (3, 1, 640)
    assert torch.equal(rope_rows[..., :512], (key[..., :512] / 0.5).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(rope_rows[..., 512:], rows[..., 528:])
    unpacked = ref.unpack_mla_rows(rows, "fp8_ds_mla", out_dtype=torch.float32)
    torch.testing.assert_close(unpacked, key, rtol=2**-4, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", Q_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_load_returns_the_reference_logical_keys(device, kv_format, out_dtype):
    gen = generator(seed_from("load", kv_format, out_dtype))
    rows = [(9, 0), (0, 20), (1, 0), (0, 0)]
    cache, scale, batch = packed_setup(gen, kv_format, rows, 4, device)
    before = cache.clone()
    got = pagedkv.paged_load(cache, batch.lookup_table, batch.seq_lens, scale, out_dtype=out_dtype, kv_format=kv_format)
    assert got.shape == (30, 1, KEY_DIM) and got.dtype == out_dtype
    offsets = torch.tensor([0, 9, 29, 30, 30], dtype=torch.int32)
    expected = torch.empty((30, 1, KEY_DIM), dtype=out_dtype)
    ref.paged_load(cache.cpu(), None if scale is None else scale.cpu(), batch.lookup_table.cpu(), batch.seq_lens.cpu(),
                   offsets, expected, kv_format=kv_format)
    assert_bytes_equal(got.cpu(), expected, f"{kv_format} logical keys")
    assert torch.equal(cache, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_load_default_dtype_is_float32(device, kv_format):
    gen = generator(seed_from("load default", kv_format))
    cache, scale, batch = packed_setup(gen, kv_format, [(0, 3)], 2, device)
    got = pagedkv.paged_load(cache, batch.lookup_table, batch.seq_lens, scale, kv_format=kv_format)
    assert got.dtype == torch.float32 and got.shape == (3, 1, KEY_DIM)


# Scales far from what paged_store writes (subnormal to huge): any positive finite float32 is a scale.
EXTREME_SCALES = [1e-40, 1e-30, 3.0e-3, 1.0, 7.5, 1e30]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_any_positive_finite_scale_reads_back(device, kv_format):
    gen = generator(seed_from("extreme", kv_format))
    layout = KV_FORMATS[kv_format]
    scales = torch.tensor(EXTREME_SCALES, dtype=torch.float32)
    num_pages = len(scales)
    cache = random_bytes(gen, (num_pages, 4, 1, layout.row_bytes))
    codes = (torch.randn((num_pages, 4, 1, LATENT_DIM), generator=gen) * 100).to(torch.float8_e4m3fn)
    cache[..., :LATENT_DIM] = codes.view(torch.uint8)
    cache[..., layout.rope_offset :] = torch.randn((num_pages, 4, 1, 64), generator=gen).to(torch.bfloat16).view(
        torch.uint8)
    table = torch.arange(num_pages, dtype=torch.int32).view(num_pages, 1)
    seq_lens = torch.full((num_pages,), 4, dtype=torch.int32)
    offsets = torch.arange(num_pages + 1, dtype=torch.int32) * 4
    if layout.per_tensor_scale:
        results = []
        for s in scales:  # one load per scale: the scale is the whole tensor's
            got = pagedkv.paged_load(cache.to(device), table.to(device), seq_lens.to(device), s.view(1).to(device),
                                     kv_format=kv_format)
            expected = torch.empty_like(got, device="cpu")
            ref.paged_load(cache, s.view(1), table, seq_lens, offsets, expected, kv_format=kv_format)
            results.append((got, expected))
    else:
        scale_bytes = scales.view(num_pages, 1, 1, 1).expand(num_pages, 4, 1, 4).contiguous().view(torch.uint8)
        cache[..., layout.scales_offset : layout.rope_offset] = scale_bytes
        got = pagedkv.paged_load(cache.to(device), table.to(device), seq_lens.to(device), kv_format=kv_format)
        expected = torch.empty_like(got, device="cpu")
        ref.paged_load(cache, None, table, seq_lens, offsets, expected, kv_format=kv_format)
        results = [(got, expected)]
    for got, expected in results:
        assert_bytes_equal(got.cpu(), expected, f"{kv_format} rows with extreme scales")


# ---------------------------------------------------------------------------------------------
# Attention

# name: (rows [(cached, new)], options)
ATTENTION_CASES = {
    "prefill": ([(0, 9), (0, 4)], {}),
    "decode": ([(37, 1), (5, 1), (0, 1), (0, 0)], {}),
    "chunked": ([(21, 6), (2, 3)], {}),
    "not_causal": ([(11, 4), (0, 3)], {"causal": False}),
    "window": ([(21, 6), (0, 9)], {"window_left": 5}),
    "softcap": ([(12, 3), (0, 5)], {"softcap": 15.0}),
    "sinks": ([(12, 3), (0, 1)], {"sinks": True}),
}


def attention_grid():
    """Every case, format and query dtype, with page sizes and query heads taking turns, plus every page
    size and head count on the chunked case."""
    cases, turn = [], 0
    for name in ATTENTION_CASES:
        for kv_format in FORMATS:
            for q_dtype in Q_DTYPES:
                page_size, heads = PAGE_SIZES_MLA[turn % 3], GQA_HEADS[turn % 2]
                cases.append(pytest.param(name, kv_format, q_dtype, page_size, heads,
                                          id=f"{name}-{kv_format}-{dtype_name(q_dtype)}-P{page_size}-H{heads}"))
                turn += 1
    for kv_format in FORMATS:
        for page_size in PAGE_SIZES_MLA:
            for heads in GQA_HEADS:
                cases.append(pytest.param("chunked", kv_format, torch.bfloat16, page_size, heads,
                                          id=f"grid-{kv_format}-P{page_size}-H{heads}"))
    return cases


def attention_call(gen, name, kv_format, q_dtype, page_size, heads, device):
    rows, options = ATTENTION_CASES[name]
    cache, scale, batch = packed_setup(gen, kv_format, rows, page_size, device, padding=1)
    q = randn(gen, (batch.num_tokens, heads, KEY_DIM), q_dtype, device)
    kwargs = {k: v for k, v in options.items() if k != "sinks"}
    if options.get("sinks"):
        kwargs["sinks"] = randn(gen, (heads,), torch.float32, device)
    args = (q, batch.input_row_offsets, cache, None, batch.cache_lengths, batch.lookup_table)
    return args, dict(kwargs, k_scales=scale, kv_format=kv_format)


def reference_lse(args, kwargs):
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    cpu_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return ref.flash_attn_paged_lse(*cpu, **cpu_kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, kv_format, q_dtype, page_size, heads", attention_grid())
def test_attention_matches_reference(device, name, kv_format, q_dtype, page_size, heads):
    gen = generator(seed_from("attention", name, kv_format, q_dtype, page_size, heads))
    args, kwargs = attention_call(gen, name, kv_format, q_dtype, page_size, heads, device)
    before = args[2].clone()
    out = supported_or_skip(device, pagedkv.flash_attn_paged, *args, **kwargs)
    expected, _ = reference_lse(args, kwargs)
    assert out.shape == (args[0].shape[0], heads, LATENT_DIM)
    assert_attention_close(out, expected, q_dtype, f"{name} {kv_format}", q16_on_cuda=True)
    assert torch.equal(args[2], before)


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["chunked", "sinks", "window"])
@pytest.mark.parametrize("kv_format", FORMATS)
def test_lse_and_out_variant(device, name, kv_format):
    gen = generator(seed_from("lse", name, kv_format))
    args, kwargs = attention_call(gen, name, kv_format, torch.float32, 16, 16, device)
    out, lse = supported_or_skip(device, pagedkv.flash_attn_paged_lse, *args, **kwargs)
    expected, expected_lse = reference_lse(args, kwargs)
    assert_attention_close(out, expected, torch.float32, f"lse {name} {kv_format}", q16_on_cuda=True)
    assert_lse_close(lse, expected_lse, torch.float32, f"lse {name} {kv_format}", q16_on_cuda=True)
    buffer = torch.full_like(out, float("nan"))
    assert pagedkv.flash_attn_paged(*args, **kwargs, out=buffer) is buffer
    assert torch.equal(buffer, pagedkv.flash_attn_paged(*args, **kwargs))
    assert_attention_close(buffer, expected, torch.float32, f".out {name} {kv_format}", q16_on_cuda=True)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_default_scale_is_one_over_sqrt_576(kv_format):
    gen = generator(seed_from("scale", kv_format))
    args, kwargs = attention_call(gen, "chunked", kv_format, torch.float32, 16, 16, "cpu")
    out = pagedkv.flash_attn_paged(*args, **kwargs)
    explicit = pagedkv.flash_attn_paged(*args, **kwargs, scale=KEY_DIM**-0.5)
    assert torch.equal(out, explicit)


@pytest.mark.per_isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", Q_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_sparse_matches_reference(device, kv_format, q_dtype):
    gen = generator(seed_from("sparse", kv_format, q_dtype))
    num_pages, page_size, tokens, heads, top_k = 5, 16, 4, 16, 12
    scale = tensor_scale(kv_format)
    cache = producer_rows(gen, kv_format, (num_pages, page_size, 1), scale)
    indices = torch.randint(0, num_pages * page_size, (tokens, 1, top_k), generator=gen, dtype=torch.int32)
    indices[0, 0, 3:7] = -1  # no token
    indices[1, 0, 5] = indices[1, 0, 2]  # a duplicate counts twice
    indices[1, 0, 9] = indices[1, 0, 2]
    indices[2] = -1  # a row with no token: zeros
    q = randn(gen, (tokens, heads, KEY_DIM), q_dtype)
    softcap, sinks = (20.0, randn(gen, (heads,))) if kv_format == "fp8_ds_mla" else (0.0, None)
    expected = ref.flash_attn_paged_sparse(q, cache, None, indices, k_scales=scale, softcap=softcap, sinks=sinks,
                                           kv_format=kv_format)
    on = (lambda t: None if t is None else t.to(device))
    out = supported_or_skip(device, pagedkv.flash_attn_paged_sparse, on(q), on(cache), None, on(indices),
                         k_scales=on(scale), softcap=softcap, sinks=on(sinks), kv_format=kv_format)
    assert out.shape == (tokens, heads, LATENT_DIM)
    assert_attention_close(out, expected, q_dtype, f"sparse {kv_format}")
    assert (out[2] == 0).all()


# ---------------------------------------------------------------------------------------------
# Errors: RuntimeError naming the argument, nothing written


def error_setup(kv_format):
    gen = generator(seed_from("errors", kv_format))
    cache, scale, batch = packed_setup(gen, kv_format, [(3, 4), (0, 2)], 4, "cpu")
    key = logical_keys(gen, batch.num_tokens)
    q = randn(gen, (batch.num_tokens, 16, KEY_DIM))
    return cache, scale, batch, key, q


def store_call(cache, scale, batch, key, change):
    call = dict(key=key, value=None, k_cache=cache, v_cache=None, input_row_offsets=batch.input_row_offsets,
                cache_lengths=batch.cache_lengths, lookup_table=batch.lookup_table, k_scales=scale, v_scales=None)
    call.update(change)
    kv_format = call.pop("kv_format")
    return lambda: pagedkv.paged_store(*call.values(), kv_format=kv_format)


def other_format(kv_format):
    return next(f for f in FORMATS if f != kv_format)


def bad_store_calls(kv_format):
    """(name, argument the message must name, changes to a good call)."""
    layout = KV_FORMATS[kv_format]
    width, other_width = layout.row_bytes, KV_FORMATS[other_format(kv_format)].row_bytes
    scale = torch.tensor([0.5])
    cases = [
        ("unknown format", "kv_format", {"kv_format": "fp8_mla"}),
        ("fp8 dtype", "k_cache", {"k_cache": lambda c: c.view(torch.float8_e4m3fn)}),
        ("other row width", "k_cache", {"k_cache": lambda c: c[..., :other_width] if other_width < width
                                        else torch.cat([c, c[..., : other_width - width]], dim=-1)}),
        ("two heads", "k_cache", {"k_cache": lambda c: c.view(c.shape[0], c.shape[1] // 2, 2, width)}),
        ("a v_cache", "v_cache", {"value": "key", "v_cache": lambda c: c.clone()}),
        ("a value", "value", {"value": "key"}),
        ("v_scales", "v_scales", {"v_scales": scale}),
        ("key of D 512", "key", {"key": lambda k: k[..., :LATENT_DIM]}),
    ]
    if layout.per_tensor_scale:
        cases += [
            ("no k_scales", "k_scales", {"k_scales": None}),
            ("per-token k_scales", "k_scales", {"k_scales": torch.ones(1, 1, 1, 4)}),
            ("float64 k_scales", "k_scales", {"k_scales": torch.tensor([0.5], dtype=torch.float64)}),
        ] + [(f"k_scales {v}", "k_scales", {"k_scales": torch.tensor([v])}) for v in
             (float("nan"), float("inf"), 0.0, -0.5)]
    else:
        cases += [("k_scales", "k_scales", {"k_scales": scale})]
    return cases


def resolve(change, cache, key):
    """Turn the lambdas of a change into tensors (applied to the call's cache or key), "key" into the key."""
    resolved = {}
    for name, value in change.items():
        if isinstance(value, str) and value == "key":
            value = key
        elif callable(value):
            value = value(key if name == "key" else cache)
        resolved[name] = value
    return resolved


@pytest.mark.parametrize("kv_format", FORMATS)
def test_bad_store_calls_name_the_argument_and_write_nothing(kv_format):
    for case, argument, change in bad_store_calls(kv_format):
        cache, scale, batch, key, _ = error_setup(kv_format)
        change = resolve(change, cache, key)
        change.setdefault("kv_format", kv_format)
        written = [t for t in (cache, change.get("k_cache"), change.get("v_cache"), scale, change.get("k_scales"))
                   if isinstance(t, torch.Tensor)]
        before = [t.clone() for t in written]
        with pytest.raises(RuntimeError, match=rf"paged_store: .*\b{argument}\b") as info:
            store_call(cache, scale, batch, key, change)()
        assert argument in str(info.value).split(":", 1)[1][:40], f"{case}: {info.value}"
        for tensor, old in zip(written, before):
            assert torch.equal(tensor.view(torch.uint8), old.view(torch.uint8)), f"{case}: a cache or scale changed"


def bad_reader_calls(kv_format):
    """Changes every reader rejects: (name, argument, changes to a good call)."""
    cases = [(name, argument, change) for name, argument, change in bad_store_calls(kv_format)
             if argument in ("kv_format", "k_cache", "k_scales", "v_scales")]
    return cases + [("a v_cache", "v_cache", {"v_cache": lambda c: c.clone()})]


def reader_call(op, cache, scale, batch, q, change, kv_format):
    """A call of reader `op` over the packed `cache` with `change` applied; returns a thunk."""
    k_cache, k_scales = change.get("k_cache", cache), change.get("k_scales", scale)
    v_cache, v_scales = change.get("v_cache"), change.get("v_scales")
    kv_format = change.get("kv_format", kv_format)
    if op == "paged_load":
        out, offsets = torch.zeros((10, 1, KEY_DIM)), torch.tensor([0, 7, 9], dtype=torch.int32)
        return lambda: torch.ops.pagedkv.paged_load(k_cache, k_scales, batch.lookup_table, batch.seq_lens, offsets,
                                                    out, 128, kv_format)
    if op == "flash_attn_paged_sparse":
        indices = torch.tensor([[[0, 5, -1]]] * q.shape[0], dtype=torch.int32)
        return lambda: pagedkv.flash_attn_paged_sparse(q, k_cache, v_cache, indices, k_scales=k_scales,
                                                       v_scales=v_scales, kv_format=kv_format)
    args = (q, batch.input_row_offsets, k_cache, v_cache, batch.cache_lengths, batch.lookup_table)
    kwargs = dict(k_scales=k_scales, v_scales=v_scales, kv_format=kv_format)
    if op == "flash_attn_paged_lse":
        return lambda: pagedkv.flash_attn_paged_lse(*args, **kwargs)
    if op == "flash_attn_paged.out":
        kwargs["out"] = torch.zeros((q.shape[0], 16, LATENT_DIM))
    return lambda: pagedkv.flash_attn_paged(*args, **kwargs)


# paged_load's names for the arguments (it reads one cache, its `scales`)
LOAD_ARGUMENTS = {"k_cache": "cache", "k_scales": "scales"}


@pytest.mark.parametrize("op", ["paged_load", "flash_attn_paged", "flash_attn_paged_lse", "flash_attn_paged.out",
                                "flash_attn_paged_sparse"])
@pytest.mark.parametrize("kv_format", FORMATS)
def test_bad_reader_calls_name_the_argument(kv_format, op):
    # flash_attn_paged_lse and .out share flash_attn_paged's checks and messages
    prefix = "flash_attn_paged" if op in ("flash_attn_paged_lse", "flash_attn_paged.out") else op
    for case, argument, change in bad_reader_calls(kv_format):
        if op == "paged_load":
            if argument in ("v_cache", "v_scales"):
                continue
            argument = LOAD_ARGUMENTS.get(argument, argument)
        cache, scale, batch, key, q = error_setup(kv_format)
        call = reader_call(op, cache, scale, batch, q, resolve(change, cache, key), kv_format)
        before = cache.clone()
        with pytest.raises(RuntimeError, match=rf"{prefix}: .*\b{argument}\b") as info:
            call()
        assert argument in str(info.value).split(":", 1)[1][:40], f"{op} {case}: {info.value}"
        assert torch.equal(cache, before), f"{op} {case}: the cache changed"


def test_out_must_have_the_latent_width():
    cache, scale, batch, key, q = error_setup("fp8_ds_mla")
    with pytest.raises(RuntimeError, match=r"out.size\(2\) must be 512"):
        pagedkv.flash_attn_paged(q, batch.input_row_offsets, cache, None, batch.cache_lengths, batch.lookup_table,
                                 kv_format="fp8_ds_mla", out=torch.zeros((q.shape[0], 16, KEY_DIM)))


# ---------------------------------------------------------------------------------------------
# Fakes, opcheck


@pytest.mark.parametrize("kv_format", FORMATS)
def test_fakes_give_the_packed_shapes(kv_format):
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache, scale, batch, key, q = error_setup(kv_format)
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(t) for name, t in dict(cache=cache, q=q, key=key,
                                                                 offsets=batch.input_row_offsets,
                                                                 lengths=batch.cache_lengths,
                                                                 table=batch.lookup_table).items()}
        fs = None if scale is None else mode.from_tensor(scale)
        out = torch.ops.pagedkv.flash_attn_paged(fake["q"], fake["offsets"], fake["cache"], None, fake["lengths"],
                                                 fake["table"], k_scales=fs, kv_format=kv_format)
        assert out.shape == (q.shape[0], 16, LATENT_DIM) and out.dtype == q.dtype
        out, lse = torch.ops.pagedkv.flash_attn_paged_lse(fake["q"], fake["offsets"], fake["cache"], None,
                                                          fake["lengths"], fake["table"], k_scales=fs,
                                                          kv_format=kv_format)
        assert out.shape == (q.shape[0], 16, LATENT_DIM) and lse.shape == (q.shape[0], 16)
        indices = mode.from_tensor(torch.zeros((q.shape[0], 1, 3), dtype=torch.int32))
        out = torch.ops.pagedkv.flash_attn_paged_sparse(fake["q"], fake["cache"], None, indices, k_scales=fs,
                                                        kv_format=kv_format)
        assert out.shape == (q.shape[0], 16, LATENT_DIM)
        with pytest.raises(RuntimeError, match="v_cache"):  # no format, no v_cache: no value head size
            torch.ops.pagedkv.flash_attn_paged(fake["q"], fake["offsets"], fake["cache"], None, fake["lengths"],
                                               fake["table"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_format", FORMATS)
def test_opcheck(device, kv_format):
    gen = generator(seed_from("opcheck", kv_format))
    cache, scale, batch = packed_setup(gen, kv_format, [(3, 2), (0, 3)], 4, device)
    key = logical_keys(gen, batch.num_tokens, device=device)
    q = randn(gen, (batch.num_tokens, 16, KEY_DIM), torch.bfloat16, device)
    meta = (batch.input_row_offsets, batch.cache_lengths, batch.lookup_table)
    ops = torch.ops.pagedkv
    torch.library.opcheck(ops.paged_store.default, (key, None, cache, None, *meta, scale),
                          {"kv_format": kv_format})
    out = torch.empty((batch.seq_lens.sum().item(), 1, KEY_DIM), device=device)
    offsets = torch.tensor([0, 5, 8], dtype=torch.int32, device=device)
    torch.library.opcheck(ops.paged_load.default, (cache, scale, batch.lookup_table, batch.seq_lens, offsets, out),
                          {"kv_format": kv_format})
    attention = (q, batch.input_row_offsets, cache, None, batch.cache_lengths, batch.lookup_table)
    kwargs = {"k_scales": scale, "kv_format": kv_format, "softcap": 10.0}
    indices = torch.tensor([[[0, 3, -1, 7]]] * batch.num_tokens, dtype=torch.int32, device=device)
    checks = [
        (ops.flash_attn_paged.default, attention, kwargs),
        (ops.flash_attn_paged_lse.default, attention, kwargs),
        (ops.flash_attn_paged.out, attention,
         dict(kwargs, out=torch.empty((batch.num_tokens, 16, LATENT_DIM), dtype=q.dtype, device=device))),
        (ops.flash_attn_paged_sparse.default, (q, cache, None, indices), {"k_scales": scale, "kv_format": kv_format}),
    ]
    for op, args, op_kwargs in checks:
        supported_or_skip(device, torch.library.opcheck, op, args, op_kwargs)


# ---------------------------------------------------------------------------------------------
# CPU decode paths over packed rows

# one new token per row; the long rows split their keys (split-KV: few items)
DECODE_ROWS = [(1100, 1), (37, 1), (0, 1)]
DECODE_OPTIONS = {"plain": {}, "window": {"window_left": 700}, "softcap": {"softcap": 15.0}, "sinks": {"sinks": True},
                  "lse": {}}


def decode_grid():
    """Each format, query head count (8: the float32 direct products' GQA limit; 16 and, once, 128: the
    dot decode of bf16 q, the tiles for float32 q) and option, page sizes taking turns."""
    cases, turn = [], 0
    for kv_format in FORMATS:
        for heads in [8, 16, 128]:
            for option in DECODE_OPTIONS if heads < 128 else ["plain"]:
                page_size = PAGE_SIZES_MLA[turn % 3]
                turn += 1
                cases.append(pytest.param(kv_format, heads, page_size, option,
                                          id=f"{kv_format}-H{heads}-P{page_size}-{option}"))
    return cases


@pytest.mark.per_isa
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("kv_format, heads, page_size, option", decode_grid())
def test_decode_paths_match_reference(kernel_options, kv_format, heads, page_size, option, q_dtype):
    """Decode over packed rows on every CPU decode path the ISA has, each against the float64 reference:
    cpu_decode "auto" (bf16 q with AVX512-BF16: the dot decode, latent and rope tail in place, up to 128
    query heads; else the float32 direct products up to 8), "fma" (the float32 direct products) and
    "packed" (the converting tiles)."""
    gen = generator(seed_from("decode paths", kv_format, heads, page_size, option, q_dtype))
    cache, scale, batch = packed_setup(gen, kv_format, DECODE_ROWS, page_size, "cpu", padding=1)
    q = randn(gen, (batch.num_tokens, heads, KEY_DIM), q_dtype)
    options = DECODE_OPTIONS[option]
    kwargs = dict({k: v for k, v in options.items() if k != "sinks"}, k_scales=scale, kv_format=kv_format)
    if options.get("sinks"):
        kwargs["sinks"] = randn(gen, (heads,), torch.float32)
    args = (q, batch.input_row_offsets, cache, None, batch.cache_lengths, batch.lookup_table)
    expected, expected_lse = reference_lse(args, kwargs)
    for path in ("auto", "fma", "packed"):
        kernel_options(cpu_decode=path)
        what = f"decode {kv_format} H{heads} P{page_size} {option} cpu_decode={path}"
        if option == "lse":
            out, lse = pagedkv.flash_attn_paged_lse(*args, **kwargs)
            assert_lse_close(lse, expected_lse, q_dtype, what)
        else:
            out = pagedkv.flash_attn_paged(*args, **kwargs)
        assert_attention_close(out, expected, q_dtype, what)


# kv_format values of another type than str: torch's schema parser read bytes as the name (paged_store and
# the attention ops ran; pagedkv.paged_load sized `out` without them and blamed it), and reported a list by
# position, or paged_load raised "unhashable type: 'list'". Every wrapper now reads kv_format once
# (kv_formats.kv_format_row) and refuses another type, naming kv_format and the type.
OTHER_TYPES = [["fp8_ds_mla"], b"fp8_ds_mla", bytearray(b"fp8_rope"), 1, ("fp8_rope",)]
WRAPPERS = ["paged_store", "paged_load", "flash_attn_paged", "flash_attn_paged_lse", "flash_attn_paged_sparse",
            "cascade_attention"]


def wrapper_call(op, cache, scale, batch, key, q, kv_format):
    """A call of the Python wrapper `op` over the packed cache; returns a thunk."""
    if op == "paged_store":
        return lambda: pagedkv.paged_store(key, None, cache, None, batch.input_row_offsets, batch.cache_lengths,
                                           batch.lookup_table, scale, kv_format=kv_format)
    if op == "paged_load":
        return lambda: pagedkv.paged_load(cache, batch.lookup_table, batch.seq_lens, scales=scale,
                                          kv_format=kv_format)
    if op == "flash_attn_paged_sparse":
        indices = torch.tensor([[[0, 5, -1]]] * q.shape[0], dtype=torch.int32)
        return lambda: pagedkv.flash_attn_paged_sparse(q, cache, None, indices, k_scales=scale, kv_format=kv_format)
    args = (q, batch.input_row_offsets, cache, None, batch.cache_lengths, batch.lookup_table)
    if op == "cascade_attention":
        return lambda: pagedkv.cascade_attention(*args, 1, k_scales=scale, kv_format=kv_format)
    return lambda: getattr(pagedkv, op)(*args, k_scales=scale, kv_format=kv_format)


@pytest.mark.parametrize("op", WRAPPERS)
@pytest.mark.parametrize("value", OTHER_TYPES, ids=lambda v: type(v).__name__)
def test_kv_format_of_another_type_is_refused_by_name(op, value):
    cache, scale, batch, key, q = error_setup("fp8_ds_mla")
    before = cache.clone()
    named = "flash_attn_paged" if op == "flash_attn_paged_lse" else op  # the core's name for both
    with pytest.raises(TypeError, match=rf"^{named}: kv_format must be None, 'fp8_ds_mla' or 'fp8_rope' \(a str\), "
                                        rf"got {type(value).__name__} "):
        wrapper_call(op, cache, scale, batch, key, q, value)()
    assert torch.equal(cache, before)
    with pytest.raises(TypeError, match=r"^kv_format must be None, 'fp8_ds_mla' or 'fp8_rope' \(a str\)"):
        pagedkv.PagedMLACache(4, 4, kv_format=value)


@pytest.mark.parametrize("op", WRAPPERS[:-1])  # the cascade's batch would need a shared prefix first
def test_an_unknown_kv_format_name_is_refused_by_the_op(op):
    """A str naming no format reaches the op, which names kv_format (paged_load's convenience sizes its
    output as a plain cache's for it and is refused the same way, not for `out`)."""
    cache, scale, batch, key, q = error_setup("fp8_ds_mla")
    before = cache.clone()
    with pytest.raises(RuntimeError, match=r": kv_format must be None, 'fp8_ds_mla' or 'fp8_rope', got 'fp8_mla'"):
        wrapper_call(op, cache, scale, batch, key, q, "fp8_mla")()
    assert torch.equal(cache, before)
