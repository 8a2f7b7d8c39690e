"""Every error of CONTRACT.md: a RuntimeError naming the argument, and nothing written.

Each case starts from a valid call, breaks one thing, and checks that the op raises a RuntimeError
whose message contains the offending argument's name, and that every tensor argument (caches,
scales, out, inputs) and every cache storage is bit-identical afterwards.
"""

from __future__ import annotations

import pytest
import torch

import pagedkv
from conftest import DEVICES, as_bytes, fill_history, generator, make_setup, randn, seed_from

D, G, HK, P = 32, 16, 2, 4
ROWS = [(3, 4), (0, 2)]  # B = 2, offsets [0, 4, 6]


def setup_call(device, dtype, layout="collection", k_only=False):
    gen = generator(seed_from("errors", str(dtype), layout))
    kv, batch = make_setup(gen, ROWS, layout=layout, page_size=P, num_kv_heads=HK, head_dim=D,
                           dtype=dtype, quant_group=G, k_only=k_only, padding=1, device=device)
    fill_history(gen, kv, batch)
    return gen, kv, batch


def store_call(device, dtype=torch.float8_e4m3fn, k_only=False):
    gen, kv, batch = setup_call(device, dtype, k_only=k_only)
    k, v, ks, vs = kv.views
    args = dict(
        key=randn(gen, (batch.num_tokens, HK, D), torch.float32, device),
        value=None if k_only else randn(gen, (batch.num_tokens, HK, D), torch.float32, device),
        k_cache=k, v_cache=v, input_row_offsets=batch.input_row_offsets,
        cache_lengths=batch.cache_lengths, lookup_table=batch.lookup_table, k_scales=ks,
        v_scales=vs, quant_group=G,
    )
    return kv, args


def load_call(device, dtype=torch.float8_e4m3fn):
    gen, kv, batch = setup_call(device, dtype)
    seq_lens = batch.seq_lens  # [7, 2]
    args = dict(
        cache=kv.k_cache, scales=kv.k_scales, lookup_table=batch.lookup_table, seq_lens=seq_lens,
        output_row_offsets=torch.tensor([0, 7, 9], dtype=torch.int32, device=device),
        out=torch.zeros((10, HK, D), device=device), quant_group=G,
    )
    return kv, args


def attn_call(device, dtype=torch.float8_e4m3fn):
    gen, kv, batch = setup_call(device, dtype)
    args = dict(
        q=randn(gen, (batch.num_tokens, 2 * HK, D), torch.float32, device),
        input_row_offsets=batch.input_row_offsets, k_cache=kv.k_cache, v_cache=kv.v_cache,
        cache_lengths=batch.cache_lengths, lookup_table=batch.lookup_table, scale=None,
        causal=True, k_scales=kv.k_scales, v_scales=kv.v_scales, quant_group=G, window_left=-1,
        softcap=0.0,
    )
    return kv, args


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def strided_last(t):
    """Same values, stride(-1) == 2."""
    wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def set_(name, fn):
    def mutate(args, kv):
        args[name] = fn(args[name], args)

    return mutate


