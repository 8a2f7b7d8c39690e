"""Run every CPU benchmark of pagedkv, each in its own process (same method, see common.py).

  python benchmarks/run_all.py --quick   # the CPU grid rows (decode, prefill, store, load), ~1 min each
  python benchmarks/run_all.py           # full: adds the page-size sweep, more shapes and sizes

Results land in benchmarks/results/ (JSON + Markdown + PNG per benchmark); a summary of every
target is printed at the end and written to benchmarks/results/summary[_quick].md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ["bench_decode.py", "bench_prefill.py", "bench_store.py", "bench_load.py"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    args, extra = p.parse_known_args()
    stems = []
    failed = []
    for script in SCRIPTS:
        cmd = [sys.executable, os.path.join(HERE, script), "--reps", str(args.reps), "--threads", str(args.threads)]
        cmd += (["--quick"] if args.quick else []) + extra
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(script)
        stems.append(script.replace("bench_", "").replace(".py", "") + "_cpu" + ("_quick" if args.quick else ""))
    lines = ["# pagedkv CPU targets", "", "| benchmark | target | measured | met |", "|---|---|---|---|"]
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
    with open(os.path.join(HERE, "results", "summary" + ("_quick" if args.quick else "") + ".md"), "w") as f:
        f.write(text)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
