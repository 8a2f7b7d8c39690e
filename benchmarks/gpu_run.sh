#!/usr/bin/env bash
# One call on a GPU machine: build pagedkv for CUDA, run the device programs (tests/cuda_device) and the
# whole test suite on CUDA,
# compute-sanitizer memcheck on the CUDA tests, SASS evidence of the TMA and cp.async loads
# (dense and sparse kernels), and the decode/prefill/store/load/sparse benchmark grid. Everything lands in $OUT (default
# benchmarks/results/gpu-<date>; at most 8 files, the device tool's limit) and the benchmark
# tables are copied to benchmarks/results/.
#
#   bash benchmarks/gpu_run.sh [all|build|test|memcheck|racecheck|sass|bench|profile]...   (default: all)
#
# `all` is build, test, bench, memcheck (in that order, the most telling first); sass (it compiles
# every target, minutes of device time; .ci/cuda_build_check.sh does the same check on any machine
# with nvcc), racecheck (racecheck and synccheck on the FP8 decode key split, whose warps sync on their
# own rows) and profile (Nsight Compute on the attention kernels) only when named. Each stage has a time
# limit (seconds; env GPU_T_TEST, GPU_T_BENCH, GPU_T_MEMCHECK, GPU_T_RACECHECK), so one call fits the
# device tool's 10 minutes and what a stage measured before its
# limit still lands in $OUT: pytest's log streams there, the benchmark rewrites its table per row.
# Uses the machine's python3 (a CUDA torch); builds in place into python/pagedkv/.
# Prebuilt: an extension built elsewhere against the same torch (benchmarks/gpu_prebuild.sh) waits in
# .gpu_prebuilt/ (carried, not tracked); the build stage uses it when its record names this torch, every
# source file it was built from is unchanged in this tree and it imports with CUDA, and compiles (nproc
# jobs) otherwise.
# PAGEDKV_CUDA_ARCHS narrows the targets (default: the device's own, e.g. 90a on H100).
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
BROKEN_PATHS=()  # opt-in kernel paths whose device program or tests failed in this call
[ ${#STAGES[@]} -eq 0 ] && STAGES=(all)
want() {
  for s in "${STAGES[@]}"; do
    [ "$s" = "$1" ] && return 0
    [ "$s" = all ] && [ "$1" != sass ] && [ "$1" != profile ] && [ "$1" != racecheck ] && return 0
  done
  return 1
}
has_module() { $PY -c "import $1" >/dev/null 2>&1; }
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

# Test dependencies the machine lacks or holds at an untested version (e.g. transformers: the
# suite tests pagedkv.hf with the lines in pagedkv/hf/compat.py TESTED_VERSIONS) travel as wheels in
# .whl/ (carried, not tracked; the device tool's README says how to fetch them for Python 3.12).
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

log "device: $(nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1)"
nvidia-smi >>"$OUT/gpu_run.log" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  2>&1 | tee -a "$OUT/gpu_run.log"

cuda_import_ok() {
  $PY -c "import pagedkv, torch, sys; from pagedkv import _C; sys.exit(0 if _C.with_cuda and torch.cuda.is_available() else 1)" \
    >>"$OUT/gpu_run.log" 2>&1
}

use_prebuilt() {  # the extension as gpu_prebuild.sh leaves it (gzipped; a plain .so is taken too)
  local so
  so=$(ls .gpu_prebuilt/_C.cpython-*.so* 2>/dev/null | head -1)
  [ -n "$so" ] && [ -f .gpu_prebuilt/_build_config.py ] || return 1
  if [ ! -f .gpu_prebuilt/sources.sha256 ]; then
    log "prebuilt extension has no record of its sources (gpu_prebuild.sh before 2026-11-27 evening): building"
    return 1
  fi
  local changed
  changed=$(sha256sum -c --quiet .gpu_prebuilt/sources.sha256 2>/dev/null | head -5 | tr '\n' ' ')
  if [ -n "$changed" ]; then
    log "prebuilt extension was built from other sources (${changed}...): building"
    return 1
  fi
  grep -q "TORCH_VERSION = '$($PY -c 'import torch; print(torch.__version__)')'" .gpu_prebuilt/_build_config.py || {
    log "prebuilt extension is for another torch: $(grep TORCH_VERSION .gpu_prebuilt/_build_config.py)"
    return 1
  }
  case "$so" in
  *.gz) gunzip -c "$so" >"python/pagedkv/$(basename "${so%.gz}")" ;;
  *) cp "$so" python/pagedkv/ ;;
  esac
  cp .gpu_prebuilt/_build_config.py python/pagedkv/
  cuda_import_ok || { log "prebuilt extension did not import with CUDA"; return 1; }
  log "build: prebuilt $(basename "$so") ($(cat .gpu_prebuilt/commit 2>/dev/null))"
  PAGEDKV_BENCH_COMMIT="$(cat .gpu_prebuilt/commit 2>/dev/null)" && export PAGEDKV_BENCH_COMMIT
}

