"""Shared helpers of the pagedkv CPU benchmarks.

Method (every script):
- One process runs pagedkv, its peers and the memory ceiling, so each figure is a ratio taken
  in the same run (BENCHMARKS.md). Threads = torch.get_num_threads() (default: all cores) for
  pagedkv and for every peer alike.
- Timing: time.perf_counter around one call. Each candidate is warmed up (default 3 calls), then
  the candidates are timed round-robin, one call each per round, for >= 10 rounds; the figure is
  the median per candidate. Interleaving makes a load spike on a shared machine hit every
  candidate alike instead of one of them.
- Ceiling: a >= 512 MiB uint8 tensor copy (dst.copy_(src)), bytes read + written / median time,
  measured in the same process before the benchmark and again after it (the ratio uses the max).
- Page tables are random permutations of the physical pages (seeded) unless a row says identity.
- Caches: warm by default (no flush between repetitions); a KV pool larger than the last-level
  cache is then what makes a row memory-bound: the environment gives the last-level cache size and
  the decode rows their KV bytes (kv_MiB, kv_fits_llc). With --cold, a buffer of twice the
  last-level cache (at least 256 MiB) is read before every timed call, ceiling included, so every
  call starts with its data in DRAM, as after the weight reads of the rest of a model's layer;
  that read is not timed. Cold results get a _cold suffix.
- Results: JSON (every sample), Markdown table and optional PNG (matplotlib Agg) in
  benchmarks/results/, with device, date, commit, torch version and the pagedkv CPU ISA.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")

# Prefer the package built in this checkout (python setup.py build_ext --inplace or
# pip install -e .) over whatever pagedkv is installed elsewhere.
if glob.glob(os.path.join(ROOT, "python", "pagedkv", "_C*.so")):
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

import pagedkv  # noqa: E402,F401

MIN_REPS = 10
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the CPU grid row(s); finishes in under a minute")
    p.add_argument("--reps", type=int, default=MIN_REPS, help=f"timed rounds (median; at least {MIN_REPS})")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per candidate first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, all cores)")
    p.add_argument("--ceiling-mib", type=int, default=512, help="size of the copy-ceiling tensor (>= 512)")
    p.add_argument("--out", default=None, help="result file stem in benchmarks/results/ (default: script name)")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold", action="store_true",
                   help="read 2x the last-level cache before every timed call (DRAM-cold data); results get _cold")
    return p


def run_suffix(quick: bool, cold: bool) -> str:
    """What a run's mode adds to its result file names (the per-benchmark files and run_all's summary)."""
    return ("_quick" if quick else "") + ("_cold" if cold else "")


def result_stem(name: str, quick: bool, cold: bool) -> str:
    """benchmarks/results/ file stem of a CPU benchmark run, e.g. decode_cpu_quick_cold."""
    return f"{name}_cpu" + run_suffix(quick, cold)


# Read before every timed call in --cold mode (setup); None: warm caches.
_cold_buffer: Optional[torch.Tensor] = None


def cold_buffer_bytes() -> int:
    """Bytes read between timed calls in --cold mode: 2x the last-level cache, at least 256 MiB."""
    llc = last_level_cache_bytes() or 0
    return max(2 * llc, 256 << 20)


def setup(args) -> None:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    args.reps = max(args.reps, MIN_REPS)
    args.ceiling_mib = max(args.ceiling_mib, 512)
    torch.manual_seed(args.seed)
    global _cold_buffer
    # float32 zeros: summed between calls (a read that evicts the caches and leaves no dirty lines)
    _cold_buffer = torch.zeros(cold_buffer_bytes() // 4, dtype=torch.float32) if args.cold else None


def start(args) -> tuple:
    """setup(args), then what a script's cases start from: `(gen, env, ceiling)`, the cases' generator
    seeded with --seed, the environment and the copy ceiling before the cases (finish_ceiling
    measures it again after them)."""
    setup(args)
    gen = torch.Generator().manual_seed(args.seed)
    return gen, environment(), copy_ceiling(args.ceiling_mib, args.reps)


# ---------------------------------------------------------------- timing


def time_interleaved(candidates: Dict[str, Callable[[], object]], reps: int, warmup: int) -> Dict[str, List[float]]:
    """Seconds per call for each candidate: warm-up, then `reps` round-robin rounds (in --cold
    mode each timed call comes right after an untimed read of the cold buffer)."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    names = list(candidates)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for n in order:
            if _cold_buffer is not None:
                _cold_buffer.sum()
            t0 = time.perf_counter()
            candidates[n]()
            samples[n].append(time.perf_counter() - t0)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def copy_ceiling(mib: int = 512, reps: int = MIN_REPS) -> dict:
    """Same-run memory ceiling: GB/s of a large uint8 copy, read + written bytes."""
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    samples = time_interleaved({"copy": lambda: dst.copy_(src)}, reps, 2)["copy"]
    t = median(samples)
    return {"mib": mib, "seconds": t, "gbps": 2 * n / t / 1e9, "samples": samples}


