#!/usr/bin/env bash
# CUDA build check for machines without a GPU (compile and link only; nothing runs on a GPU).
#
#  (a) When a CUDA-13 torch can be installed into a separate virtualenv (never the system
#      Python, which keeps its CPU torch), build pagedkv with PAGEDKV_BUILD=cuda there, import
#      it (works without a GPU) and check that the CUDA kernels are registered.
#  (b) Otherwise compile every csrc/cuda/*.cu with nvcc for sm_80, sm_90a and sm_100a.
#  Then, either way, build and run the host checks of the tile index math (tests/cuda_host), and
#  check that the sm_100a code really contains the TMA gather4 load: grep
#  the PTX for tile::gather4, and count the UTMALDG words with the gather4 mode bit in the
#  sm_100a cubin (.ci/sass_tma_count.py decodes the ELF; cuobjdump is not installed here);
#  and that flash_attn_paged_sparse's tiled kernels hold their loader's instructions:
#  UTMALDG.2D.GATHER4 in every gather4 kernel on sm_100a, LDGSTS (cp.async) in every
#  cp.async kernel on sm_80 and sm_90a.
#
# Environment: PAGEDKV_CUDA_VENV (default /tmp/pagedkv-cuda-venv), PAGEDKV_CUDA_SRC (default
# /tmp/pagedkv-cuda-src: a copy of the tree so the checkout's own CPU build is untouched;
# its build/ is kept between runs, so unchanged files are not recompiled),
# PAGEDKV_TORCH_WHEEL (a local torch wheel to prefer), CUDA_HOME, MAX_JOBS (default 2),
# PAGEDKV_CUDA_CHECK_MODE=auto|venv|nvcc.
# Exit 0 when every check passed (or when there is no nvcc at all: then it says so and skips).
#
# Measured on the shared 2-core dev machine (load 6-9 from other builds), nvcc 13.0:
#   (a) cold (new venv + full build): 54 min wall, 32 min CPU; the four torch shims
#       (ATen headers, C++20) are ~25 CPU-min of that, the .cu files ~4 CPU-min for 3 targets
#   (a) warm (venv and build/ kept, no source change): 74 s
#   (b) PAGEDKV_CUDA_CHECK_MODE=nvcc: 5 min wall, 3.4 min CPU
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${PAGEDKV_CUDA_VENV:-/tmp/pagedkv-cuda-venv}
SRC=${PAGEDKV_CUDA_SRC:-/tmp/pagedkv-cuda-src}
WORK=${PAGEDKV_CUDA_WORK:-/tmp/pagedkv-cuda-check}
WHEEL=${PAGEDKV_TORCH_WHEEL:-/opt/pypi-more/files/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl}
MODE=${PAGEDKV_CUDA_CHECK_MODE:-auto}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export MAX_JOBS=${MAX_JOBS:-2}
NVCC_FLAGS=(-std=c++17 -O3)
TARGETS=(80 90a 100a)
START=$(date +%s)
FAILED=0

say() { echo "[cuda-check $(($(date +%s) - START))s] $*"; }
fail() { say "FAIL: $*"; FAILED=1; }

if ! command -v nvcc >/dev/null 2>&1; then
  say "SKIP: no nvcc (CUDA_HOME=$CUDA_HOME); nothing to compile"
  exit 0
fi
say "nvcc: $(nvcc --version | tail -1)"
mkdir -p "$WORK"

# ---------------------------------------------------------------- (a) venv with a CUDA torch
venv_torch_cuda() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" \
    >/dev/null 2>&1
}

setup_venv() {
  if venv_torch_cuda; then
    say "reusing $VENV"
    return 0
  fi
  say "creating $VENV (CUDA torch; the system Python is not touched)"
  python3 -m venv "$VENV" || return 1
  local torch_req=torch
  [ -f "$WHEEL" ] && torch_req=$WHEEL
  "$VENV/bin/pip" install --quiet "$torch_req" numpy pytest ninja >"$WORK/venv-install.log" 2>&1 || {
    tail -5 "$WORK/venv-install.log"
    return 1
  }
  venv_torch_cuda
}

sync_source() {
  # tracked and untracked-but-not-ignored files, mtimes kept (so ninja rebuilds only what changed)
  mkdir -p "$SRC"
  find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
  (cd "$ROOT" && git ls-files -co --exclude-standard | tar -cf - -T -) | tar -C "$SRC" -xf -
}

