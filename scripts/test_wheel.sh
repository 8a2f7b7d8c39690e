#!/usr/bin/env bash
# Wheel stage of scripts/test.sh: build the CPU wheel with one command (reusing the extension's
# objects that scripts/install.sh left in build/: the C core, the link and the packaging run), check
# that its metadata pins the torch it was built against, install it with exactly that torch into a
# fresh venv, and run scripts/wheel_smoke.py there from a folder outside the source tree with no
# compiler on PATH (gcc, cc, c++, g++, nvcc): the three ops against pagedkv.reference and a tiny
# random Llama through transformers.
# Environment: PYTHON (default python3), PAGEDKV_WHEEL_TRANSFORMERS (default transformers==5.24.0;
# empty skips the transformers part), KEEP_WHEEL_DIR=1 keeps the temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
TRANSFORMERS="${PAGEDKV_WHEEL_TRANSFORMERS-transformers==5.24.0}"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-wheel.XXXXXX")
[ "${KEEP_WHEEL_DIR:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
step() { printf '[wheel %ss] %s\n' "$(( $(date +%s) - start ))" "$*"; }

read -r torch_version torch_minor < <("$PY" -c "import torch; v = torch.__version__
print(v, '.'.join(v.split('+')[0].split('.')[:2]))")

step "building the CPU wheel against torch $torch_version: pip wheel --no-build-isolation --no-deps ."
PAGEDKV_BUILD=cpu MAX_JOBS="${MAX_JOBS:-2}" "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/dist" . \
  >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
wheel=$(ls "$WORK"/dist/pagedkv-*.whl)
step "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

requires=$("$PY" - "$wheel" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(name).decode().splitlines()
    print(" ".join(l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist: torch")))
EOF
)
if [ "$requires" != "torch==${torch_minor}.*" ]; then
  echo "FAILED: the wheel's metadata requires '$requires', expected torch==${torch_minor}.*"
  exit 1
fi
step "metadata pins $requires"

step "fresh venv: torch==$torch_version, the wheel${TRANSFORMERS:+, $TRANSFORMERS}"
"$PY" -m venv "$WORK/venv"
# shellcheck disable=SC2086  # TRANSFORMERS is one requirement or empty
"$WORK/venv/bin/python" -m pip install -q "torch==$torch_version" "$wheel" $TRANSFORMERS >"$WORK/venv.log" 2>&1 \
  || { grep -v "^WARNING: Location" "$WORK/venv.log" | tail -30; exit 1; }

# no compiler reachable: PATH holds the venv alone, checked before the smoke test runs
mkdir "$WORK/run"
cp scripts/wheel_smoke.py "$WORK/run/"
for tool in gcc cc c++ g++ nvcc; do
  if (PATH="$WORK/venv/bin" && hash -r && command -v "$tool" >/dev/null); then
    echo "FAILED: $tool is on the smoke test's PATH"
    exit 1
  fi
done
step "smoke test in $WORK/run (PATH=$WORK/venv/bin, no compiler)"
(cd "$WORK/run" && env -u PYTHONPATH PATH="$WORK/venv/bin" python -u wheel_smoke.py)
step "wheel stage passed"
