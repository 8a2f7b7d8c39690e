#!/usr/bin/env bash
# Install on a bare machine and run every test: the Python suite (CPU; CUDA
# cases skip without a GPU), the C core tests under ASan+UBSan, the C fuzzer
# smoke run, the transformers 4.57 line, the per-ISA op tests, the wheel stage
# (scripts/test_wheel.sh), the newest torch and transformers on PyPI (scripts/test_newest.sh),
# the CUDA compile check and the vLLM integration (scripts/test_vllm.sh). This is what CI runs (.ci/run).
#
#   bash scripts/test.sh            every stage (about 21 minutes on 2 cores)
#   bash scripts/test.sh --quick    install/build and the Python main suite only (the edit-test loop)
#
# Each stage's heading carries the seconds since the start; the run ends with a table of the stages
# (result and seconds each), also when a stage fails or the run is interrupted.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
for arg in "$@"; do
  case "$arg" in
  --quick) quick=1 ;;
  -h | --help)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  *)
    printf 'scripts/test.sh: unknown argument %s (use --quick or nothing)\n' "$arg" >&2
    exit 2
    ;;
  esac
done

start=$(date +%s)
stage_names=()
stage_results=()
stage_seconds=()
current=""
current_start=$start

# stage NAME [WHAT]: ends the running stage (passed) and starts NAME (the summary's row; the
# heading adds WHAT)
stage() {
  end_stage passed
  current="$1"
  current_start=$(date +%s)
  printf '\n==> %s%s [%ss]\n' "$1" "${2:+: $2}" "$((current_start - start))"
}
end_stage() {
  [ -n "$current" ] || return 0
  stage_names+=("$current")
  stage_results+=("$1")
  stage_seconds+=("$(($(date +%s) - current_start))")
  current=""
}
# skip_stage NAME WHY: a stage this run leaves out, listed in the summary
skip_stage() {
  end_stage passed
  stage_names+=("$1")
  stage_results+=("skipped ($2)")
  stage_seconds+=("-")
}
summary() {
  local rc=$? width=5 i name
  # a background download still running when the run ends (a failed stage) goes with it
  [ -z "${newest_prepare_pid:-}" ] || kill "$newest_prepare_pid" 2>/dev/null || true
  [ -z "${vllm_prepare_pid:-}" ] || kill "$vllm_prepare_pid" 2>/dev/null || true
  [ -z "${cuda_check_pid:-}" ] || kill "$cuda_check_pid" 2>/dev/null || true
  if [ "$rc" -eq 0 ]; then end_stage passed; else end_stage "FAILED (exit $rc)"; fi
  for name in ${stage_names[@]+"${stage_names[@]}"}; do [ ${#name} -le "$width" ] || width=${#name}; done
  printf '\n==> summary\n'
  printf '%-*s  %-20s  %7s\n' "$width" stage result seconds
  for i in ${stage_names[@]+"${!stage_names[@]}"}; do
    printf '%-*s  %-20s  %7s\n' "$width" "${stage_names[$i]}" "${stage_results[$i]}" "${stage_seconds[$i]}"
  done
  if [ "$rc" -eq 0 ]; then
    printf '\nall tests passed in %ss%s\n' "$(($(date +%s) - start))" "$([ "$quick" = 1 ] && echo ' (--quick)')"
  else
    printf '\ntests FAILED after %ss\n' "$(($(date +%s) - start))"
  fi
  exit "$rc"
}
trap summary EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The newest-torch stage's venv (several GB from PyPI) downloads, and its wheel builds, in the background
# at the lowest priority while the stages before it run; the stage waits for it.
newest_prepare_pid=""
if [ "$quick" = 0 ]; then
  mkdir -p .deps
  nice -n 19 bash scripts/test_newest.sh --prepare >.deps/newest-prepare.log 2>&1 &
  newest_prepare_pid=$!
fi

stage "install and build" "scripts/install.sh test"
bash scripts/install.sh test

# The vLLM venv (vLLM pins the main environment's torch, now installed) downloads in the background too;
# the vLLM stage waits for it.
vllm_prepare_pid=""
if [ "$quick" = 0 ]; then
  bash scripts/test_vllm.sh --prepare >.deps/vllm-prepare.log 2>&1 &
  vllm_prepare_pid=$!
fi
# The CUDA compile check needs neither torch nor the extension: it runs in the background from here at
# the lowest priority, on the CPU time the foreground stages leave (they keep about 1.5 of the 2 cores
# busy); its stage waits for it and prints its log. nvcc mode: every .cu for sm_80/sm_90a/sm_100a plus
# the gather4 check. The full extension build against the CUDA torch (PAGEDKV_CUDA_CHECK_MODE=venv)
# takes longer than the CI budget on 2 cores; run it by hand (see .ci/cuda_build_check.sh).
cuda_check_pid=""
if [ "$quick" = 0 ] && [ -f .ci/cuda_build_check.sh ] && [ "${PAGEDKV_SKIP_CUDA_BUILD:-0}" != "1" ]; then
  PAGEDKV_CUDA_CHECK_MODE="${PAGEDKV_CUDA_CHECK_MODE:-nvcc}" nice -n 19 bash .ci/cuda_build_check.sh \
    >.deps/cuda-check.log 2>&1 &
  cuda_check_pid=$!
fi

if [ "$quick" = 0 ]; then
  stage "C tests" "C core tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  bash tests/c/run.sh

  if [ -x fuzz/run.sh ] || [ -f fuzz/run.sh ]; then
    stage "fuzzers" "C fuzzer smoke run"
    bash fuzz/run.sh
  fi
else
  skip_stage "C tests" --quick
  skip_stage "fuzzers" --quick
fi

stage "main suite" "Python test suite"
python3 -m pytest -q -ra tests

if [ "$quick" = 1 ]; then
  end_stage passed
  for name in "transformers 4.57" "per-ISA stages" "wheel" "newest torch" "CUDA build check" "vLLM"; do
    skip_stage "$name" --quick
  done
  exit 0
fi

# pagedkv.hf on the older transformers line it supports (the newest ran in the suite above):
# that transformers and the hub/tokenizers versions it needs go to a folder put first on
# PYTHONPATH, so everything else (torch, pagedkv) is what this machine has, venv or not.
TRANSFORMERS_OLDER=(transformers==4.57.6 huggingface-hub==0.36.2 tokenizers==0.22.2)
stage "transformers 4.57" "transformers integration against ${TRANSFORMERS_OLDER[0]}"
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
  stage "per_isa ops, $isa" "op tests (per_isa) on the $isa CPU kernels"
  PAGEDKV_CPU_ISA=$isa python3 -m pytest -q -p no:cacheprovider tests/ops -m per_isa
  stage "FP8 layers, $isa" "FP8 attention per layer in transformers models on the $isa CPU kernels"
  PAGEDKV_CPU_ISA=$isa python3 -m pytest -q -p no:cacheprovider tests/hf \
    -k "fp8_attention_every_layer and not smollm2"
done

stage "wheel" "CPU wheel built, installed with its torch into a fresh venv without a compiler, smoke test"
bash scripts/test_wheel.sh

stage "newest torch" "the newest torch and transformers on PyPI in their own venv: build, self-test, tests/ops, the architecture sweep"
# (the background download's log first; the stage installs again itself if that failed)
wait "$newest_prepare_pid" || printf 'the background preparation failed; scripts/test_newest.sh retries it\n'
newest_prepare_pid=""
grep -v "^WARNING: Location" .deps/newest-prepare.log || true
bash scripts/test_newest.sh

if [ -n "$cuda_check_pid" ]; then
  stage "CUDA build check" "every .cu for sm_80, sm_90a, sm_100a; gather4 in the sm_100a binary (started in the background after the install)"
  cuda_rc=0
  wait "$cuda_check_pid" || cuda_rc=$?
  cuda_check_pid=""
  cat .deps/cuda-check.log
  [ "$cuda_rc" = 0 ] || exit "$cuda_rc"
else
  skip_stage "CUDA build check" "PAGEDKV_SKIP_CUDA_BUILD=1"
fi
stage "vLLM" "vLLM backend (scripts/test_vllm.sh)"
# (the background venv's log first; the stage makes the venv itself if that failed)
wait "$vllm_prepare_pid" || printf 'the background vLLM venv failed; scripts/test_vllm.sh retries it\n'
vllm_prepare_pid=""
grep -v "^WARNING: Location" .deps/vllm-prepare.log || true
bash scripts/test_vllm.sh
