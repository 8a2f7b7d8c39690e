#!/usr/bin/env bash
# Install on a bare machine and run every test: the Python suite (CPU; CUDA
# cases skip without a GPU), the C core tests under ASan+UBSan, the C fuzzer
# smoke run, and the CUDA compile/link/registration check.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/install.sh test

printf '\n==> C core tests under AddressSanitizer + UndefinedBehaviorSanitizer\n'
bash tests/c/run.sh

if [ -x fuzz/run.sh ] || [ -f fuzz/run.sh ]; then
  printf '\n==> C fuzzer smoke run\n'
  bash fuzz/run.sh
fi

printf '\n==> Python test suite\n'
python3 -m pytest -q -ra tests

if [ -f .ci/cuda_build_check.sh ] && [ "${PAGEDKV_SKIP_CUDA_BUILD:-0}" != "1" ]; then
  printf '\n==> CUDA build check (compile, link, registration, gather4 in the sm_100a binary)\n'
  bash .ci/cuda_build_check.sh
fi
printf '\nall tests passed in %ss\n' "$(( $(date +%s) - start ))"
