#!/usr/bin/env bash
# Build the libFuzzer targets of the C core (clang -fsanitize=fuzzer,address,undefined), replay
# their committed corpora, then fuzz each target for a share of a time budget. Any crash, leak,
# sanitizer report or harness property violation fails the run; the input that caused it is
# written to fuzz/out/crash-<target>-* and its path printed.
#
# Targets: every fuzz/fuzz_*.c, linked with the C library (csrc/core, csrc/cpu). Seed corpora: fuzz/corpus/<target>/
# (committed; a CI run works on a copy in fuzz/out/work/ and never changes them).
#
# Usage: fuzz/run.sh [--merge] [target ...]
#   --merge   fold what this run found into fuzz/corpus/<target>/ (libFuzzer -merge=1, minimal set)
# Env:    FUZZ_SECONDS  total fuzzing time over all targets (default 60)
#         CC            clang to use (default: first of clang, clang-19 .. clang-14 that links -fsanitize=fuzzer)
set -euo pipefail
shopt -s nullglob

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$root/fuzz/out"
seconds="${FUZZ_SECONDS:-60}"
merge=0
targets=()
for arg in "$@"; do
  case "$arg" in
    --merge) merge=1 ;;
    *) targets+=("${arg%.c}") ;;
  esac
done
if [ "${#targets[@]}" -eq 0 ]; then
  for source in "$root"/fuzz/fuzz_*.c; do targets+=("$(basename "$source" .c)"); done
fi
mkdir -p "$out"

# ---- a clang whose libFuzzer runtime links (installed from Debian/Ubuntu packages if missing) ----
links_fuzzer() {
  printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
    > "$out/probe.c"
  "$1" -fsanitize=fuzzer,address,undefined "$out/probe.c" -o "$out/probe" > /dev/null 2>&1
}
find_clang() {
  local candidates=("${CC:-}" clang clang-19 clang-18 clang-17 clang-16 clang-15 clang-14)
  for candidate in "${candidates[@]}"; do
    [ -n "$candidate" ] && command -v "$candidate" > /dev/null && links_fuzzer "$candidate" && { echo "$candidate"; return 0; }
  done
  return 1
}
if ! cc="$(find_clang)"; then
  echo "fuzz/run.sh: no clang with libFuzzer; installing clang from the distribution" >&2
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && command -v sudo > /dev/null && sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  # Debian 12 / Ubuntu 22.04+: the fuzzer runtime is in libclang-rt-<v>-dev; older: in clang itself
  "${sudo_cmd[@]}" apt-get install -y -qq clang libclang-rt-dev > /dev/null 2>&1 ||
    "${sudo_cmd[@]}" apt-get install -y -qq clang-14 libclang-rt-14-dev > /dev/null 2>&1 ||
    "${sudo_cmd[@]}" apt-get install -y -qq clang > /dev/null
  cc="$(find_clang)" || { echo "fuzz/run.sh: clang installed but -fsanitize=fuzzer does not link" >&2; exit 1; }
fi
echo "== fuzzers built with $cc ($("$cc" --version | head -n 1))"

flags=(-g -O1 -std=c11 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
  -I"$root/csrc/core" -I"$root/csrc/cpu" -DPKV_PM_ALLOC_FAILURE_INJECTION)
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

per_target=$(( seconds / ${#targets[@]} ))
[ "$per_target" -ge 1 ] || per_target=1
status=0
summary=()
# The core is compiled once (the ISA variants with their own flags) and linked into every target.
# shellcheck source=../scripts/isa_flags.sh
source "$root/scripts/isa_flags.sh"
mkdir -p "$out/core"
compile_library "$out/core" "$cc" "${flags[@]}"
for target in "${targets[@]}"; do
  "$cc" "${flags[@]}" "$root/fuzz/$target.c" "${library_objects[@]}" -lm -o "$out/$target"
  corpus="$root/fuzz/corpus/$target"
  work="$out/work/$target"
  mkdir -p "$corpus" "$work"
  # 1. every committed input (seeds and regression inputs of fixed bugs) must still pass
  inputs=("$corpus"/*)
  if [ "${#inputs[@]}" -gt 0 ]; then
    if ! "$out/$target" -runs=0 -timeout=20 "${inputs[@]}" > "$out/$target.replay.log" 2>&1; then
      echo "!! $target: a committed corpus input fails; see $out/$target.replay.log" >&2
      tail -n 30 "$out/$target.replay.log" >&2
      status=1
      continue
    fi
  fi
  # 2. fuzz from the corpus for this target's share of the budget
  cp -n "$corpus"/* "$work"/ 2> /dev/null || true
  log="$out/$target.log"
  set +e
  "$out/$target" -max_total_time="$per_target" -timeout=10 -rss_limit_mb=2048 -max_len=1024 \
    -print_final_stats=1 -artifact_prefix="$out/crash-$target-" "$work" > "$log" 2>&1
  rc=$?
  set -e
  runs="$(grep -Eo 'Done [0-9]+ runs in [0-9]+ second' "$log" | tail -n 1 || true)"
  cov="$(grep -Eo 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -n 1 || true)"
  if [ "$rc" -ne 0 ]; then
    echo "!! $target: fuzzer found a failure (exit $rc); log $log" >&2
    grep -E 'ERROR|runtime error|property violated|Test unit written' "$log" | head -n 20 >&2 || true
    status=1
  fi
  summary+=("$target: ${runs:-no summary} (${cov:-?}), corpus ${#inputs[@]} inputs replayed")
  if [ "$merge" -eq 1 ]; then
    "$out/$target" -merge=1 "$corpus" "$work" > "$out/$target.merge.log" 2>&1
    echo "== merged into $corpus: $(ls "$corpus" | wc -l) inputs"
  fi
done
for line in "${summary[@]}"; do echo "== $line"; done
exit "$status"
