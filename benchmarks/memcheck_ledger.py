"""compute-sanitizer memcheck over the whole CUDA suite, in pieces.

Under memcheck the CUDA cases run ~3 per second on an H200, so the ~2400 of them need more than one
device call (10 minutes at most, 15 per task). This ledger records every case that passed under
memcheck in a run that reported no memory error, keyed by the contents of what the case ran: the
sources that reach the device (csrc/core, csrc/cuda, csrc/torch, python/pagedkv, setup.py,
build_mode.py), the test helpers (every tests/**/*.py not named test_*.py) and the case's own test
file. A later call at the same sources skips the recorded cases, so memcheck runs pile up to the
whole suite; a change to any of those files makes the cases it can affect run again.

  python3 benchmarks/memcheck_ledger.py record OUT/memcheck.txt --commit C --device "NVIDIA H200"
      merge a run's clean cases into benchmarks/results/memcheck_ledger.json: its PASSED cases when
      the log holds no memory error (a run stopped at its limit, without the sanitizer's summary: all
      but the last few), none when it holds one
  python3 benchmarks/memcheck_ledger.py status
      how many of the suite's CUDA cases (collected here, `-k "cuda and not graph"`) are clean at
      today's sources, per test file, and which runs made them so
  pytest -p memcheck_ledger ...   (benchmarks/ on sys.path; what `gpu_run.sh memcheck` does with
      GPU_MEMCHECK_LEDGER=1): deselects the cases the ledger holds clean at today's sources
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEDGER = ROOT / "benchmarks" / "results" / "memcheck_ledger.json"
DEVICE_SOURCES = ("csrc/core", "csrc/cuda", "csrc/torch", "python/pagedkv", "setup.py", "build_mode.py")
SOURCE_SUFFIXES = {".c", ".h", ".inc", ".cu", ".cuh", ".cpp", ".py"}
GENERATED = {"python/pagedkv/_build_config.py"}  # written by the build, differs between machines
SELECTION = "cuda and not graph"
# cases reported in the last seconds before a run was stopped at its limit: a memory error of theirs
# could have been lost with the killed sanitizer's unflushed output, so they are not recorded
UNSURE_TAIL = 3

PASSED = re.compile(r"^(tests/\S+::\S+) PASSED\b")
ERROR_SUMMARY = re.compile(r"=+ ERROR SUMMARY: (\d+) error")
SANITIZER_ERROR = re.compile(r"^=+ (Invalid|Program hit|Out-of-range|Misaligned|Address .* is out of bounds)")


def _digest(paths, root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _files_under(root: Path, entries) -> list:
    out = []
    for e in entries:
        p = root / e
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += [f for f in p.rglob("*") if f.is_file() and f.suffix in SOURCE_SUFFIXES and "__pycache__" not in f.parts]
    return [f for f in out if str(f.relative_to(root)) not in GENERATED]


class Keys:
    """The key of each test file's cases at the sources of the tree under root."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        helpers = [f for f in (root / "tests").rglob("*.py") if not f.name.startswith("test_") and "__pycache__" not in f.parts]
        self.common = _digest(_files_under(root, DEVICE_SOURCES), root) + _digest(helpers, root)
        self._by_file = {}

    def of(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        if path not in self._by_file:
            h = hashlib.sha256((self.common + _digest([self.root / path], self.root)).encode())
            self._by_file[path] = h.hexdigest()[:16]
        return self._by_file[path]


def load(path: Path = LEDGER) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"about": "memcheck-clean CUDA cases by source key (benchmarks/memcheck_ledger.py)", "runs": [], "cases": {}}


def clean_cases(log_text: str) -> list:
    """The cases of a memcheck log that count as clean: none if it reports a memory error; else its
    PASSED cases, but the last UNSURE_TAIL when the sanitizer's summary is missing (stopped at a limit)."""
    lines = log_text.splitlines()
    summaries = [int(n) for n in ERROR_SUMMARY.findall(log_text)]
    if any(summaries) or any(SANITIZER_ERROR.match(line) for line in lines):
        return []
    passed = [m.group(1) for m in map(PASSED.match, lines) if m]
    return passed if summaries else passed[:-UNSURE_TAIL] if len(passed) > UNSURE_TAIL else []


def record(log_path: Path, commit: str, device: str, ledger_path: Path = LEDGER, root: Path = ROOT) -> int:
    log_text = log_path.read_text(errors="replace")
    cases = clean_cases(log_text)
    ledger = load(ledger_path)
    keys = Keys(root)
    run_id = len(ledger["runs"])
    ledger["runs"].append({"commit": commit, "device": device, "date": datetime.date.today().isoformat(),
                           "complete": bool(ERROR_SUMMARY.search(log_text)), "clean_cases": len(cases)})
    for nodeid in cases:
        ledger["cases"][nodeid] = {"key": keys.of(nodeid), "run": run_id}
    ledger_path.write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n")
    return len(cases)


def clean_now(ledger: dict, keys: Keys) -> set:
    """The recorded cases whose key is today's."""
    return {n for n, c in ledger["cases"].items() if (keys.root / n.split("::", 1)[0]).exists() and c["key"] == keys.of(n)}


def collect(root: Path = ROOT) -> list:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-k", SELECTION, "tests"],
                         cwd=root, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root / "python")})
    return [line for line in out.stdout.splitlines() if line.startswith("tests/") and "::" in line]


def status(root: Path = ROOT, ledger_path: Path = LEDGER) -> str:
    ledger, keys = load(ledger_path), Keys(root)
    suite = collect(root)
    clean = clean_now(ledger, keys) & set(suite)
    per_file = {}
    for n in suite:
        f = n.split("::", 1)[0]
        done, total = per_file.get(f, (0, 0))
        per_file[f] = (done + (n in clean), total + 1)
    runs = sorted({ledger["cases"][n]["run"] for n in clean})
    lines = [f"memcheck ledger: {len(clean)} of {len(suite)} CUDA cases ({SELECTION!r}, collected here) clean at today's sources"]
    lines += [f"  {f}: {d}/{t}" for f, (d, t) in sorted(per_file.items())]
    lines += ["  from runs: " + "; ".join(f"{r['date']} {r['commit']} {r['device']}" for r in (ledger["runs"][i] for i in runs))] if runs else []
    return "\n".join(lines)


# pytest plugin (-p memcheck_ledger): skip what the ledger holds clean at today's sources
def pytest_collection_modifyitems(config, items):
    ledger_path = Path(os.environ.get("PAGEDKV_MEMCHECK_LEDGER", LEDGER))
    keys = Keys(Path(str(config.rootpath)))
    clean = clean_now(load(ledger_path), keys)
    done = [i for i in items if i.nodeid in clean]
    if done:
        items[:] = [i for i in items if i.nodeid not in clean]
        config.hook.pytest_deselected(items=done)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="merge a memcheck log's clean cases into the ledger")
    r.add_argument("log", type=Path)
    r.add_argument("--commit", required=True)
    r.add_argument("--device", required=True)
    sub.add_parser("status", help="coverage of the suite's CUDA cases at today's sources")
    a = ap.parse_args(argv)
    if a.cmd == "record":
        n = record(a.log, a.commit, a.device)
        print(f"recorded {n} clean cases from {a.log} into {LEDGER.relative_to(ROOT)}")
    else:
        print(status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
