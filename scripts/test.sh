#!/usr/bin/env bash
# Install on a bare machine and run every test: the Python suite (CPU; CUDA
# cases skip without a GPU), the C core tests under ASan+UBSan, the C fuzzer
# smoke run, the wheel stage (scripts/test_wheel.sh) and the CUDA compile/link/registration check.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# each stage's heading carries the seconds since the start, so a slow stage shows in the CI log
stage() { printf '\n==> %s [%ss]\n' "$*" "$(( $(date +%s) - start ))"; }
bash scripts/install.sh test

stage "C core tests under AddressSanitizer + UndefinedBehaviorSanitizer"
bash tests/c/run.sh

if [ -x fuzz/run.sh ] || [ -f fuzz/run.sh ]; then
  stage "C fuzzer smoke run"
  bash fuzz/run.sh
fi

stage "Python test suite"
python3 -m pytest -q -ra tests

# pagedkv.hf on the older transformers line it supports (the newest ran in the suite above):
# that transformers and the hub/tokenizers versions it needs go to a folder put first on
# PYTHONPATH, so everything else (torch, pagedkv) is what this machine has, venv or not.
TRANSFORMERS_OLDER=(transformers==4.57.6 huggingface-hub==0.36.2 tokenizers==0.22.2)
stage "transformers integration against ${TRANSFORMERS_OLDER[0]}"
older=.deps/transformers-older
rm -rf "$older"
python3 -m pip install -q --no-deps --target "$older" "${TRANSFORMERS_OLDER[@]}"
PYTHONPATH="$older${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -p no:cacheprovider tests/hf

# The suite above runs the CPU kernels the machine picks (AMX or AVX-512 where the CPU has them);
# the cheap `per_isa` op tests of tests/ops (seeded fuzz chunks, the LSE/sinks and sparse grids) and
# the FP8 per-layer transformers tests (random Llama/Mistral; SmolLM2 ran above) also run on every
# other kernel path this CPU can run (the ISA is fixed per process; a path the CPU lacks would only
# rerun another one).
other_isas=$(python3 -c "import pagedkv; i = pagedkv.build_info(); print(' '.join(k for k in i['cpu_kernels_available'] if k != i['cpu_kernel_in_use']))")
for isa in $other_isas; do
  stage "op tests (per_isa) on the $isa CPU kernels"
  PAGEDKV_CPU_ISA=$isa python3 -m pytest -q -p no:cacheprovider tests/ops -m per_isa
  stage "FP8 attention per layer in transformers models on the $isa CPU kernels"
  PAGEDKV_CPU_ISA=$isa python3 -m pytest -q -p no:cacheprovider tests/hf \
    -k "fp8_attention_every_layer and not smollm2"
done

stage "wheel: CPU wheel built, installed with its torch into a fresh venv without a compiler, smoke test"
bash scripts/test_wheel.sh

if [ -f .ci/cuda_build_check.sh ] && [ "${PAGEDKV_SKIP_CUDA_BUILD:-0}" != "1" ]; then
  stage "CUDA build check (every .cu for sm_80, sm_90a, sm_100a; gather4 in the sm_100a binary)"
  # nvcc mode: every .cu for sm_80/sm_90a/sm_100a plus the gather4 check. The full
  # extension build against the CUDA torch (PAGEDKV_CUDA_CHECK_MODE=venv) takes longer
  # than the CI budget on 2 cores; run it by hand (see .ci/cuda_build_check.sh).
  PAGEDKV_CUDA_CHECK_MODE="${PAGEDKV_CUDA_CHECK_MODE:-nvcc}" bash .ci/cuda_build_check.sh
fi
stage "vLLM backend (scripts/test_vllm.sh)"
bash scripts/test_vllm.sh
printf '\nall tests passed in %ss\n' "$(( $(date +%s) - start ))"
