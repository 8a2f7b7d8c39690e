#!/usr/bin/env bash
# Build and run the C unit tests of the core under AddressSanitizer + UndefinedBehaviorSanitizer.
#
# Each tests/c/test_*.c becomes one binary, linked with every csrc/core/*.c and libm, compiled as
#   -std=c11 -fsanitize=address,undefined -fno-sanitize-recover=all
# so any out-of-bounds access, use-after-free, leak or undefined behaviour fails the run.
#
# Usage:  tests/c/run.sh [test_name ...]      (default: every tests/c/test_*.c; names without .c)
# Env:    CC (default: gcc, or clang-14/clang when gcc is missing), EXTRA_CFLAGS (appended).
set -euo pipefail
shopt -s nullglob

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$root/tests/c/bin"
if [ -z "${CC:-}" ]; then
  for candidate in gcc clang clang-14; do
    if command -v "$candidate" > /dev/null; then CC="$candidate"; break; fi
  done
fi
: "${CC:?no C compiler found (set CC)}"

# shellcheck disable=SC2206  # EXTRA_CFLAGS is a list of words on purpose
flags=(-std=c11 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
  -Wall -Wextra -pthread -I"$root/csrc/core" ${EXTRA_CFLAGS:-})
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

mkdir -p "$out/core"
rm -f "$out"/core/*.o
core=()
for source in "$root"/csrc/core/*.c; do
  object="$out/core/$(basename "$source" .c).o"
  "$CC" "${flags[@]}" -c "$source" -o "$object"
  core+=("$object")
done

tests=()
if [ "$#" -gt 0 ]; then
  for name in "$@"; do tests+=("$root/tests/c/${name%.c}.c"); done
else
  tests=("$root"/tests/c/test_*.c)
fi
[ "${#tests[@]}" -gt 0 ] || { echo "no tests/c/test_*.c" >&2; exit 1; }

passed=0
failed=()
for source in "${tests[@]}"; do
  name="$(basename "$source" .c)"
  echo "== $name ($CC, ASan+UBSan)"
  if "$CC" "${flags[@]}" "$source" "${core[@]}" -o "$out/$name" -lm && "$out/$name"; then
    passed=$((passed + 1))
  else
    failed+=("$name")
  fi
done
echo "== $passed passed, ${#failed[@]} failed${failed[*]:+: ${failed[*]}}"
[ "${#failed[@]}" -eq 0 ]
