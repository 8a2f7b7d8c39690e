# Sourced by the C test and fuzz scripts: isa_flags FILE prints FILE's extra
# flags from csrc/cpu/isa/isa_flags.txt (nothing for ordinary C files); c_sources and
# compile_library build the library the way setup.py does.
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

# compile_library DIR CC FLAGS...: every c_sources file compiled once into DIR/<name>.o with FLAGS
# (the ISA variants with their own flags added); sets library_objects to the objects, in that order.
compile_library() {
  local dir="$1" cc="$2" source object
  shift 2
  library_objects=()
  while read -r source; do
    object="$dir/$(basename "$source" .c).o"
    # shellcheck disable=SC2046  # the ISA variants' flags are a word list
    "$cc" "$@" $(isa_flags "$source") -c "$source" -o "$object"
    library_objects+=("$object")
  done < <(c_sources)
}
