#!/usr/bin/env bash
# `make rpc`: build ggml's RPC backend (the client side of --rpc and the server that
# `edgeinfer rpc-server` starts) as a module that `ggml_backend_load` opens, from the vendored
# source of the pinned llama-cpp-python (the same ggml as its libggml*.so.0, so the ABI and the
# RPC protocol version match), and install it as $EDGEINFER_HOME/ggml/libggml-rpc.so (default
# ~/.cache/edgeinfer). Small and CPU only: two C++ files, about a minute on 2 cores, once.
#
# Environment: LLAMA_CPP_SRC  a vendored llama.cpp tree (default: the pinned sdist, via pip)
#              JOBS           parallel compile jobs (default: nproc)
# Needs cmake and a C++ compiler; cmake and ninja come from PyPI when the system has none.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=$("$PY" -c "from importlib.metadata import version; print(version('llama-cpp-python'))")
WORK=${RPC_BUILD_DIR:-$ROOT/build/ggml-rpc}
DEST=${EDGEINFER_HOME:-$HOME/.cache/edgeinfer}/ggml
STAMP=$DEST/libggml-rpc.version
# built already for this llama-cpp-python: nothing to do (make test depends on it)
if [ -f "$DEST/libggml-rpc.so" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
mkdir -p "$WORK" "$DEST"

if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
  echo "error: make rpc needs a C++ compiler (e.g. apt-get install g++, or Xcode's tools)" >&2
  exit 2
fi
if ! command -v cmake >/dev/null; then
  "$PY" -m pip install --quiet "cmake>=3.18" ninja
  export PATH=$(dirname "$PY"):$PATH
fi
GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi

if [ -z "${LLAMA_CPP_SRC:-}" ]; then
  SDIST=$WORK/src/llama_cpp_python-$VERSION
  if [ ! -d "$SDIST" ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" \
      -d "$WORK/src"
    tar xzf "$SDIST.tar.gz" -C "$WORK/src"
  fi
  LLAMA_CPP_SRC=$SDIST/vendor/llama.cpp
fi

# From llama.cpp's top level (the sdist's ggml folder does not configure alone), with nothing
# of llama.cpp's own built and no CPU backend (llama-cpp-python's serves): the RPC module only.
# RDMA off: a TCP-only module loads on any machine.
cmake -S "$LLAMA_CPP_SRC" -B "$WORK/cmake" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU=OFF -DGGML_RPC=ON -DGGML_RPC_RDMA=OFF \
  -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF >"$WORK/configure.log" || { cat "$WORK/configure.log" >&2; exit 1; }
cmake --build "$WORK/cmake" --target ggml-rpc -j "${JOBS:-$(nproc 2>/dev/null || echo 2)}"
install -m 644 "$(find "$WORK/cmake" -name libggml-rpc.so | head -1)" "$DEST/libggml-rpc.so"
echo "$VERSION" >"$STAMP"
echo "installed $DEST/libggml-rpc.so (ggml's RPC backend of llama-cpp-python $VERSION)"