check_venv_build() {
  sync_source
  say "building pagedkv with PAGEDKV_BUILD=cuda MAX_JOBS=$MAX_JOBS in $SRC"
  if ! (cd "$SRC" && PAGEDKV_BUILD=cuda "$VENV/bin/pip" install --no-build-isolation --no-deps -v . \
    >"$WORK/build.log" 2>&1); then
    grep -E "error|Error" "$WORK/build.log" | head -20
    fail "CUDA build of the extension (log: $WORK/build.log)"
    return 1
  fi
  say "build ok"
  (cd "$WORK" && "$VENV/bin/python" - <<'EOF'
import sys
import torch
import pagedkv
from pagedkv import _C

print(f"torch {torch.__version__} cuda {torch.version.cuda}; pagedkv with_cuda={_C.with_cuda}; "
      f"cuda available={torch.cuda.is_available()}")
ok = bool(_C.with_cuda)
for op in ["paged_store", "paged_load", "flash_attn_paged", "flash_attn_paged.out", "flash_attn_paged_sparse",
           "debug_load_tile"]:
    has = torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedkv::{op}", "CUDA")
    print(f"  pagedkv::{op:22s} CUDA kernel registered: {has}")
    ok &= has
for op in ["paged_store", "paged_load", "flash_attn_paged", "flash_attn_paged.out"]:
    ok &= torch._C._dispatch_has_kernel_for_dispatch_key(f"pagedkv::{op}", "CPU")
sys.exit(0 if ok else 1)
EOF
  ) || fail "CUDA kernels not registered"
  # what the fat binary holds, per target (cubins are listed by the ELF notes of the .so)
  local so
  so=$(find "$SRC/build" -name "_C*.so" | head -1)
  [ -n "$so" ] && say "extension: $so ($(du -h "$so" | cut -f1))"
}