def read_ceiling_library():
    """ctypes handle of benchmarks/probes/read_ceiling.c (vector loads summed over a buffer, one
    contiguous part per thread), compiled on first use into .deps/ (git-ignored) with -march=native:
    the widest loads this CPU has, and -fopenmp: loaded after torch it shares torch's libgomp, so it
    reads on the thread pool the decode runs on (a reader with threads of its own competed with that
    pool's spinning workers and read up to 1.3x slower). None (with the reason printed) where no C
    compiler with OpenMP works."""
    import ctypes

    src = os.path.join(ROOT, "benchmarks", "probes", "read_ceiling.c")
    out = os.path.join(ROOT, ".deps", "read_ceiling.so")
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = [os.environ.get("CC", "cc"), "-O2", "-march=native", "-shared", "-fPIC", "-fopenmp", src, "-o", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"read ceiling not built ({' '.join(cmd)}): {done.stderr.strip()}")
            return None
    lib = ctypes.CDLL(out)
    lib.pkv_read_ceiling.restype = ctypes.c_float
    lib.pkv_read_ceiling.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.pkv_read_ceiling_isa.restype = ctypes.c_char_p
    return lib


def read_ceiling_call(lib, nbytes: int, threads: int) -> Callable[[], float]:
    """A candidate for time_interleaved: one read of a fresh `nbytes` buffer with `threads` threads. The
    buffer is allocated as the caches are (cache_tensor: pagedkv.host_alloc.zeros, huge-page advised on
    Linux; zeroed, so every page is mapped before timing), so it reads the same kind of memory as the
    decode it bounds (alone on the Zen 4 EPYC, 268 MB and 1 GB: 37-48 GB/s on 4 KiB pages against
    50-54 on huge pages in one run, 28-31 against 30-31 in the next minutes)."""
    buf = pagedkv.host_alloc.zeros((nbytes,), dtype=torch.uint8)
    assert buf.data_ptr() % 64 == 0, "the read ceiling needs a 64-byte aligned buffer"
    return lambda: (buf, lib.pkv_read_ceiling(buf.data_ptr(), nbytes, threads))[1]


# ---------------------------------------------------------------- data


def random_table(batch: int, pages_per_seq: int, num_pages: int, gen: torch.Generator, identity: bool = False):
    """int32 [batch, pages_per_seq]: distinct physical pages, randomly permuted (or in order)."""
    need = batch * pages_per_seq
    assert need <= num_pages
    ids = torch.arange(need) if identity else torch.randperm(num_pages, generator=gen)[:need]
    return ids.to(torch.int32).view(batch, pages_per_seq)


def cache_tensor(x: torch.Tensor) -> torch.Tensor:
    """x copied into memory allocated the way pagedkv's cache classes allocate (pagedkv.host_alloc.zeros:
    huge-page advised on Linux), so the benchmarks read caches like the ones users get."""
    t = pagedkv.host_alloc.zeros(x.shape, dtype=x.dtype)
    t.copy_(x)
    return t


def quantize_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, group: int = 128):
    """The contract's FP8 rule in torch: per (token, head, group) scale = amax / FP8_MAX."""
    fmax = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    d = x.shape[-1]
    ng = (d + group - 1) // group
    xs = x.float()
    pad = ng * group - d
    if pad:
        xs = torch.nn.functional.pad(xs, (0, pad))
    g = xs.view(*xs.shape[:-1], ng, group)
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    q = (g / scale).clamp(-fmax, fmax).to(dtype).view(*xs.shape[:-1], ng * group)[..., :d]
    return cache_tensor(q), scale.squeeze(-1).contiguous()


def sdpa_backend_name(fn: Callable[[], object]) -> str:
    """Name of the aten SDPA kernel that ran inside fn (one profiled call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.key for e in prof.key_averages() if "scaled_dot_product" in e.key and e.key != "aten::scaled_dot_product_attention"]
    return ", ".join(sorted(set(names))) or "aten::scaled_dot_product_attention"


# ---------------------------------------------------------------- environment


def cpu_isa() -> str:
    """The kernel table pagedkv's core picks (same rule as csrc/cpu/pkv_cpu_dispatch.c)."""
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    best = "scalar"
    if {"avx2", "fma", "f16c"} <= flags:
        best = "avx2"
    if best == "avx2" and {"avx512f", "avx512bw", "avx512vl"} <= flags:
        best = "avx512" + ("+bf16" if "avx512_bf16" in flags else "")
    if best == "avx512+bf16" and {"amx_bf16", "amx_tile"} <= flags:
        best = "amx"  # (when Linux grants the tile state; otherwise the core runs avx512)
    want = os.environ.get("PAGEDKV_CPU_ISA")
    order = ["scalar", "avx2", "avx512", "amx"]
    if want in order and order.index(want) < order.index(best.split("+")[0]):
        best = want
    return best


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes() -> int | None:
    """Size of the CPU's last-level cache from sysfs (None where unknown). A KV pool below it can be
    served from that cache in warm repetitions, so a row that fits is not a DRAM-bound measurement."""
    best_level, size = 0, None
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            level = int(open(os.path.join(d, "level")).read())
            text = open(os.path.join(d, "size")).read().strip().upper()
        except (OSError, ValueError):
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        value = int(text.rstrip("KMG")) * mult
        if level > best_level:
            best_level, size = level, value
    return size


