# Sourced by the C test and fuzz scripts: isa_flags FILE prints FILE's extra
# flags from csrc/core/isa_flags.txt (nothing for ordinary core files).
isa_flags() {
  local list
  list="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/csrc/core/isa_flags.txt"
  awk -v f="$(basename "$1")" '$1 == f { $1 = ""; print }' "$list"
}