if want build && ! use_prebuilt; then
  ARCHS=${PAGEDKV_CUDA_ARCHS:-$(device_arch)}
  log "build: PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS"
  PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    $PY setup.py build_clib build_ext --inplace >"$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"
    log "build FAILED"
    exit 1
  }
fi
if want build; then
  $PY -c "import pagedkv, torch; from pagedkv import _C; print('with_cuda', _C.with_cuda, 'loaders', \
[(n, _C.cuda_loader_available(0, i)) for i, n in enumerate(_C.cuda_loader_names)])" 2>&1 | tee -a "$OUT/gpu_run.log"
fi

if want test; then
  # device programs first (seconds each): tests/cuda_device/test_*.cu, built for the device's arch against
  # csrc/cuda's headers (e.g. the warpgroup MMAs on the attention kernel's tiles, with a diagnosis on failure)
  arch=$(device_arch)
  for t in tests/cuda_device/test_*.cu; do
    exe="/tmp/$(basename "$t" .cu)"
    if nvcc -std=c++17 -O3 -gencode="arch=compute_$arch,code=sm_$arch" -Icsrc/cuda "$t" -o "$exe" >>"$OUT/gpu_run.log" 2>&1; then
      "$exe" 2>&1 | tee -a "$OUT/gpu_run.log"
      rc=${PIPESTATUS[0]}
      log "$(basename "$t"): exit code $rc"
    else
      rc=compile
      log "$(basename "$t"): does not compile (gpu_run.log)"
    fi
    # the warpgroup products wrong on their own tiles: the warpgroup path's kernels cannot be right either
    # (and may fault, which ends the process that ran them), so its tests and rows give the time to the rest
    [ "$(basename "$t")" = test_wgmma_tiles.cu ] && [ "$rc" != 0 ] && BROKEN_PATHS+=(wgmma)
  done
  # the opt-in kernel paths' tests first (each path waits for its first GPU run: csrc/cuda/README.md), so
  # their verdict lands even if the suite stops at its limit; GPU_OPTIN_K names them (pytest -k)
  OPTIN_K=${GPU_OPTIN_K:-"wgmma or fp8_rows"}
  for broken in "${BROKEN_PATHS[@]}"; do OPTIN_K="($OPTIN_K) and not $broken"; done
  log "opt-in paths: pytest tests/ops -k '$OPTIN_K' (limit ${GPU_T_OPTIN:-120}s)"
  OMP_NUM_THREADS=2 timeout "${GPU_T_OPTIN:-120}" $PY -m pytest tests/ops -q -rfEs -p no:cacheprovider -k "$OPTIN_K" \
    $(has_module xdist && echo "-n ${GPU_TEST_WORKERS:-8}") >"$OUT/pytest.txt" 2>&1
  log "opt-in pytest exit code $?: $(tail -1 "$OUT/pytest.txt")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20
  # a path with a failing test is not timed (bench_gpu.py's PAGEDKV_BENCH_SKIP_PATHS)
  for path in wgmma fp8_rows; do
    grep -qE "^(FAILED|ERROR).*$path" "$OUT/pytest.txt" && BROKEN_PATHS+=("$path")
  done
  # the existing attention tests' CUDA cases with the warpgroup path on for the whole process (where the
  # device runs it; calls whose rows fill 64-row tiles at D 64 / 128 then take it)
  WG_TESTS="tests/ops/test_flash_attn_paged.py tests/ops/test_flash_attn_paged_kernel_paths.py
    tests/ops/test_flash_attn_paged_lse.py tests/ops/test_flash_attn_paged_masked.py"
  if [[ " ${BROKEN_PATHS[*]} " == *" wgmma "* ]]; then
    log "attention tests on the warpgroup path: not run (its device test or its own tests failed)"
  else
    echo "---- PAGEDKV_CUDA_PREFILL_WGMMA=1: the attention tests' CUDA cases ----" >>"$OUT/pytest.txt"
    # shellcheck disable=SC2086
    PAGEDKV_CUDA_PREFILL_WGMMA=1 OMP_NUM_THREADS=2 timeout "${GPU_T_OPTIN:-120}" $PY -m pytest $WG_TESTS -q -rfEs \
      -p no:cacheprovider -k cuda $(has_module xdist && echo "-n ${GPU_TEST_WORKERS:-8}") >>"$OUT/pytest.txt" 2>&1
    log "attention tests on the warpgroup path: exit code $?: $(tail -1 "$OUT/pytest.txt")"
  fi
  export PAGEDKV_BENCH_SKIP_PATHS="${BROKEN_PATHS[*]}"
  [ -n "$PAGEDKV_BENCH_SKIP_PATHS" ] && log "opt-in paths not timed: $PAGEDKV_BENCH_SKIP_PATHS"
  echo "---- the whole suite ----" >>"$OUT/pytest.txt"
  # the whole suite (vLLM's own tests need vLLM's venv: scripts/test_vllm.sh); xdist workers when the
  # machine has pytest-xdist (each with 2 CPU threads), a per-test limit when it has pytest-timeout
  # (a hung kernel then fails its test instead of the stage)
  PAR=()
  has_module xdist && PAR+=(-n "${GPU_TEST_WORKERS:-8}")
  SUITE_K=""  # a broken opt-in path's tests would only repeat its failures (or fault the workers running them)
  for broken in "${BROKEN_PATHS[@]}"; do SUITE_K="${SUITE_K:+$SUITE_K and }not $broken"; done
  [ -n "$SUITE_K" ] && PAR+=(-k "$SUITE_K")
  has_module pytest_timeout && PAR+=(--timeout "${GPU_TEST_TIMEOUT:-180}")
  log "tests: pytest tests/ ${PAR[*]} (CUDA and CPU cases; limit ${GPU_T_TEST:-300}s)"
  OMP_NUM_THREADS=2 timeout "${GPU_T_TEST:-300}" $PY -m pytest tests/ -v -rfEs -p no:cacheprovider \
    --ignore=tests/vllm_integration "${PAR[@]}" >>"$OUT/pytest.txt" 2>&1
  log "pytest exit code $?: $(tail -1 "$OUT/pytest.txt")"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -40
