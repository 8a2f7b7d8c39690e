"""The CPU benchmark harness's own rules (benchmarks/common.py): interleaved timing, the --cold
read before every timed call, result file names, the probes, bench_decode's warm-speed calls. The figures
themselves are not tested here."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
common = pytest.importorskip("common")


def test_interleaved_rounds_rotate_and_count():
    calls = []
    samples = common.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=4, warmup=2)
    assert [len(samples["a"]), len(samples["b"])] == [4, 4]
    assert calls[:4] == ["a", "a", "b", "b"]  # warm-up, then one call each per round, first mover rotating
    assert calls[4:] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert all(t >= 0 for t in samples["a"] + samples["b"])


def test_cold_mode_reads_the_buffer_before_every_timed_call(monkeypatch):
    class Recorder:  # stands in for the cold buffer: counts the reads
        reads = 0

        def sum(self):
            Recorder.reads += 1

    monkeypatch.setattr(common, "_cold_buffer", Recorder())
    seen = []
    common.time_interleaved({"x": lambda: seen.append(Recorder.reads), "y": lambda: None}, reps=3, warmup=2)
    # no read before the warm-up calls; one right before each of the 6 timed calls
    # (rounds run x y, y x, x y: x is timed after reads 1, 4 and 5)
    assert Recorder.reads == 6
    assert seen == [0, 0, 1, 4, 5]


def test_warm_mode_leaves_caches_alone(monkeypatch):
    monkeypatch.setattr(common, "_cold_buffer", None)
    assert common.time_interleaved({"x": lambda: None}, reps=2, warmup=0)["x"]


@pytest.fixture
def fake_sysfs(monkeypatch, tmp_path):
    """Lists cpu0's cache directories as sysfs would: one index<i> folder per (level, size text).
    The size is read once per process (lru_cache): forgotten before and after the test."""

    def make(caches):
        dirs = []
        for i, (level, size) in enumerate(caches):
            d = tmp_path / f"index{i}"
            d.mkdir()
            (d / "level").write_text(f"{level}\n")
            (d / "size").write_text(f"{size}\n")
            dirs.append(str(d))
        monkeypatch.setattr(common.glob, "glob", lambda pattern: dirs)
        common.last_level_cache_bytes.cache_clear()

    yield make
    common.last_level_cache_bytes.cache_clear()


@pytest.mark.parametrize("caches,llc", [
    ([(1, "48K"), (1, "32K"), (2, "2048K"), (3, "320M")], 320 << 20),  # the highest level wins
    ([(2, "1M"), (3, "64M")], 64 << 20),
    ([(3, "1G")], 1 << 30),
    ([(1, "32768")], 32768),  # no unit: bytes
    ([], None),  # no sysfs: unknown
])
def test_cold_buffer_is_twice_the_last_level_cache_read_from_sysfs(fake_sysfs, caches, llc):
    """--cold reads 2x the last-level cache between timed calls (at least 256 MiB), so the data
    of the previous call cannot still be cached; the size comes from sysfs's cache folders."""
    fake_sysfs(caches)
    assert common.last_level_cache_bytes() == llc
    assert common.cold_buffer_bytes() == max(2 * (llc or 0), 256 << 20)


def test_setup_allocates_the_cold_buffer_only_with_cold(monkeypatch):
    monkeypatch.setattr(common, "_cold_buffer", None)
    monkeypatch.setattr(common, "cold_buffer_bytes", lambda: 1 << 20)
    threads = torch.get_num_threads()
    args = common.base_parser("t").parse_args(["--cold", "--reps", "3"])
    common.setup(args)
    assert common._cold_buffer is not None and common._cold_buffer.numel() * 4 == 1 << 20
    assert args.reps == common.MIN_REPS and args.ceiling_mib >= 512
    env = common.environment()
    assert env["caches"] == "cold" and env["cold_read_MiB"] == 1
    common.setup(common.base_parser("t").parse_args([]))
    assert common._cold_buffer is None
    env = common.environment()
    assert env["caches"] == "warm" and env["cold_read_MiB"] is None
    torch.set_num_threads(threads)


@pytest.mark.parametrize("quick,cold,stem", [(True, False, "decode_cpu_quick"), (False, False, "decode_cpu"),
                                             (True, True, "decode_cpu_quick_cold"), (False, True, "decode_cpu_cold")])
def test_result_stems(quick, cold, stem):
    assert common.result_stem("decode", quick, cold) == stem


