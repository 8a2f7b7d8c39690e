#!/usr/bin/env bash
# Build the CUDA extension on this machine for the lent GPU machine, so a device call spends no
# device time compiling (a cold build of the torch shims takes minutes even on 16 cores).
# The lent machine runs Python 3.12 with torch 2.11.0+cu130: this builds against the same torch
# in a Python 3.12 venv here (no GPU needed) and leaves the extension (gzipped: ~10 MB of the device
# call's 64 MiB instead of ~30) and its build record in .gpu_prebuilt/ (ignored by git); name that
# folder in the device call's `carry`, and benchmarks/gpu_run.sh's build stage uses it when its record
# names the machine's torch.
#
#   bash benchmarks/gpu_prebuild.sh        (env: GPU_PY=python3.12, GPU_TORCH=2.11.0, GPU_ARCHS=90a,
#                                            GPU_VENV=/tmp/pagedkv-gpu-venv, GPU_SRC=/tmp/pagedkv-gpu-src,
#                                            GPU_COMMIT, GPU_OUT=.gpu_prebuilt)
# The build runs in a copy of the tree (GPU_SRC, its build/ kept between runs, so a rebuild after a
# change recompiles only what changed); this checkout's own CPU build is untouched.
# GPU_COMMIT=<commit> builds that commit instead of the working tree (from a git worktree; its own
# GPU_SRC, default /tmp/pagedkv-gpu-src-<commit>: a first build takes ~10 minutes with 2 jobs), e.g.
# the baseline of an A/B on the GPU: GPU_COMMIT=617712f GPU_OUT=.gpu_prebuilt_base, then
# `bash benchmarks/gpu_ab.sh .gpu_prebuilt_base .gpu_prebuilt` there with both folders carried.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYV=${GPU_PY:-python3.12}
TORCH=${GPU_TORCH:-2.11.0}
ARCHS=${GPU_ARCHS:-90a}
VENV=${GPU_VENV:-/tmp/pagedkv-gpu-venv}
OUTDIR="$ROOT/${GPU_OUT:-.gpu_prebuilt}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [ -n "${GPU_COMMIT:-}" ]; then
  COMMIT=$(git -C "$ROOT" rev-parse --short "$GPU_COMMIT")
  SRC=${GPU_SRC:-/tmp/pagedkv-gpu-src-$COMMIT}
  TREE=/tmp/pagedkv-gpu-tree-$COMMIT  # the commit's files, from a worktree of this repository
  if [ ! -d "$TREE" ]; then
    git -C "$ROOT" worktree prune  # an entry whose folder /tmp lost
    git -C "$ROOT" worktree add --detach "$TREE" "$COMMIT" >/dev/null
  fi
  STAMP=$COMMIT
else
  SRC=${GPU_SRC:-/tmp/pagedkv-gpu-src}
  TREE=$ROOT
  STAMP="$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- csrc setup.py || echo +changes)"
fi

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
(cd "$TREE" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$SRC"
# what it is built from (sha256sum's format, paths from the tree's root; not the READMEs), hashed in the
# copy that is built: gpu_run.sh uses the extension only where every one of these files is unchanged, so
# a tree edited after the build rebuilds there
(cd "$TREE" && git ls-files -co --exclude-standard -z -- csrc setup.py ':(exclude)*.md' | LC_ALL=C sort -z) |
  (cd "$SRC" && xargs -0 sha256sum) >"$SRC/.pagedkv_sources.sha256"

echo "==> build PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS"
(cd "$SRC" && PATH="$VENV/bin:$CUDA_HOME/bin:$PATH" PAGEDKV_BUILD=cuda PAGEDKV_CUDA_ARCHS=$ARCHS \
  MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py -q build_clib build_ext --inplace >"$SRC/build.log" 2>&1) || {
  tail -30 "$SRC/build.log"
  exit 1
}
(cd "$SRC" && PYTHONPATH=python "$VENV/bin/python" -c \
  "from pagedkv import _C; assert _C.with_cuda; print('imports, with_cuda', _C.with_cuda)")

rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
for so in "$SRC"/python/pagedkv/_C.cpython-*.so; do gzip -c "$so" >"$OUTDIR/$(basename "$so").gz"; done
cp "$SRC/python/pagedkv/_build_config.py" "$OUTDIR/"
echo "$STAMP" >"$OUTDIR/commit"
cp "$SRC/.pagedkv_sources.sha256" "$OUTDIR/sources.sha256"
ls -la "$OUTDIR"
