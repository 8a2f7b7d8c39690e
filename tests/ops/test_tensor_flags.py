"""What torch tracks beside a tensor's memory, at the ops' boundary (csrc/torch/dispatch_keys.cpp):
autograd, version counters, the negative bit; and the Python wrappers' scalar arguments.

- pagedkv's ops have no backward. torch's default for such an op only warned at backward and left
  q.grad None (a silent wrong gradient). Now an attention output from an input that requires grad
  raises at backward, naming the op and the input; an op that writes into its arguments refuses a
  tensor that requires grad under grad mode (its results bypass autograd). A forward-mode tangent
  (torch.func.jvp) was dropped (a zero derivative); refused at the call.
- A written tensor's version counter is bumped, so a tensor saved for another op's backward and then
  overwritten by paged_store makes that backward fail instead of using the new values.
- A written argument that is a negative view (torch._neg_view) aborted the interpreter inside torch's
  fallback; it is refused by name. Read arguments with the bit are resolved (their values used).
- Python's bool is an int: window_left=True was a window of one key; causal=None meant non-causal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedkv
from pagedkv import reference as ref

N, P, HK, HQ, D = 6, 4, 2, 4, 8


def _call():
    """A small valid step: caches, index tensors, this step's key/value and queries."""
    gen = torch.Generator().manual_seed(5)
    c = dict(
        k=torch.zeros(N, P, HK, D), v=torch.zeros(N, P, HK, D),
        table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        lens=torch.tensor([0, 2], dtype=torch.int32), offs=torch.tensor([0, 3, 5], dtype=torch.int32),
        key=torch.randn(5, HK, D, generator=gen), val=torch.randn(5, HK, D, generator=gen),
        q=torch.randn(5, HQ, D, generator=gen),
    )
    return c


def _store(c, **override):
    a = {**c, **override}
    pagedkv.paged_store(a["key"], a["val"], a["k"], a["v"], a["offs"], a["lens"], a["table"])


def _attend(c, **override):
    a = {**c, **override}
    return pagedkv.flash_attn_paged(a["q"], a["offs"], a["k"], a["v"], a["lens"], a["table"])


# ---- autograd ----


def test_attention_backward_raises_naming_the_op_and_input():
    c = _call()
    _store(c)
    q = c["q"].clone().requires_grad_()
    out = _attend(c, q=q)  # the forward works in grad mode (inference without no_grad)
    with pytest.raises(RuntimeError, match="flash_attn_paged has no backward.*q requires grad"):
        out.sum().backward()
    k = c["k"].clone().requires_grad_()
    out, lse = pagedkv.flash_attn_paged_lse(c["q"], c["offs"], k, c["v"], c["lens"], c["table"])
    with pytest.raises(RuntimeError, match="flash_attn_paged_lse has no backward.*k_cache requires grad"):
        lse.sum().backward()
    out_a = out.detach().requires_grad_()
    merged, _ = pagedkv.merge_attn_states(out_a, lse.detach(), out.detach(), lse.detach())
    with pytest.raises(RuntimeError, match="merge_attn_states has no backward.*out_a requires grad"):
        merged.sum().backward()
    indices = torch.zeros(5, 1, 2, dtype=torch.int32)
    out = pagedkv.flash_attn_paged_sparse(q, c["k"], c["v"], indices)
    with pytest.raises(RuntimeError, match="flash_attn_paged_sparse has no backward.*q requires grad"):
        out.sum().backward()


def test_outputs_without_grad_inputs_do_not_require_grad():
    c = _call()
    _store(c)
    assert not _attend(c).requires_grad
    with torch.no_grad():
        assert not _attend(c, q=c["q"].clone().requires_grad_()).requires_grad


@pytest.mark.parametrize("which", ["key", "k", "v"])
def test_store_refuses_tensors_requiring_grad_under_grad_mode(which):
    c = _call()
    before = c["k"].clone(), c["v"].clone()
    t = c[which].clone().requires_grad_()
    name = {"key": "key", "k": "k_cache", "v": "v_cache"}[which]
    with pytest.raises(RuntimeError, match=f"paged_store: {name} requires grad.*no backward"):
        _store(c, **{which: t})
    assert torch.equal(c["k"], before[0]) and torch.equal(c["v"], before[1])
    with torch.no_grad():  # allowed: nothing to track
        _store(c, **{which: t})