# Common index-tensor errors, shared by the three ops (index names differ for paged_load).
def index_errors(offsets, lengths, rows_source):
    return [
        (f"{offsets} int64", set_(offsets, lambda t, a: t.long()), [offsets], ["int32"]),
        (f"{lengths} int64", set_(lengths, lambda t, a: t.long()), [lengths], ["int32"]),
        ("lookup_table int64", set_("lookup_table", lambda t, a: t.long()), ["lookup_table"],
         ["int32"]),
        ("lookup_table uint8", set_("lookup_table", lambda t, a: t.to(torch.uint8)),
         ["lookup_table"], ["int32"]),
        ("lookup_table float", set_("lookup_table", lambda t, a: t.float()), ["lookup_table"], []),
        ("lookup_table 1-D", set_("lookup_table", lambda t, a: t[0]), ["lookup_table"], []),
        ("lookup_table 3-D", set_("lookup_table", lambda t, a: t[None]), ["lookup_table"], []),
        ("lookup_table rows != B", set_("lookup_table", lambda t, a: t[:1]), ["lookup_table"], []),
        (f"{lengths} 2-D", set_(lengths, lambda t, a: t[None]), [lengths], []),
        (f"{offsets} length B", set_(offsets, lambda t, a: t[:-1]), [offsets], []),
        (f"{offsets} 2-D", set_(offsets, lambda t, a: t[None]), [offsets], []),
        ("page id == N", set_("lookup_table", lambda t, a: _with(t, (0, 0), a[rows_source].shape[0])),
         ["lookup_table"], []),
        ("page id negative", set_("lookup_table", lambda t, a: _with(t, (1, 0), -1)),
         ["lookup_table"], []),
        ("page id INT32_MIN", set_("lookup_table", lambda t, a: _with(t, (0, 1), -(2**31))),
         ["lookup_table"], []),
        (f"{offsets}[0] != 0", set_(offsets, lambda t, a: _with(t, (0,), 1)), [offsets], []),
        (f"{offsets} decreasing", set_(offsets, lambda t, a: _with(t, (1,), t[2] + 1)),
         [offsets], []),
    ]


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


STORE_ERRORS = index_errors("input_row_offsets", "cache_lengths", "k_cache") + [
    ("cache_lengths negative", set_("cache_lengths", lambda t, a: _with(t, (1,), -1)),
     ["cache_lengths"], []),
    ("length past max_pages*P", set_("cache_lengths", lambda t, a: _with(t, (0,), 9)),
     ["cache_lengths", "lookup_table"], []),
    ("T < offsets[B]", lambda a, kv: a.update(key=a["key"][:5], value=a["value"][:5]),
     ["input_row_offsets"], []),
    ("duplicate slot", set_("lookup_table", lambda t, a: _with(t, (1, 0), int(t[0, 1]))),
     ["lookup_table"], []),
    ("key 2-D", set_("key", lambda t, a: t[:, 0]), ["key"], []),
    ("key float64", set_("key", lambda t, a: t.double()), ["key"], []),
    ("key int32", set_("key", lambda t, a: t.int()), ["key"], []),
    ("key fp8", set_("key", lambda t, a: t.to(torch.float8_e4m3fn)), ["key"], []),
    ("key Hk mismatch", set_("key", lambda t, a: t[:, :1]), ["key"], []),
    ("key D mismatch", set_("key", lambda t, a: t[..., :16]), ["key"], []),
    ("key stride(-1) != 1", set_("key", lambda t, a: strided_last(t)), ["key"], []),
    ("value T mismatch", set_("value", lambda t, a: t[:-1]), ["value"], []),
    ("value Dv mismatch", set_("value", lambda t, a: t[..., :16]), ["value"], []),
    ("value stride(-1) != 1", set_("value", lambda t, a: strided_last(t)), ["value"], []),
    ("value dtype", set_("value", lambda t, a: t.to(torch.int64)), ["value"], []),
    ("value None, v_cache set", set_("value", lambda t, a: None), ["value"], []),
    ("v_cache None, value set", set_("v_cache", lambda t, a: None), ["v_cache", "value"], []),
    ("k_cache 3-D", set_("k_cache", lambda t, a: t[0]), ["k_cache"], []),
    ("k_cache int8", set_("k_cache", lambda t, a: torch.zeros(t.shape, dtype=torch.int8,
                                                              device=t.device)), ["k_cache"], []),
    ("k_cache float64", set_("k_cache", lambda t, a: torch.zeros(t.shape, dtype=torch.float64,
                                                                 device=t.device)), ["k_cache"], []),
    ("k_cache stride(-1) != 1", set_("k_cache", lambda t, a: strided_last(t)), ["k_cache"], []),
    ("k_cache broadcast page", set_("k_cache", lambda t, a: t[:1].expand(t.shape)), ["k_cache"],
     []),
    ("v_cache N mismatch", set_("v_cache", lambda t, a: t[:-1]), ["v_cache"], []),
    ("v_cache P mismatch", set_("v_cache", lambda t, a: t[:, :-1]), ["v_cache"], []),
    ("v_cache Hk mismatch", set_("v_cache", lambda t, a: t[:, :, :1]), ["v_cache", "value"], []),
    ("k_scales missing", set_("k_scales", lambda t, a: None), ["k_scales"], []),
    ("v_scales missing", set_("v_scales", lambda t, a: None), ["v_scales"], []),
    ("k_scales float16", set_("k_scales", lambda t, a: t.half()), ["k_scales"], ["float32"]),
    ("k_scales groups", set_("k_scales", lambda t, a: t[..., :1]), ["k_scales"], []),
    ("k_scales N", set_("k_scales", lambda t, a: t[:-1]), ["k_scales"], []),
    ("v_scales Hk", set_("v_scales", lambda t, a: t[:, :, :1]), ["v_scales"], []),
    ("k_scales stride(-1) != 1", set_("k_scales", lambda t, a: strided_last(t)), ["k_scales"], []),
    ("quant_group 0", set_("quant_group", lambda t, a: 0), ["quant_group"], []),
    ("quant_group -8", set_("quant_group", lambda t, a: -8), ["quant_group"], []),
    ("quant_group vs scales", set_("quant_group", lambda t, a: 8), ["k_scales", "quant_group"], []),
]

