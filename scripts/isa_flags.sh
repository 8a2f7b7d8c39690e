# Sourced by the C test and fuzz scripts: isa_flags FILE prints FILE's extra
# flags from csrc/cpu/isa/isa_flags.txt (nothing for ordinary C files).
isa_flags() {
  local list
  list="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/csrc/cpu/isa/isa_flags.txt"
  awk -v f="$(basename "$1")" '$1 == f { $1 = ""; print }' "$list"
}

# Every C source of the library (core, CPU backend, ISA variants), one path a line: the
# list setup.py builds, for the scripts that compile the library themselves.
c_sources() {
  local root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  printf '%s\n' "$root"/csrc/core/*.c "$root"/csrc/cpu/*.c "$root"/csrc/cpu/isa/*.c
}