fi

if want bench; then
  log "benchmarks: benchmarks/bench_gpu.py ${GPU_BENCH_ARGS:---issue22 --reps 50} (limit ${GPU_T_BENCH:-150}s)"
  # shellcheck disable=SC2086
  timeout "${GPU_T_BENCH:-150}" $PY benchmarks/bench_gpu.py --out "$OUT" ${GPU_BENCH_ARGS:---issue22 --reps 50} \
    >"$OUT/bench.txt" 2>&1
  log "bench exit code $?"
  grep -v '^ ' "$OUT/bench.txt" | tail -25
  mkdir -p benchmarks/results
  cp "$OUT"/bench_gpu*.json "$OUT"/bench_gpu*.md benchmarks/results/ 2>/dev/null || true
fi

if want racecheck; then
  # shared-memory hazards and barrier misuse of the FP8 decode key split's K fragments (a warp barrier
  # where a block barrier was): compute-sanitizer's racecheck (it sees threads' shared stores and loads, not TMA's
  # writes) and synccheck, on a few of its cases
  RACE_K="k_fragments and 128-16 and not e5m2 and not e4m3fn-float16"  # D 128, page 16
  log "compute-sanitizer racecheck and synccheck on -k '$RACE_K' (limit ${GPU_T_RACECHECK:-120}s each)"
  if command -v compute-sanitizer >/dev/null; then
    for tool in racecheck synccheck; do
      timeout "${GPU_T_RACECHECK:-120}" compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 \
        $PY -m pytest -v -p no:cacheprovider -k "$RACE_K" tests/ops/test_flash_attn_paged_kernel_paths.py \
        >>"$OUT/sanitize.txt" 2>&1
      log "$tool exit code $? (99: hazards found, 124: its limit); $(tail -1 "$OUT/sanitize.txt")"
    done
    grep -m 10 -B2 -A8 "Race reported\|Barrier error\|ERROR SUMMARY" "$OUT/sanitize.txt" | head -60
  else
    log "compute-sanitizer not found"
  fi