# ---------------------------------------------------------------- (b) nvcc per target
check_nvcc_compile() {
  # one nvcc per (file, target), MAX_JOBS at a time
  local jobs="$WORK/nvcc-jobs.txt"
  : >"$jobs"
  for f in "$ROOT"/csrc/cuda/*.cu; do
    for t in "${TARGETS[@]}"; do
      echo "$f $t" >>"$jobs"
    done
  done
  export WORK
  export NVCC_FLAGS_STR="${NVCC_FLAGS[*]}"
  xargs -P "$MAX_JOBS" -L 1 bash -c '
    f=$0; t=$1; out="$WORK/$(basename "$f" .cu)_sm_$t.o"
    if nvcc $NVCC_FLAGS_STR -gencode="arch=compute_$t,code=sm_$t" -c "$f" -o "$out" >"$out.log" 2>&1; then
      echo "compiled $(basename "$f") for sm_$t"
    else
      echo "FAILED $(basename "$f") for sm_$t"; head -20 "$out.log"
    fi' <"$jobs" | tee "$WORK/nvcc.log" | sed "s/^/[cuda-check] /"
  if grep -q "^FAILED" "$WORK/nvcc.log"; then
    fail "nvcc compile (see $WORK/*.o.log)"
  else
    say "all $(wc -l <"$jobs") nvcc compiles passed"
  fi
}

# The torch shims (csrc/torch/*.cpp, ops_cuda.cpp included) are built only where a CUDA torch is:
# without one (nvcc mode), check that they at least compile against that torch's headers, taken
# from the local CUDA torch wheel (its torch/include, extracted once into $WORK), C++ syntax only:
# 6 files, ~1.5 min on 2 cores.
check_shim_syntax() {
  if [ ! -f "$WHEEL" ]; then
    say "SKIP torch shim syntax check: no CUDA torch wheel at $WHEEL"
    return
  fi
  local inc="$WORK/torch-headers" py_inc f
  if [ ! -f "$inc/torch/include/torch/library.h" ]; then
    python3 -c "import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('torch/include/')])" "$WHEEL" "$inc" ||
      { fail "extracting torch/include from $WHEEL"; return; }
  fi
  py_inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  for f in "$ROOT"/csrc/torch/*.cpp; do
    if ! g++ -fsyntax-only -std=c++20 -fPIC -I"$inc/torch/include" -I"$inc/torch/include/torch/csrc/api/include" \
      -I"$CUDA_HOME/include" -I"$py_inc" -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=1 "$f" \
      >"$WORK/shim_$(basename "$f").log" 2>&1; then
      fail "$(basename "$f") does not compile against $(basename "$WHEEL")'s headers"
      head -20 "$WORK/shim_$(basename "$f").log"
    fi
  done
  say "torch shims: $(ls "$ROOT"/csrc/torch/*.cpp | wc -l) files checked against $(basename "$WHEEL")'s headers"
}

case "$MODE" in
venv)
  setup_venv || { fail "could not install a CUDA torch into $VENV"; exit 1; }
  check_venv_build
  ;;
nvcc)
  check_nvcc_compile
  check_shim_syntax
  ;;
*)
  if setup_venv; then
    check_venv_build
  else
    say "no CUDA torch could be installed into $VENV: compiling the .cu files with nvcc only"
    check_nvcc_compile
    check_shim_syntax
  fi
  ;;
esac

# ---------------------------------------------------------------- host checks of the tile index math
# tests/cuda_host/test_*.cu: host programs over csrc/cuda's __host__ __device__ index helpers (the
# device code in the headers is compiled for sm_90a and never run)
for t in "$ROOT"/tests/cuda_host/test_*.cu; do
  exe="$WORK/$(basename "$t" .cu)"
  if nvcc "${NVCC_FLAGS[@]}" -gencode=arch=compute_90a,code=sm_90a -I"$ROOT/csrc/cuda" "$t" -o "$exe" &&
    "$exe" | sed "s/^/    /"; then
    say "$(basename "$t"): passed"
  else
    fail "$(basename "$t")"
  fi
done

# ---------------------------------------------------------------- gather4 really in the sm_100a code
say "checking the sm_100a code for TMA gather4"
nvcc "${NVCC_FLAGS[@]}" -gencode=arch=compute_100a,code=compute_100a -ptx "$ROOT/csrc/cuda/flash_attn_paged.cu" \
  -o "$WORK/flash_attn_paged_100a.ptx" || fail "PTX of flash_attn_paged.cu for compute_100a"
n_attn=$(grep -c "cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4" "$WORK/flash_attn_paged_100a.ptx" || true)
say "flash_attn_paged.cu compute_100a PTX: $n_attn tile::gather4 loads"
grep -m1 "tile::gather4" "$WORK/flash_attn_paged_100a.ptx" | sed 's/^\s*/    /'
[ "${n_attn:-0}" -gt 0 ] || fail "no tile::gather4 in the sm_100a PTX of flash_attn_paged"
for t in 100a 90a; do
  nvcc "${NVCC_FLAGS[@]}" -gencode="arch=compute_$t,code=sm_$t" -cubin "$ROOT/csrc/cuda/debug_tile.cu" \
    -o "$WORK/debug_tile_sm_$t.cubin" || fail "cubin of debug_tile.cu for sm_$t"
done
# gather4 kernel (template loader 2) on sm_100a: every UTMALDG has the gather4 bit;
# TMA-pages kernel (loader 1) on sm_90a: UTMALDG without it.
g4=$(python3 "$ROOT/.ci/sass_tma_count.py" "$WORK/debug_tile_sm_100a.cubin" "Li2EEEv" | awk '/TOTAL/ {print $1, $2}')
pg=$(python3 "$ROOT/.ci/sass_tma_count.py" "$WORK/debug_tile_sm_90a.cubin" "Li1EEEv" | awk '/TOTAL/ {print $1, $2}')
say "sm_100a cubin, gather4 debug kernels: UTMALDG words / with gather4 bit = $g4"
say "sm_90a cubin, tma-pages debug kernels: UTMALDG words / with gather4 bit = $pg"
read -r g4_all g4_bit <<<"$g4"
read -r pg_all pg_bit <<<"$pg"
if [ "${g4_all:-0}" -gt 0 ] && [ "$g4_all" = "$g4_bit" ] && [ "${pg_all:-0}" -gt 0 ] && [ "${pg_bit:-1}" = 0 ]; then
  say "gather4 present in the sm_100a SASS, absent from the sm_90a TMA loads"
else
  fail "unexpected TMA instruction counts"
fi

# ---------------------------------------------------------------- the sparse kernel's loaders in SASS
# flash_attn_paged_sparse.cu: every tiled gather4 kernel (template loader 2) on sm_100a holds
# UTMALDG words, all with the gather4 bit; every tiled cp.async kernel (loader 0) on sm_80 and
# sm_90a holds LDGSTS (cp.async) words and no TMA load. Kernels are picked by their mangled name:
# sparse_tiled_kernel<D, Dv, dtype, loader, tail>(pkv::TiledParams, ...) (TiledParams: flash_attn_sparse.cuh;
# tail: 64 for packed MLA rows, else 0).
say "checking the sparse kernel's SASS (gather4 on sm_100a, cp.async on sm_80 / sm_90a)"
sparse_sass() {  # $1 target, $2 loader template argument, $3 what each kernel must show
  local t=$1 loader=$2 want=$3 cubin="$WORK/flash_attn_paged_sparse_sm_$1.cubin" lines
  if ! nvcc "${NVCC_FLAGS[@]}" -gencode="arch=compute_$t,code=sm_$t" -cubin \
    "$ROOT/csrc/cuda/flash_attn_paged_sparse.cu" -o "$cubin"; then
    fail "cubin of flash_attn_paged_sparse.cu for sm_$t"
    return
  fi
  lines=$(python3 "$ROOT/.ci/sass_tma_count.py" "$cubin" sparse_tiled_kernel "Li${loader}ELi" "EEEvNS_11TiledParams" |
    grep -v TOTAL)
  local n bad
  n=$(echo "$lines" | grep -c . || true)
  case "$want" in
  gather4) bad=$(echo "$lines" | awk '$1 == 0 || $1 != $2' | grep -c . || true) ;;
  cp.async) bad=$(echo "$lines" | awk '$3 == 0 || $1 != 0' | grep -c . || true) ;;
  esac
  say "sm_$t, $n sparse $want kernels (UTMALDG / with gather4 bit / LDGSTS per kernel):" \
    "$(echo "$lines" | awk '{print $1 "/" $2 "/" $3}' | sort | uniq -c | awk '{print $2 " x" $1}' | tr '\n' ' ')"
  if [ "${n:-0}" -eq 0 ] || [ "${bad:-1}" != 0 ]; then
    fail "sparse $want kernels on sm_$t: $bad of $n without the expected instructions"
  fi
}
sparse_sass 100a 2 gather4
sparse_sass 90a 0 cp.async
sparse_sass 80 0 cp.async

