"""Error-case machinery of the op tests (tests/ops/test_<op>.py): every error of CONTRACT.md is a
RuntimeError naming the argument, and nothing is written.

Each case starts from a valid call, breaks one thing, and checks that the op raises a RuntimeError
whose message contains the offending argument's name, and that every tensor argument (caches,
scales, out, inputs) and every cache storage is bit-identical afterwards. A case is
`(id, mutate(args, kv), names the message may name, fragments it must contain)`.
"""

from __future__ import annotations

import pytest
import torch

from conftest import as_bytes, fill_history, generator, index_value_checks, make_setup, seed_from

D, G, HK, P = 32, 16, 2, 4
ROWS = [(3, 4), (0, 2)]  # B = 2, offsets [0, 4, 6]


def setup_call(device, dtype, layout="collection", k_only=False):
    gen = generator(seed_from("errors", str(dtype), layout))
    kv, batch = make_setup(gen, ROWS, layout=layout, page_size=P, num_kv_heads=HK, head_dim=D,
                           dtype=dtype, quant_group=G, k_only=k_only, padding=1, device=device)
    fill_history(gen, kv, batch)
    return gen, kv, batch


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


def ids(cases):
    return [c[0] for c in cases]


def snapshot(kv, args):
    tensors = {f"base {n}": t for n, t in kv.bases.items()}
    tensors.update({n: t for n, t in args.items() if isinstance(t, torch.Tensor)})
    return {n: (t, as_bytes(t).clone()) for n, t in tensors.items()}


def assert_unchanged(saved):
    for name, (tensor, data) in saved.items():
        assert torch.equal(as_bytes(tensor), data), f"{name} changed after a rejected call"


def expect_error(device, op, kv, args, names, fragments=()):
    saved = snapshot(kv, args)
    with pytest.raises(RuntimeError) as info, index_value_checks(device):
        op(**args)
    message = str(info.value)
    assert any(name in message for name in names), (
        f"message does not name any of {names}: {message!r}"
    )
    for fragment in fragments:
        assert fragment in message, f"message lacks {fragment!r}: {message!r}"
    assert_unchanged(saved)
    return message