def test_load_and_out_refuse_tensors_requiring_grad_under_grad_mode():
    c = _call()
    _store(c)
    k = c["k"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="paged_load: cache requires grad"):
        pagedkv.paged_load(k, c["table"], c["lens"] + 1)
    out = torch.zeros(5, HQ, D, requires_grad=True)
    with pytest.raises(RuntimeError, match="flash_attn_paged: out requires grad"):
        pagedkv.flash_attn_paged(c["q"], c["offs"], c["k"], c["v"], c["lens"], c["table"], out=out)
    pool = torch.zeros(N, 8, requires_grad=True)
    one, two = torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="copy_pages: pool requires grad"):
        torch.ops.pagedkv.copy_pages(pool, one, two)


def test_forward_mode_tangents_are_refused_by_name():
    import torch.autograd.forward_ad as fwad

    c = _call()
    _store(c)
    with pytest.raises(RuntimeError, match="flash_attn_paged: q has a forward-mode tangent"):
        torch.func.jvp(lambda q: _attend(c, q=q), (c["q"],), (torch.ones_like(c["q"]),))  # returned zeros
    before = c["k"].clone()
    with fwad.dual_level(), torch.no_grad():
        key = fwad.make_dual(c["key"], torch.ones_like(c["key"]))
        with pytest.raises(RuntimeError, match="paged_store: key has a forward-mode tangent"):
            _store(c, key=key)
    assert torch.equal(c["k"], before)


# ---- version counters ----


def test_written_tensors_bump_their_version():
    c = _call()
    w = torch.ones(1, requires_grad=True)
    saved = (c["k"] * w).sum()  # saves the (all-zero) k_cache for w's gradient
    _store(c)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()  # used the stored values before: w.grad was their sum, not 0
    layer = torch.zeros(N, 2, P, HK, D)  # collection-style views: the base's counter moves too
    version = layer._version
    _store(c, k=layer[:, 0], v=layer[:, 1])
    assert layer._version > version
    out = torch.zeros(5, HQ, D)
    pagedkv.flash_attn_paged(c["q"], c["offs"], layer[:, 0], layer[:, 1], c["lens"], c["table"], out=out)
    assert out._version > 0
    loaded = torch.zeros(7, HK, D)
    torch.ops.pagedkv.paged_load(c["k"], None, c["table"], c["lens"] + 1, torch.tensor([0, 1, 4], dtype=torch.int32),
                                 loaded)
    assert loaded._version > 0


def test_inference_tensors_are_still_written():
    # inference tensors have no version counter; writing them outside inference mode stays allowed
    with torch.inference_mode():
        c = _call()
    _store(c)
    expected = _call()
    ref.paged_store(expected["key"], expected["val"], expected["k"], expected["v"], expected["offs"],
                    expected["lens"], expected["table"])
    assert torch.equal(c["k"], expected["k"]) and torch.equal(c["v"], expected["v"])
    with torch.inference_mode():
        _store(_call())


# ---- negative views ----


