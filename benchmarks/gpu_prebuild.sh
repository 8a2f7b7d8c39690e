#!/usr/bin/env bash
# Build the CUDA extension on this machine for the lent GPU machine, so a device call spends no
# device time compiling (a cold build of the torch shims takes minutes even on 16 cores).
# The lent machine runs Python 3.12 with torch 2.11.0+cu130: this builds against the same torch
# in a Python 3.12 venv here (no GPU needed) and leaves the extension and its build record in
# .gpu_prebuilt/ (ignored by git); name that folder in the device call's `carry`, and
# benchmarks/gpu_run.sh's build stage uses it when its record names the machine's torch.
#
#   bash benchmarks/gpu_prebuild.sh        (env: GPU_PY=python3.12, GPU_TORCH=2.11.0, GPU_ARCHS=90a,
#                                            GPU_VENV=/tmp/pagedkv-gpu-venv, GPU_SRC=/tmp/pagedkv-gpu-src)
# The build runs in a copy of the tree (GPU_SRC, its build/ kept between runs, so a rebuild after a
# change recompiles only what changed); this checkout's own CPU build is untouched.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYV=${GPU_PY:-python3.12}
TORCH=${GPU_TORCH:-2.11.0}
ARCHS=${GPU_ARCHS:-90a}
VENV=${GPU_VENV:-/tmp/pagedkv-gpu-venv}
SRC=${GPU_SRC:-/tmp/pagedkv-gpu-src}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  echo "==> venv $VENV: $PYV with torch==$TORCH (CUDA build of PyPI's wheel)"
  rm -rf "$VENV"
  "$PYV" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH" numpy ninja setuptools
fi
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'torch in $VENV has no CUDA'; print('torch', torch.__version__)"

echo "==> sources -> $SRC"
mkdir -p "$SRC"
# tracked and untracked-not-ignored files only; tar keeps the files' times, so ninja recompiles only
# what changed
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$SRC"

echo "==> build PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS"
(cd "$SRC" && PATH="$VENV/bin:$CUDA_HOME/bin:$PATH" PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS \
  MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py -q build_clib build_ext --inplace >"$SRC/build.log" 2>&1) || {
  tail -30 "$SRC/build.log"
  exit 1
}
(cd "$SRC" && PYTHONPATH=python "$VENV/bin/python" -c \
  "from pagedkv import _C; assert _C.with_cuda; print('imports, with_cuda', _C.with_cuda)")

rm -rf "$ROOT/.gpu_prebuilt"
mkdir -p "$ROOT/.gpu_prebuilt"
cp "$SRC"/python/pagedkv/_C.cpython-*.so "$SRC/python/pagedkv/_build_config.py" "$ROOT/.gpu_prebuilt/"
echo "$(cd "$ROOT" && git rev-parse --short HEAD)$(cd "$ROOT" && git diff --quiet HEAD -- csrc setup.py || echo +changes)" \
  >"$ROOT/.gpu_prebuilt/commit"
ls -la "$ROOT/.gpu_prebuilt"
