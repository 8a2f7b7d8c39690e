#!/usr/bin/env bash
# Build ggml's CPU backend from the llama-cpp-python sdist and the flash-attention harness beside it.
#
#   bash benchmarks/ggml/build.sh            # downloads the sdist into .deps/ggml (git-ignored) if absent
#   GGML_SRC=/path/to/ggml bash benchmarks/ggml/build.sh
#
# Output: .deps/ggml/flash_attn_harness (bench_decode.py runs it when present).
# ggml is built for this machine (GGML_NATIVE=ON, as a llama.cpp user builds it), static, with its
# default threading (OpenMP when the compiler has it), no BLAS, no GPU backends.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
deps="$root/.deps/ggml"
mkdir -p "$deps"
if [[ -z "${GGML_SRC:-}" ]]; then
  sdist="$(ls "$deps"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)"
  if [[ -z "$sdist" ]]; then
    pip download --no-deps --no-binary :all: llama-cpp-python -d "$deps"
    sdist="$(ls "$deps"/llama_cpp_python-*.tar.gz | head -1)"
  fi
  src_dir="${sdist%.tar.gz}"
  [[ -d "$src_dir" ]] || tar xzf "$sdist" -C "$deps"
  GGML_SRC="$src_dir/vendor/llama.cpp/ggml"
fi
echo "ggml source: $GGML_SRC"
# The sdist leaves out ggml.pc.in (a pkg-config template ggml's CMakeLists configures): an empty one will do.
[[ -f "$GGML_SRC/ggml.pc.in" ]] || : >"$GGML_SRC/ggml.pc.in"
cmake -S "$GGML_SRC" -B "$deps/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
  -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF >/dev/null
cmake --build "$deps/build" -j "${MAX_JOBS:-2}" --target ggml ggml-cpu ggml-base
# static libraries in link order: the CPU backend before ggml-base (ggml, the registry, links both)
libs="$deps/build/src/libggml.a $deps/build/src/libggml-cpu.a $deps/build/src/libggml-base.a"
omp=""
grep -q '^GGML_OPENMP:BOOL=ON' "$deps/build/CMakeCache.txt" && omp="-fopenmp"
gcc -O2 -std=c11 -c "$root/benchmarks/ggml/flash_attn_harness.c" -I "$GGML_SRC/include" -o "$deps/flash_attn_harness.o"
g++ "$deps/flash_attn_harness.o" -Wl,--start-group $libs -Wl,--end-group $omp -lpthread -lm -o "$deps/flash_attn_harness"
echo "built $deps/flash_attn_harness"
