#!/usr/bin/env bash
# One call on a GPU machine: build pagedkv for CUDA, run the whole test suite on CUDA,
# compute-sanitizer memcheck on the CUDA tests, SASS evidence of the TMA and cp.async loads
# (dense and sparse kernels), and the decode/prefill/store/load/sparse benchmark grid. Everything lands in $OUT (default
# benchmarks/results/gpu-<date>; at most 8 files, the device tool's limit) and the benchmark
# tables are copied to benchmarks/results/.
#
#   bash benchmarks/gpu_run.sh [all|build|test|memcheck|sass|bench]...   (default: all)
#
# Stages can be run one per call (each well under 10 minutes on a 16-core H100 machine).
# Uses the machine's python3 (a CUDA torch); builds in place into python/pagedkv/.
# PAGEDKV_CUDA_ARCHS narrows the targets (default: the device's own, e.g. 90a on H100,
# plus the three shipped targets for the sass stage).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/benchmarks/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(all)
want() { for s in "${STAGES[@]}"; do [ "$s" = all ] || [ "$s" = "$1" ] && return 0; done; return 1; }
log() { echo "[gpu_run $(date +%H:%M:%S)] $*" | tee -a "$OUT/gpu_run.log"; }

device_arch() {
  # 9.0 -> 90a, 10.0 -> 100a, 8.x -> 80
  local cc
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  case "$cc" in
  9.0) echo 90a ;;
  10.*) echo 100a ;;
  *) echo 80 ;;
  esac
}

log "device: $(nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1)"
nvidia-smi >>"$OUT/gpu_run.log" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  2>&1 | tee -a "$OUT/gpu_run.log"

if want build; then
  ARCHS=${PAGEDKV_CUDA_ARCHS:-$(device_arch)}
  log "build: PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS"
  PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS MAX_JOBS=${MAX_JOBS:-16} \
    $PY setup.py build_clib build_ext --inplace >"$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"
    log "build FAILED"
    exit 1
  }
  $PY -c "import pagedkv, torch; from pagedkv import _C; print('with_cuda', _C.with_cuda, 'loaders', \
[(n, _C.cuda_loader_available(0, i)) for i, n in enumerate(_C.cuda_loader_names)])" 2>&1 | tee -a "$OUT/gpu_run.log"
fi

if want test; then
  log "tests: pytest tests/ (CUDA tests run, CPU tests too)"
  $PY -m pytest tests/ -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -30
fi

if want memcheck; then
  log "compute-sanitizer memcheck on the CUDA cases of tests/ops (graphs excluded: the sanitizer serialises launches)"
  if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
      $PY -m pytest tests/ops -q -x -p no:cacheprovider -k "cuda and not graph and not long_decode" \
      >"$OUT/memcheck.txt" 2>&1
    log "memcheck exit code $? ($(grep -c 'Invalid' "$OUT/memcheck.txt") invalid accesses reported)"
    tail -5 "$OUT/memcheck.txt"
  else
    log "compute-sanitizer not found"
  fi
fi

if want sass; then
  log "SASS of the shipped targets (cuobjdump): TMA and cp.async loads per target, dense and sparse kernels"
  for a in 80 90a 100a; do
    for f in flash_attn_paged flash_attn_paged_sparse; do
      nvcc -std=c++17 -O3 -gencode=arch=compute_$a,code=sm_$a -cubin -o "$OUT/${f}_sm_$a.cubin" \
        csrc/cuda/$f.cu 2>>"$OUT/gpu_run.log" || continue
      cuobjdump --dump-sass "$OUT/${f}_sm_$a.cubin" >"$OUT/sass_${f}_$a.txt" 2>&1
      log "$f sm_$a: $(grep -o 'UTMALDG[.A-Z0-9]*\|LDGSTS[.A-Z0-9]*' "$OUT/sass_${f}_$a.txt" | sort | uniq -c | tr '\n' ' ')"
      rm -f "$OUT/${f}_sm_$a.cubin"
    done
  done
  cat "$OUT"/sass_*.txt | gzip >"$OUT/sass.txt.gz" && rm -f "$OUT"/sass_*.txt
fi

if want bench; then
  log "benchmarks: benchmarks/bench_gpu.py"
  $PY benchmarks/bench_gpu.py --out "$OUT" 2>&1 | tee "$OUT/bench.txt" | tail -60
  mkdir -p benchmarks/results
  cp "$OUT"/bench_gpu*.json "$OUT"/bench_gpu*.md benchmarks/results/ 2>/dev/null || true
fi
log "done: $OUT"
