#!/usr/bin/env bash
# Builds and runs the C core unit tests under AddressSanitizer + UndefinedBehaviorSanitizer.
#
# Every tests/c/test_*.c is its own binary, linked with the C library (csrc/core, csrc/cpu; the
# list of scripts/isa_flags.sh) and -lm.
# Usage: tests/c/run.sh [test_name ...]   (default: all; names without .c, e.g. test_page_manager)
# Environment: CC (default gcc), EXTRA_CFLAGS (appended to the compile flags).
set -euo pipefail
shopt -s nullglob

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=../../scripts/isa_flags.sh
source "$root/scripts/isa_flags.sh"
bin="$root/tests/c/bin"
cc="${CC:-gcc}"
# shellcheck disable=SC2206  # EXTRA_CFLAGS is a word list on purpose
# PKV_PM_ALLOC_FAILURE_INJECTION: test hook letting tests make the page manager's allocations fail.
cflags=(-std=c11 -O1 -g -fno-omit-frame-pointer
  -fsanitize=address,undefined -fno-sanitize-recover=all
  -Wall -Wextra -pthread -I"$root/csrc/core" -I"$root/csrc/cpu" -I"$root/csrc/cpu/kernels" -DPKV_PM_ALLOC_FAILURE_INJECTION ${EXTRA_CFLAGS:-})
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

mkdir -p "$bin/core"
rm -f "$bin"/core/*.o

# The C library is compiled once and linked into every test.
compile_library "$bin/core" "$cc" "${cflags[@]}"

tests=()
if [ "$#" -gt 0 ]; then
  for name in "$@"; do tests+=("$root/tests/c/${name%.c}.c"); done
else
  tests=("$root"/tests/c/test_*.c)
fi
if [ "${#tests[@]}" -eq 0 ]; then
  echo "no tests/c/test_*.c found" >&2
  exit 1
fi

passed=0
failed=()
for source in "${tests[@]}"; do
  name="$(basename "$source" .c)"
  "$cc" "${cflags[@]}" "$source" "${library_objects[@]}" -o "$bin/$name" -lm
  echo "== $name"
  if "$bin/$name"; then
    passed=$((passed + 1))
  else
    failed+=("$name")
  fi
done

echo "== $passed passed, ${#failed[@]} failed${failed:+: ${failed[*]}}"
[ "${#failed[@]}" -eq 0 ]
