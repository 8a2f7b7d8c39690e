"""pagedkv.set_kernel_options / pagedkv.kernel_options: the process-wide kernel settings of the C core
(csrc/core/pkv_settings.h), read by the CPU driver and the CUDA plans once per call.

Round trip and restore, refusals that change nothing, set_checks and _C.set_cuda_loader as views of the
same settings, the environment variables that give initial values (PAGEDKV_CHECK, PAGEDKV_CUDA_SPLITS,
PAGEDKV_CUDA_PREFILL_WGMMA) and those that no longer do, and cpu_decode reaching another CPU path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_attention_close

import pagedkv
from pagedkv import _C
from pagedkv import reference as ref

pytestmark = pytest.mark.usefixtures("cuda_knobs")

DEFAULTS = {"checks": False, "cpu_decode": "auto", "cuda_loader": "auto", "cuda_splits": 0,
            "cuda_sparse_kernel": "auto", "cuda_fp8_store_rows": False, "cuda_prefill_wgmma": False}


def test_kernel_options_set_returns_previous_and_restores():
    before = pagedkv.kernel_options()
    assert set(before) == set(DEFAULTS)
    changed = {"checks": True, "cpu_decode": "packed", "cuda_loader": "cp.async", "cuda_splits": 5,
               "cuda_sparse_kernel": "portable", "cuda_fp8_store_rows": True, "cuda_prefill_wgmma": True}
    previous = pagedkv.set_kernel_options(**changed)
    assert previous == before
    assert pagedkv.kernel_options() == changed
    assert pagedkv.checks_enabled() and (not _C.with_cuda or _C.cuda_loader() == 0)
    assert pagedkv.set_kernel_options(**previous) == changed
    assert pagedkv.kernel_options() == before


def test_set_checks_and_cuda_loader_share_the_settings():
    pagedkv.set_checks(True)
    assert pagedkv.kernel_options()["checks"] is True
    pagedkv.set_kernel_options(checks=False)
    assert not pagedkv.checks_enabled()
    if _C.with_cuda:
        _C.set_cuda_loader(2)
        assert pagedkv.kernel_options()["cuda_loader"] == "tma-gather4"
        with pytest.raises(RuntimeError, match="cuda_loader must be"):
            _C.set_cuda_loader(3)


@pytest.mark.parametrize("bad, match", [
    ({"cpu_decode": "fast"}, "cpu_decode must be one of"),
    ({"cuda_loader": 1}, "cuda_loader must be one of"),
    ({"cuda_splits": -1}, "cuda_splits must be 0"),
    ({"cuda_splits": 2.0}, "cuda_splits must be an int"),
    ({"cuda_splits": True}, "cuda_splits must be an int"),
    ({"checks": 1}, "checks must be True or False"),
    ({"cuda_sparse_kernel": "fast"}, "cuda_sparse_kernel must be one of"),
    ({"cuda_fp8_store_rows": 1}, "cuda_fp8_store_rows must be True or False"),
    ({"cuda_prefill_wgmma": "on"}, "cuda_prefill_wgmma must be True or False"),
    ({"key_split": False}, "no kernel option named 'key_split'"),
])
def test_set_kernel_options_refuses_and_changes_nothing(bad, match):
    before = pagedkv.kernel_options()
    with pytest.raises(ValueError, match=match):
        pagedkv.set_kernel_options(**{"checks": True, "cuda_splits": 3, "cpu_decode": "packed", **bad})
    assert pagedkv.kernel_options() == before


def test_environment_gives_initial_values(tmp_path):
    """PAGEDKV_CHECK, PAGEDKV_CUDA_SPLITS and PAGEDKV_CUDA_PREFILL_WGMMA set the initial checks / cuda_splits /
    cuda_prefill_wgmma; the switches that were read per call before (PAGEDKV_CPU_DECODE, the CUDA path
    switches) are no longer read."""
    env = dict(os.environ, PAGEDKV_CHECK="1", PAGEDKV_CUDA_SPLITS="3", PAGEDKV_CUDA_PREFILL_WGMMA="1",
               PAGEDKV_CPU_DECODE="packed",
               PAGEDKV_CUDA_SPARSE_KERNEL="portable", PAGEDKV_CUDA_PREFILL_ROWS32="1",
               PYTHONPATH=os.path.dirname(os.path.dirname(pagedkv.__file__)))
    code = "import json, pagedkv; print(json.dumps(pagedkv.kernel_options()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {**DEFAULTS, "checks": True, "cuda_splits": 3,
                                                               "cuda_prefill_wgmma": True}
    env.pop("PAGEDKV_CHECK")
    env.pop("PAGEDKV_CUDA_SPLITS")
    env["PAGEDKV_CUDA_PREFILL_WGMMA"] = "0"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == DEFAULTS


def test_cpu_decode_reaches_the_packed_path():
    """A decode call whose item the direct decode takes (AVX2 / AVX-512 tables: float32 queries over f16
    rows, GQA 4, D 128) sums in another order on the packed tiles: the outputs differ in some bit, and
    both match the reference. The scalar table has one decode path."""
    if pagedkv.build_info()["cpu_kernel_in_use"] == "scalar":
        pytest.skip("the scalar kernels have no direct decode")
    gen = torch.Generator().manual_seed(7)
    b, hk, group, d, p, keys = 4, 2, 4, 128, 16, 300
    pages = (keys + p - 1) // p
    k = torch.randn(b * pages, p, hk, d, generator=gen).half()
    v = torch.randn(b * pages, p, hk, d, generator=gen).half()
    table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    lengths = torch.full((b,), keys - 1, dtype=torch.int32)
    offsets = torch.arange(b + 1, dtype=torch.int32)
    q = torch.randn(b, hk * group, d, generator=gen)
    args = (offsets, k, v, lengths, table)
    outs = {}
    for path in ("auto", "packed"):
        pagedkv.set_kernel_options(cpu_decode=path)
        outs[path] = pagedkv.flash_attn_paged(q, *args)
        assert_attention_close(outs[path], ref.flash_attn_paged(q.double(), *args), torch.float32, path)
    assert not torch.equal(outs["auto"], outs["packed"]), "cpu_decode='packed' gave the direct decode's bits"