STORE_FLOAT_ERRORS = [
    ("k_scales for float cache", None, ["k_scales"], []),
    ("v_scales for float cache", None, ["v_scales"], []),
]

LOAD_ERRORS = index_errors("output_row_offsets", "seq_lens", "cache") + [
    ("seq_lens negative", set_("seq_lens", lambda t, a: _with(t, (1,), -1)), ["seq_lens"], []),
    ("seq_lens past max_pages*P", set_("seq_lens", lambda t, a: _with(t, (1,), 13)),
     ["seq_lens", "lookup_table", "output_row_offsets"], []),
    ("seq_lens past its output rows", set_("seq_lens", lambda t, a: _with(t, (0,), 8)),
     ["seq_lens", "output_row_offsets"], []),
    ("offsets[B] > out rows", set_("out", lambda t, a: t[:8]), ["output_row_offsets", "out"], []),
    ("out fp8", set_("out", lambda t, a: t.to(torch.float8_e4m3fn)), ["out"], []),
    ("out float64", set_("out", lambda t, a: t.double()), ["out"], []),
    ("out 2-D", set_("out", lambda t, a: t[:, 0]), ["out"], []),
    ("out Hk mismatch", set_("out", lambda t, a: t[:, :1]), ["out"], []),
    ("out D mismatch", set_("out", lambda t, a: t[..., :16]), ["out"], []),
    ("out stride(-1) != 1", set_("out", lambda t, a: strided_last(t)), ["out"], []),
    ("cache 3-D", set_("cache", lambda t, a: t[0]), ["cache"], []),
    ("cache stride(-1) != 1", set_("cache", lambda t, a: strided_last(t)), ["cache"], []),
    ("cache int32", set_("cache", lambda t, a: torch.zeros(t.shape, dtype=torch.int32,
                                                           device=t.device)), ["cache"], []),
    ("scales missing", set_("scales", lambda t, a: None), ["scales"], []),
    ("scales groups", set_("scales", lambda t, a: t[..., :1]), ["scales"], []),
    ("scales float64", set_("scales", lambda t, a: t.double()), ["scales"], []),
    ("quant_group 0", set_("quant_group", lambda t, a: 0), ["quant_group"], []),
]