fi

MEMCHECK_TESTS="tests/ops/test_kv_format_cuda_kernels.py tests/ops/test_kv_format.py
  tests/ops/test_flash_attn_paged_kernel_paths.py tests/ops/test_paged_store.py tests/ops/test_paged_load.py
  tests/ops/test_flash_attn_paged_sparse_kernel_paths.py tests/ops/test_merge_attn_states.py
  tests/ops/test_flash_attn_paged_lse.py tests/ops/test_flash_attn_paged.py"
if want memcheck; then
  # the packed-row (kv_format) and MLA kernels first (the newest), then the kernel-path tests: every
  # loader at >= 4 key tiles per CTA (the long cases), then the op grids; graphs excluded (the
  # sanitizer serialises launches)
  log "compute-sanitizer memcheck on CUDA cases (limit ${GPU_T_MEMCHECK:-120}s)"
  if command -v compute-sanitizer >/dev/null; then
    # GPU_MEMCHECK_TESTS (pytest paths) replaces the list, e.g. "tests" for the whole suite's CUDA cases in
    # a call of its own with GPU_T_MEMCHECK near the device tool's 10 minutes
    # cases benchmarks/results/memcheck_ledger.json holds clean at this tree's sources are skipped
    # (GPU_MEMCHECK_LEDGER=0 runs them too); after the call, `memcheck_ledger.py record` adds this run's
    # shellcheck disable=SC2086
    PYTHONPATH="$ROOT/benchmarks:$PYTHONPATH" timeout "${GPU_T_MEMCHECK:-120}" \
      compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
      $PY -m pytest -v -p no:cacheprovider $([ "${GPU_MEMCHECK_LEDGER:-1}" = 1 ] && echo "-p memcheck_ledger") \
      -k "cuda and not graph" ${GPU_MEMCHECK_TESTS:-$MEMCHECK_TESTS} >"$OUT/memcheck.txt" 2>&1
    log "memcheck exit code $? (124: stopped at its limit); $(grep -c 'Invalid' "$OUT/memcheck.txt") invalid accesses;" \
      "$(grep -c PASSED "$OUT/memcheck.txt") cases passed under it, $(grep -c FAILED "$OUT/memcheck.txt") failed"
    grep -m 10 -B2 -A8 "Invalid\|ERROR SUMMARY" "$OUT/memcheck.txt" | head -60
  else
    log "compute-sanitizer not found"
  fi
fi

if want profile; then
  # Nsight Compute on the attention kernel of benchmarks/gpu_profile.py (decode bf16, decode e4m3,
  # prefill): speed of light, occupancy, warp stall reasons, scheduler and memory sections, and the
  # per-instruction source counters (the build carries -lineinfo). --clock-control none: the card's
  # clocks are left as they are.
  log "ncu on gpu_profile.py's attention kernels (limit ${GPU_T_PROFILE:-150}s)"
  timeout "${GPU_T_PROFILE:-150}" ncu --clock-control none -k regex:attn_kernel -c 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    -f -o "$OUT/profile" $PY benchmarks/gpu_profile.py >"$OUT/ncu_run.txt" 2>&1
  log "ncu exit code $?"
  tail -3 "$OUT/ncu_run.txt"
  ncu -i "$OUT/profile.ncu-rep" --page details >"$OUT/ncu_details.txt" 2>&1
  ncu -i "$OUT/profile.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/ncu_source_sass.csv.gz"
  grep -E "attn_kernel|Duration|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Stall|Memory Throughput|Compute \(SM\)" \
    "$OUT/ncu_details.txt" | head -60
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

log "done: $OUT"
