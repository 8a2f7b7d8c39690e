"""Run every CPU benchmark of pagedkv, each in its own process (same method, see common.py).

  python benchmarks/run_all.py --quick   # the CPU grid rows (decode, MLA decode, prefill, store, load), ~1 min each
  python benchmarks/run_all.py           # full: adds the page-size sweep, more shapes and sizes
  python benchmarks/run_all.py --quick --cold   # the same with DRAM-cold data (see common.py)

Results land in benchmarks/results/ (JSON + Markdown + PNG per benchmark); a summary of every
target is printed at the end and written to benchmarks/results/summary[_quick].md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import result_stem, run_suffix

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ["bench_decode.py", "bench_mla.py", "bench_prefill.py", "bench_store.py", "bench_load.py"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--cold", action="store_true", help="every timed call starts with DRAM-cold data (common.py)")
    args, extra = p.parse_known_args()
    stems = []
    failed = []
    for script in SCRIPTS:
        cmd = [sys.executable, os.path.join(HERE, script), "--reps", str(args.reps), "--threads", str(args.threads)]
        cmd += (["--quick"] if args.quick else []) + (["--cold"] if args.cold else []) + extra
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(script)
        stems.append(result_stem(script.replace("bench_", "").replace(".py", ""), args.quick, args.cold))
    caches = "DRAM-cold data (--cold)" if args.cold else "warm caches"
    lines = ["# pagedkv CPU targets", "", f"Every row: one run, {caches}.", "",
             "| benchmark | target | measured | met |", "|---|---|---|---|"]
    for stem in stems:
        path = os.path.join(HERE, "results", stem + ".json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            res = json.load(f)
        for t in res.get("targets", []):
            lines.append(f"| {stem} | {t['target']} | {t['measured']:.3g} | {'yes' if t['met'] else 'no'} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    summary = "summary" + run_suffix(args.quick, args.cold) + ".md"
    with open(os.path.join(HERE, "results", summary), "w") as f:
        f.write(text)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
