#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-quantize from the llama-cpp-python source
# distribution on PyPI (it carries llama.cpp's whole tree: vendor/llama.cpp, with
# convert_hf_to_gguf.py and gguf-py), for benchmarks/bench_compute.py's comparison.
#
#   bash benchmarks/build_llama_cpp.sh          # ~12 min on 2 cores; prints the folder
#
# Release, GGML_NATIVE (this CPU's AVX-512 and bf16), only the targets needed. The folder:
# $STMOE_LLAMA_DIR, else $STMOE_CACHE/llama.cpp-VERSION, else ~/.cache/stmoe/llama.cpp-VERSION.
# Run again, it reuses what is built. Needs cmake and a C++ compiler (apt: cmake g++).
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${STMOE_LLAMA_DIR:-${STMOE_CACHE:-$HOME/.cache/stmoe}/llama.cpp-$VERSION}"
PYTHON="${PYTHON:-python}"
mkdir -p "$ROOT"
cd "$ROOT"
if [ ! -d "src/vendor/llama.cpp" ]; then
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==$VERSION" -d download
    mkdir -p src
    tar xzf "download/llama_cpp_python-$VERSION.tar.gz" -C src --strip-components=1
fi
command -v cmake >/dev/null || { echo "error: cmake not found (apt install cmake g++)" >&2; exit 1; }
cmake -S src/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF > build.log 2>&1 || { tail -20 build.log >&2; exit 1; }
cmake --build build --target llama-bench llama-quantize -j "${JOBS:-2}" \
    >> build.log 2>&1 || { tail -20 build.log >&2; exit 1; }
ls build/bin/llama-bench build/bin/llama-quantize > /dev/null
echo "$ROOT"