def test_negative_views_read_by_value_and_refused_when_written():
    # in a subprocess: before the fix, a written negative view aborted the interpreter
    script = textwrap.dedent(
        """
        import torch, pagedkv
        N, P, HK, HQ, D = 6, 4, 2, 4, 8
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        lens, offs = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
        key, val, q = torch.randn(5, HK, D), torch.randn(5, HK, D), torch.randn(5, HQ, D)
        k, v = torch.zeros(N, P, HK, D), torch.zeros(N, P, HK, D)
        # read arguments: their values (-x) are used
        pagedkv.paged_store(torch._neg_view(-key), val, k, v, offs, lens, table)
        k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
        pagedkv.paged_store(key, val, k2, v2, offs, lens, table)
        assert torch.equal(k, k2) and torch.equal(v, v2)
        out = pagedkv.flash_attn_paged(torch._neg_view(-q), offs, torch._neg_view(-k), v, lens, table)
        assert torch.equal(out, pagedkv.flash_attn_paged(q, offs, k, v, lens, table))
        # written arguments: refused by name, nothing written
        i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
        calls = {
            "k_cache": lambda: pagedkv.paged_store(key, val, torch._neg_view(k), v, offs, lens, table),
            "v_cache": lambda: pagedkv.paged_store(key, val, k, torch._neg_view(v), offs, lens, table),
            "k_scales": lambda: pagedkv.paged_store(key, None, torch.zeros(N, P, HK, D, dtype=torch.float8_e4m3fn),
                                                    None, offs, lens, table, torch._neg_view(torch.ones(N, P, HK, 1))),
            "out": lambda: torch.ops.pagedkv.paged_load(k, None, table, lens, i32(0, 0, 2),
                                                        torch._neg_view(torch.zeros(2, HK, D))),
            "out=": lambda: pagedkv.flash_attn_paged(q, offs, k, v, lens, table,
                                                     out=torch._neg_view(torch.zeros(5, HQ, D))),
            "pool": lambda: torch.ops.pagedkv.copy_pages(torch._neg_view(k), i32(0), i32(5)),
        }
        before = k.clone(), v.clone()
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as e:
                assert name.rstrip("=") + " must not be a negative view" in str(e), str(e)
            else:
                raise AssertionError(name + " accepted")
        assert torch.equal(k, before[0]) and torch.equal(v, before[1])
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


# ---- Python scalars in the wrappers ----


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window_left": True}, "window_left must be an int, got True"),
        ({"window_left": False}, "window_left must be an int, got False"),
        ({"quant_group": True}, "quant_group must be an int, got True"),
        ({"softcap": True}, "softcap must be a float, got True"),
        ({"scale": True}, "scale must be a float, got True"),
        ({"causal": None}, "causal must be True or False, got None"),
        ({"causal": 2}, "causal must be True or False, got 2"),
    ],
)
def test_attention_wrappers_refuse_bools_as_numbers_and_none_causal(kwargs, message):
    c = _call()
    _store(c)
    args = (c["q"], c["offs"], c["k"], c["v"], c["lens"], c["table"])
    with pytest.raises(TypeError, match=f"flash_attn_paged: {message}"):
        pagedkv.flash_attn_paged(*args, **kwargs)
    with pytest.raises(TypeError, match=f"flash_attn_paged: {message}"):
        pagedkv.flash_attn_paged_lse(*args, **kwargs)
    if "causal" not in kwargs and "window_left" not in kwargs:
        with pytest.raises(TypeError, match=f"flash_attn_paged_sparse: {message}"):
            pagedkv.flash_attn_paged_sparse(c["q"], c["k"], c["v"], torch.zeros(5, 1, 2, dtype=torch.int32), **kwargs)


def test_store_and_load_wrappers_refuse_a_bool_quant_group():
    c = _call()
    with pytest.raises(TypeError, match="paged_store: quant_group must be an int, got True"):
        pagedkv.paged_store(c["key"], c["val"], c["k"], c["v"], c["offs"], c["lens"], c["table"], quant_group=True)
    with pytest.raises(TypeError, match="paged_load: quant_group must be an int, got True"):
        pagedkv.paged_load(c["k"], c["table"], c["lens"], quant_group=True)


def test_equivalent_scalars_still_accepted():
    import numpy as np

    c = _call()
    _store(c)
    args = (c["q"], c["offs"], c["k"], c["v"], c["lens"], c["table"])
    expected = pagedkv.flash_attn_paged(*args, scale=0.5, causal=False, window_left=2, softcap=30.0)
    for kwargs in ({"scale": np.float32(0.5), "causal": np.bool_(False), "window_left": np.int64(2),
                    "softcap": np.float64(30.0)},
                   {"scale": torch.tensor(0.5), "causal": 0, "window_left": 2, "softcap": 30}):
        torch.testing.assert_close(pagedkv.flash_attn_paged(*args, **kwargs), expected, rtol=0, atol=1e-6)