ATTN_ERRORS = index_errors("input_row_offsets", "cache_lengths", "k_cache") + [
    ("cache_lengths negative", set_("cache_lengths", lambda t, a: _with(t, (1,), -1)),
     ["cache_lengths"], []),
    ("length past max_pages*P", set_("cache_lengths", lambda t, a: _with(t, (0,), 9)),
     ["cache_lengths", "lookup_table"], []),
    ("T < offsets[B]", set_("q", lambda t, a: t[:5]), ["input_row_offsets", "q"], []),
    ("q 2-D", set_("q", lambda t, a: t[:, 0]), ["q"], []),
    ("q float64", set_("q", lambda t, a: t.double()), ["q"], []),
    ("q int64", set_("q", lambda t, a: t.long()), ["q"], []),
    ("q fp8", set_("q", lambda t, a: t.to(torch.float8_e5m2)), ["q"], []),
    ("q head size", set_("q", lambda t, a: t[..., :16]), ["q"], []),
    ("Hq % Hk != 0", set_("q", lambda t, a: t[:, :3]), ["q"], []),
    ("q stride(-1) != 1", set_("q", lambda t, a: strided_last(t)), ["q"], []),
    ("k_cache 5-D", set_("k_cache", lambda t, a: t[None]), ["k_cache"], []),
    ("k_cache stride(-1) != 1", set_("k_cache", lambda t, a: strided_last(t)), ["k_cache"], []),
    ("v_cache stride(-1) != 1", set_("v_cache", lambda t, a: strided_last(t)), ["v_cache"], []),
    ("v_cache N mismatch", set_("v_cache", lambda t, a: t[:-1]), ["v_cache"], []),
    ("v_cache Hk mismatch", set_("v_cache", lambda t, a: t[:, :, :1]), ["v_cache"], []),
    ("v_cache dtype", set_("v_cache", lambda t, a: torch.zeros(t.shape, dtype=torch.int16,
                                                               device=t.device)), ["v_cache"], []),
    ("k_scales missing", set_("k_scales", lambda t, a: None), ["k_scales"], []),
    ("v_scales missing", set_("v_scales", lambda t, a: None), ["v_scales"], []),
    ("k_scales groups", set_("k_scales", lambda t, a: t[..., :1]), ["k_scales"], []),
    ("v_scales P", set_("v_scales", lambda t, a: t[:, :1]), ["v_scales"], []),
    ("quant_group 0", set_("quant_group", lambda t, a: 0), ["quant_group"], []),
    ("window_left -2", set_("window_left", lambda t, a: -2), ["window_left"], []),
    ("softcap negative", set_("softcap", lambda t, a: -1.0), ["softcap"], []),
    ("softcap nan", set_("softcap", lambda t, a: float("nan")), ["softcap"], []),
    ("scale nan", set_("scale", lambda t, a: float("nan")), ["scale"], []),
    ("scale inf", set_("scale", lambda t, a: float("inf")), ["scale"], []),
]

ATTN_OUT_ERRORS = [
    ("out dtype", lambda args: torch.zeros((7, 4, D), dtype=torch.float16), ["out"]),
    ("out tokens", lambda args: torch.zeros((6, 4, D)), ["out"]),
    ("out heads", lambda args: torch.zeros((7, 2, D)), ["out"]),
    ("out head size", lambda args: torch.zeros((7, 4, 16)), ["out"]),
    ("out stride(-1) != 1", lambda args: strided_last(torch.zeros((7, 4, D))), ["out"]),
    ("out 2-D", lambda args: torch.zeros((7, 4 * D)), ["out"]),
]


def ids(cases):
    return [c[0] for c in cases]


def snapshot(kv, args):
    tensors = {f"base {n}": t for n, t in kv.bases.items()}
    tensors.update({n: t for n, t in args.items() if isinstance(t, torch.Tensor)})
    return {n: (t, as_bytes(t).clone()) for n, t in tensors.items()}


def assert_unchanged(saved):
    for name, (tensor, data) in saved.items():
        assert torch.equal(as_bytes(tensor), data), f"{name} changed after a rejected call"


def expect_error(op, kv, args, names, fragments=()):
    saved = snapshot(kv, args)
    with pytest.raises(RuntimeError) as info:
        op(**args)
    message = str(info.value)
    assert any(name in message for name in names), (
        f"message does not name any of {names}: {message!r}"
    )
    for fragment in fragments:
        assert fragment in message, f"message lacks {fragment!r}: {message!r}"
    assert_unchanged(saved)
    return message


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", STORE_ERRORS, ids=ids(STORE_ERRORS))
def test_paged_store_errors(device, case):
    _, mutate, names, fragments = case
    kv, args = store_call(device)
    mutate(args, kv)
    expect_error(torch.ops.pagedkv.paged_store, kv, args, names, fragments)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", STORE_FLOAT_ERRORS, ids=ids(STORE_FLOAT_ERRORS))