# ---------------------------------------------------------------- the warpgroup-MMA kernels in SASS
# flash_attn_paged.cu on sm_90a: every warpgroup kernel (attn_kernel<..., kWgmma = true>: mangled names
# ending Lb1EEEv) holds HGMMA words and spills nothing, no other attention kernel holds any, and ptxas
# reports no serialised warpgroup MMAs (its warning when accumulators are touched between issue and wait).
say "checking the dense kernel's sm_90a SASS (HGMMA in the warpgroup kernels, no spills, no serialisation)"
wg_cubin="$WORK/flash_attn_paged_sm_90a.cubin"
if nvcc "${NVCC_FLAGS[@]}" -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -cubin \
  "$ROOT/csrc/cuda/flash_attn_paged.cu" -o "$wg_cubin" >"$WORK/flash_attn_paged_90a_ptxas.log" 2>&1; then
  grep -i "wgmma" "$WORK/flash_attn_paged_90a_ptxas.log" | grep -i "warn" | head -3
  grep -i "wgmma" "$WORK/flash_attn_paged_90a_ptxas.log" | grep -qi "warn" && fail "ptxas warns about warpgroup MMAs"
  wg_spills=$(python3 - "$WORK/flash_attn_paged_90a_ptxas.log" <<'PY'
import re, sys
entry, bad = None, 0
for line in open(sys.argv[1]):
    m = re.search(r"Compiling entry function '(\S+)'", line)
    if m:
        entry = m.group(1)
    elif entry and "attn_kernel" in entry and "Lb1EEEv" in entry and "spill" in line:
        bad += not re.search(r"0 bytes spill stores, 0 bytes spill loads", line)
print(bad)
PY
)
  wg_lines=$(python3 "$ROOT/.ci/sass_tma_count.py" "$wg_cubin" attn_kernel | grep -v TOTAL)
  wg_n=$(echo "$wg_lines" | grep -c "Lb1EEEv" || true)
  wg_bad=$(echo "$wg_lines" | grep "Lb1EEEv" | awk '$4 == 0' | grep -c . || true)
  other_bad=$(echo "$wg_lines" | grep -v "Lb1EEEv" | awk '$4 != 0' | grep -c . || true)
  say "sm_90a: $wg_n warpgroup kernels, HGMMA per kernel: $(echo "$wg_lines" | grep "Lb1EEEv" | awk '{print $4}' |
    sort -n | uniq -c | awk '{print $2 " x" $1}' | tr '\n' ' '); $wg_bad without; $other_bad other kernels with;" \
    "$wg_spills spilling"
  if [ "${wg_n:-0}" -eq 0 ] || [ "${wg_bad:-1}" != 0 ] || [ "${other_bad:-1}" != 0 ] || [ "${wg_spills:-1}" != 0 ]; then
    fail "warpgroup kernels on sm_90a"
  fi
else
  fail "cubin of flash_attn_paged.cu for sm_90a"
  tail -20 "$WORK/flash_attn_paged_90a_ptxas.log"
fi
# the device programs (tests/cuda_device, run by benchmarks/gpu_run.sh on a GPU) compile for sm_90a
for t in "$ROOT"/tests/cuda_device/test_*.cu; do
  nvcc "${NVCC_FLAGS[@]}" -gencode=arch=compute_90a,code=sm_90a -I"$ROOT/csrc/cuda" "$t" \
    -o "$WORK/$(basename "$t" .cu)" >"$WORK/$(basename "$t" .cu).log" 2>&1 &&
    say "$(basename "$t"): compiled for sm_90a (runs on a GPU: benchmarks/gpu_run.sh test)" ||
    fail "$(basename "$t") does not compile (see $WORK/$(basename "$t" .cu).log)"
done

say "total $(($(date +%s) - START)) s"
if [ "$FAILED" = 0 ]; then
  say "PASS"
else
  say "FAILED"
fi
exit "$FAILED"
