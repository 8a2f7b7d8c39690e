#!/usr/bin/env bash
# A/B of two builds of the CUDA extension on one GPU machine, in one device call: benchmarks/bench_gpu.py
# (issue 22's grid) runs with build A, then B, then A, then B ... so a difference between the builds is
# told apart from a difference between machines (boost clocks differ from one lent card to the next:
# the same build's compute-bound rows moved 9-12% between two H200 calls of 2026-11-27).
#
#   bash benchmarks/gpu_ab.sh DIR_A DIR_B [rounds, default 2]
#
# Each DIR holds what benchmarks/gpu_prebuild.sh leaves in .gpu_prebuilt/ (the extension, gzipped or not,
# and _build_config.py); carry both in the device call. The printed rows land in $OUT/ab.txt, each run's
# bench_gpu.json in $OUT/ab_runs.tar.gz (two files: the device tool brings back at most 8).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
A=$1 B=$2 ROUNDS=${3:-2}
OUT=${OUT:-$ROOT/benchmarks/results/gpu-ab-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

install_build() {  # copy a prebuilt extension into python/pagedkv (gunzipped where it was gzipped)
  local dir=$1 so
  so=$(ls "$dir"/_C.cpython-*.so* | head -1)
  case "$so" in
  *.gz) gunzip -c "$so" >"python/pagedkv/$(basename "${so%.gz}")" ;;
  *) cp "$so" python/pagedkv/ ;;
  esac
  cp "$dir/_build_config.py" python/pagedkv/
}

for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    dir=$A
    [ $side = B ] && dir=$B
    install_build "$dir"
    echo "== round $r build $side ($dir: $(cat "$dir/commit" 2>/dev/null))" | tee -a "$OUT/ab.txt"
    mkdir -p "/tmp/ab_$side$r"
    python3 benchmarks/bench_gpu.py --issue22 --reps 50 --out "/tmp/ab_$side$r" 2>&1 | grep -v '^ \|^{\|^}' |
      tee -a "$OUT/ab.txt"
  done
done
tar -czf "$OUT/ab_runs.tar.gz" -C /tmp $(cd /tmp && ls -d ab_A* ab_B*)