def environment() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    commit = git("rev-parse", "HEAD")
    llc = last_level_cache_bytes()
    # the results folder itself does not count: a run of several benchmarks rewrites it as it goes
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"))
    return {
        "device": f"CPU: {model}",
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit + ("-dirty" if dirty else ""),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pagedkv_cpu_isa": cpu_isa(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "transparent_hugepage": pagedkv.host_alloc.thp_mode(),  # caches come from pagedkv.host_alloc.zeros
        "last_level_cache_MiB": llc / 2**20 if llc is not None else None,
        "caches": "warm" if _cold_buffer is None else "cold",  # see the method above
        "cold_read_MiB": None if _cold_buffer is None else _cold_buffer.numel() * _cold_buffer.element_size() >> 20,
    }


# ---------------------------------------------------------------- output


def fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or 0.01 <= abs(v) < 1e5:
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
        return f"{v:.3e}"
    return str(v)


def table_lines(rows: List[dict], columns: List[str]) -> List[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |")
    return out


def print_table(rows: List[dict], columns: List[str]) -> None:
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))


def print_targets(targets: List[dict]) -> None:
    """One line per target: what it asks, the measured value, MET or MISSED."""
    width = max(len(t["target"]) for t in targets)
    for t in targets:
        print(f"target: {t['target']:{width}s} measured {t['measured']:.3g}  {'MET' if t['met'] else 'MISSED'}")


def bandwidth_plot(rows: List[dict], ceiling: dict, env: dict, op: str) -> Callable[[str], None]:
    """A plot function for write_results: pagedkv GB/s per row as bars, the copy ceiling as a line."""

    def plot(path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        x = range(len(rows))
        ax.bar(list(x), [r["pagedkv_gbps"] for r in rows], 0.5, label=f"pagedkv {op}")
        ax.axhline(ceiling["gbps"], color="k", ls="--", label="copy ceiling")
        ax.set_xticks(list(x), [r["case"] for r in rows], fontsize=7, rotation=15)
        ax.set_ylabel("GB/s (read + written)")
        ax.legend(fontsize=8)
        ax.set_title(f"{op}, {env['device']}, {env['threads']} threads, {env['caches']} caches", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    return plot


def method(doc: str, *paragraphs: str) -> str:
    """A result file's method: the script docstring's first paragraph, `paragraphs`, then the method
    every script shares (this module's docstring)."""
    return "\n\n".join([doc.split("\n\n")[0], *paragraphs, __doc__])


def write_results(stem: str, title: str, method: str, env: dict, ceiling: dict, rows: List[dict], columns: List[str],
                  targets: Optional[List[dict]] = None, plot: Optional[Callable[[str], None]] = None,
                  ceiling_line: Optional[str] = None) -> None:
    """ceiling_line replaces the copy-ceiling line of the Markdown (for a benchmark with another ceiling)."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    base = os.path.join(RESULTS_DIR, stem)
    with open(base + ".json", "w") as f:
        json.dump({"title": title, "method": method, "environment": env, "copy_ceiling": ceiling, "rows": rows,
                   "targets": targets or []}, f, indent=1)
    lines = [f"# {title}", "", method.strip(), ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [ceiling_line or f"- copy ceiling: {ceiling['gbps']:.2f} GB/s ({ceiling['mib']} MiB copy, read + write)", ""]
    lines += table_lines(rows, columns)
    if targets:
        lines += ["", "## Targets", ""]
        lines += table_lines(targets, ["target", "measured", "met"])
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            plot(base + ".png")
        except ImportError:
            print("matplotlib not installed: no PNG")
    print(f"wrote {base}.json / .md" + (" / .png" if plot is not None else ""))


def finish_ceiling(before: dict, args) -> dict:
    """Measure the ceiling again after the benchmark; keep the higher (a load spike only lowers it)."""
    after = copy_ceiling(args.ceiling_mib, args.reps)
    best = before if before["gbps"] >= after["gbps"] else after
    return {**best, "before_gbps": before["gbps"], "after_gbps": after["gbps"]}
