"""benchmarks/memcheck_ledger.py: which cases of a compute-sanitizer log count as clean, which source
changes void them, and the pytest plugin that skips what is clean (on a small tree of its own)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import memcheck_ledger as ml  # noqa: E402

HEADER = "========= COMPUTE-SANITIZER\n"


def passed(*names):
    return "".join(f"tests/test_a.py::{n} PASSED [ 50%]\n" for n in names)


def test_a_clean_run_counts_every_passed_case():
    log = HEADER + passed("t1", "t2") + "tests/test_a.py::t3 FAILED [ 75%]\n" + "========= ERROR SUMMARY: 0 errors\n"
    assert ml.clean_cases(log) == ["tests/test_a.py::t1", "tests/test_a.py::t2"]


@pytest.mark.parametrize("error", [
    "========= Invalid __global__ read of size 4 bytes\n",
    "========= Program hit cudaErrorIllegalAddress (error 700) on CUDA API call to cudaMemcpy.\n",
    "========= ERROR SUMMARY: 2 errors\n",
])
def test_a_memory_error_anywhere_voids_the_run(error):
    assert ml.clean_cases(HEADER + passed("t1") + error + passed("t2") + "========= ERROR SUMMARY: 0 errors\n") == []


def test_a_run_stopped_at_its_limit_drops_its_last_cases():
    names = [f"t{i}" for i in range(10)]
    assert ml.clean_cases(HEADER + passed(*names)) == [f"tests/test_a.py::{n}" for n in names[:-ml.UNSURE_TAIL]]
    assert ml.clean_cases(HEADER + passed("t1", "t2")) == []


def write(root: Path, rel: str, text: str):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


TEST_FILE = "def test_cuda_one():\n    pass\n\ndef test_cuda_two():\n    pass\n"


@pytest.fixture
def tree(tmp_path):
    write(tmp_path, "pytest.ini", "[pytest]\n")
    write(tmp_path, "csrc/cuda/k.cu", "// kernel\n")
    write(tmp_path, "csrc/cpu/k.c", "// cpu kernel\n")
    write(tmp_path, "python/pagedkv/ops.py", "# ops\n")
    write(tmp_path, "tests/conftest.py", "# helpers\n")
    write(tmp_path, "tests/test_a.py", TEST_FILE)
    write(tmp_path, "tests/test_b.py", TEST_FILE)
    return tmp_path


def test_keys_follow_the_sources_that_reach_the_device(tree):
    a, b = "tests/test_a.py::test_cuda_one", "tests/test_b.py::test_cuda_one"
    before = (ml.Keys(tree).of(a), ml.Keys(tree).of(b))
    assert before[0] != before[1]
    # CPU kernels and the build's generated config do not change what runs on the device
    write(tree, "csrc/cpu/k.c", "// faster cpu kernel\n")
    write(tree, "python/pagedkv/_build_config.py", "WITH_CUDA = True\n")
    assert (ml.Keys(tree).of(a), ml.Keys(tree).of(b)) == before
    # a test file's change voids its own cases only
    write(tree, "tests/test_a.py", TEST_FILE + "\n# edited\n")
    assert ml.Keys(tree).of(a) != before[0] and ml.Keys(tree).of(b) == before[1]
    # a kernel, a shim or a test helper voids all
    for rel in ("csrc/cuda/k.cu", "python/pagedkv/ops.py", "tests/conftest.py"):
        keys = ml.Keys(tree)
        old = (keys.of(a), keys.of(b))
        write(tree, rel, (tree / rel).read_text() + "// changed\n")
        new_keys = ml.Keys(tree)
        assert new_keys.of(a) != old[0] and new_keys.of(b) != old[1], rel


def run_pytest(tree: Path, ledger: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(BENCH), "PAGEDKV_MEMCHECK_LEDGER": str(ledger)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "memcheck_ledger", "tests"],
                         cwd=tree, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_plugin_skips_recorded_cases_until_their_sources_change(tree):
    ledger = tree / "ledger.json"
    log = tree / "memcheck.txt"
    log.write_text(HEADER + "tests/test_a.py::test_cuda_one PASSED [ 25%]\n" + "tests/test_b.py::test_cuda_two PASSED [100%]\n"
                   + "========= ERROR SUMMARY: 0 errors\n")
    assert ml.record(log, "abc1234", "NVIDIA H200", ledger_path=ledger, root=tree) == 2
    data = json.loads(ledger.read_text())
    assert data["runs"][0]["commit"] == "abc1234" and data["runs"][0]["complete"]
    out = run_pytest(tree, ledger)
    assert "2 passed, 2 deselected" in out
    assert "test_a.py::test_cuda_two PASSED" in out and "test_b.py::test_cuda_one PASSED" in out
    write(tree, "tests/test_a.py", TEST_FILE + "\n# edited\n")
    assert "3 passed, 1 deselected" in run_pytest(tree, ledger)