def test_page_read_probe_builds_and_reports_every_mode(tmp_path):
    """benchmarks/probes/page_read.c (the bare-read bound quoted in README): builds warning-free and
    prints a positive median for the copy ceiling and each read mode."""
    import re
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    if common.cpu_isa() == "scalar":  # every other kernel table needs AVX2
        pytest.skip("the probe reads with AVX2 loads")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "probes", "page_read.c")
    exe = tmp_path / "page_read"
    subprocess.run([cc, "-O2", "-mavx2", "-Wall", "-Wextra", "-Werror", "-pthread", src, "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), "4", "8", "2", "1"], check=True, capture_output=True, text=True).stdout
    rows = dict(re.findall(r"^((?:copy|read) [^\n]*?)\s+median\s+([0-9.]+) GB/s", out, re.M))
    assert set(rows) == {"copy (read + write)", "read random pages", "read pages in order", "read random + prefetch",
                         "read random, 4 at once"}, out
    assert all(float(v) > 0 for v in rows.values()), out
    bad = subprocess.run([str(exe), "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("probe,needs,argv,modes", [
    ("tile_read", "avx2", ["64", "2", "1"], 9),
    ("overlap_read", "avx512_bf16", ["64", "1"], 12),
])
def test_pool_probe_builds_and_reports_every_mode(tmp_path, probe, needs, argv, modes):
    """benchmarks/probes/tile_read.c and overlap_read.c (on probe_pool.h; figures quoted in
    benchmarks/README.md): build warning-free, print a positive median for every mode on a small pool,
    and refuse a pool too small for a tile per thread with their usage line."""
    import re
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    if needs not in cpu_flags():
        pytest.skip(f"the probe needs {needs}")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "probes", probe + ".c")
    exe = tmp_path / probe
    built = subprocess.run([cc, "-O2", "-march=native", "-fopenmp", "-Wall", "-Wextra", "-Werror", src, "-o", str(exe)],
                           capture_output=True, text=True)
    if built.returncode != 0 and "fopenmp" in built.stderr:
        pytest.skip("no OpenMP in this C compiler")
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe)] + argv, check=True, capture_output=True, text=True).stdout
    rows = re.findall(r"^(\S[^\n]*?)\s+median\s+([0-9.]+) GB/s", out, re.M)
    assert len(rows) == modes and len({name for name, _ in rows}) == modes, out
    assert all(float(v) > 0 for _, v in rows), out
    bad = subprocess.run([str(exe), "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize("head_major", [False, True])
def test_issue26_warm_calls_run_on_the_default_decode_path(head_major):
    # bench_decode --issue26 bounds each row by these calls' warm speed; each sets cpu_decode="auto" first
    import argparse

    bench_decode = pytest.importorskip("bench_decode")
    import pagedkv

    args = argparse.Namespace(seed=0, head_major=head_major, quant_group=128)
    before = pagedkv.kernel_options()["cpu_decode"]
    try:
        pagedkv.set_kernel_options(cpu_decode="fma")
        outs = {name: call() for name, call in bench_decode.decode_calls(2, 16, args).items()}
        assert pagedkv.kernel_options()["cpu_decode"] == "auto"
    finally:
        pagedkv.set_kernel_options(cpu_decode=before)
    assert set(outs) == {"bf16", "e4m3", "e5m2"}
    for name, out in outs.items():
        assert torch.isfinite(out.float()).all(), name
        assert (out.float() - outs["bf16"].float()).abs().max().item() < 0.25, name


def test_hf_beam_mode_runs_the_three_caches_and_measures_their_kv_bytes():
    # bench_hf --beams: each candidate's beam search gives sdpa's tokens, and the K/V bytes it reports
    # are transformers' cache tensors (rows x layers x K and V x heads x positions x D x 4 bytes) or the
    # PagedCache pages handed out (whole pages; at most every row's own pages, none shared)
    pytest.importorskip("transformers")
    bench_hf = pytest.importorskip("bench_hf")
    import argparse

    model, ids, _, pad_id = bench_hf.load_model(argparse.Namespace(random_model=True, seed=0))
    ids, beams, new_tokens = ids[:3], 2, 3
    runs = bench_hf.candidates(model, ids, pad_id, new_tokens, beams)
    assert set(runs) == set(bench_hf.CACHE_CALLS)
    outs = {name: run() for name, run in runs.items()}
    assert all(out == outs["sdpa"] for out in outs.values()) and len(outs["sdpa"]) == len(ids)
    config, rows, width = model.config, len(ids) * beams, max(map(len, ids))
    head_dim = config.hidden_size // config.num_attention_heads
    per_position = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    positions = width + new_tokens - 1  # the last token is sampled, never stored
    for name in ("sdpa", "pagedkv (DynamicCache)"):
        held, allocated = bench_hf.kv_mebibytes(model, ids, pad_id, new_tokens, beams, name)
        assert held == allocated == rows * positions * per_position / 2**20, name
    held, allocated = bench_hf.kv_mebibytes(model, ids, pad_id, new_tokens, beams, "pagedkv (PagedCache)")
    page_size = 16  # PagedCache's default
    own_pages = sum(-(-(len(x) + new_tokens - 1) // page_size) for x in ids) * beams
    assert 0 < held <= own_pages * page_size * per_position / 2**20 and held <= allocated