def test_paged_store_extra_scales(device, case):
    name, _, names, _ = case
    kv, args = store_call(device, torch.bfloat16)
    groups = -(-D // G)
    scales = torch.ones((kv.num_pages, P, HK, groups), device=device)
    args["k_scales" if name.startswith("k_") else "v_scales"] = scales
    expect_error(torch.ops.pagedkv.paged_store, kv, args, names)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_k_only_errors(device):
    kv, args = store_call(device, k_only=True)
    args["value"] = torch.zeros_like(args["key"])
    expect_error(torch.ops.pagedkv.paged_store, kv, args, ["value", "v_cache"])
    kv, args = store_call(device, k_only=True)
    args["v_scales"] = args["k_scales"]
    expect_error(torch.ops.pagedkv.paged_store, kv, args, ["v_scales"])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_store_python_wrapper_errors(device):
    kv, args = store_call(device)
    args["lookup_table"] = args["lookup_table"].long()
    expect_error(pagedkv.paged_store, kv, args, ["lookup_table"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", LOAD_ERRORS, ids=ids(LOAD_ERRORS))
def test_paged_load_errors(device, case):
    _, mutate, names, fragments = case
    kv, args = load_call(device)
    mutate(args, kv)
    expect_error(torch.ops.pagedkv.paged_load, kv, args, names, fragments)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_load_extra_scales(device):
    kv, args = load_call(device, torch.float16)
    args["scales"] = torch.ones((kv.num_pages, P, HK, 2), device=device)
    expect_error(torch.ops.pagedkv.paged_load, kv, args, ["scales"])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_load_python_wrapper_errors(device):
    kv, args = load_call(device)
    with pytest.raises((TypeError, ValueError, RuntimeError), match="seq_lens"):
        pagedkv.paged_load(args["cache"], args["lookup_table"], args["seq_lens"].long(),
                           scales=args["scales"], quant_group=G)
    with pytest.raises(RuntimeError, match="lookup_table"):
        pagedkv.paged_load(args["cache"], args["lookup_table"].long(), args["seq_lens"],
                           scales=args["scales"], quant_group=G)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_ERRORS, ids=ids(ATTN_ERRORS))
def test_flash_attn_paged_errors(device, case):
    _, mutate, names, fragments = case
    kv, args = attn_call(device)
    mutate(args, kv)
    expect_error(torch.ops.pagedkv.flash_attn_paged, kv, args, names, fragments)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_paged_extra_scales(device):
    kv, args = attn_call(device, torch.float32)
    args["k_scales"] = torch.ones((kv.num_pages, P, HK, 2), device=device)
    expect_error(torch.ops.pagedkv.flash_attn_paged, kv, args, ["k_scales"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ATTN_OUT_ERRORS, ids=ids(ATTN_OUT_ERRORS))
def test_flash_attn_paged_out_errors(device, case):
    _, make_out, names = case
    kv, args = attn_call(device)
    args["out"] = make_out(args).to(device)
    expect_error(torch.ops.pagedkv.flash_attn_paged.out, kv, args, names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("moved", ["lookup_table", "cache_lengths", "input_row_offsets", "key",
                                   "k_scales", "v_cache"])
def test_paged_store_mixed_devices(moved):
    kv, args = store_call("cuda")
    args[moved] = args[moved].cpu()
    expect_error(torch.ops.pagedkv.paged_store, kv, args, [moved, "device"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("moved", ["lookup_table", "seq_lens", "output_row_offsets", "out",
                                   "scales"])
def test_paged_load_mixed_devices(moved):
    kv, args = load_call("cuda")
    args[moved] = args[moved].cpu()
    expect_error(torch.ops.pagedkv.paged_load, kv, args, [moved, "device"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("moved", ["q", "lookup_table", "cache_lengths", "input_row_offsets",
                                   "v_cache", "v_scales"])
def test_flash_attn_paged_mixed_devices(moved):
    kv, args = attn_call("cuda")
    args[moved] = args[moved].cpu()
    expect_error(torch.ops.pagedkv.flash_attn_paged, kv, args, [moved, "device"])
