#!/usr/bin/env bash
# `make cuda`: build ggml's CUDA backend as a module that `ggml_backend_load` opens, from the
# vendored source of the pinned llama-cpp-python (the same ggml as its libggml*.so.0, so the ABI
# matches), and install it as $EDGEINFER_HOME/ggml/libggml-cuda.so (default ~/.cache/edgeinfer).
#
# Environment: LLAMA_CPP_SRC  a vendored llama.cpp tree (default: the pinned sdist, via pip)
#              CUDA_ARCH      e.g. 90 (default: the first GPU's compute capability, nvidia-smi)
#              JOBS           parallel compile jobs (default: nproc); ~70 CPU-minutes in all
# nvcc: the system's if it has cuBLAS too, else the CUDA 13 wheels from the package index
# (design.md §8).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
VERSION=$("$PY" -c "from importlib.metadata import version; print(version('llama-cpp-python'))")
WORK=${CUDA_BUILD_DIR:-$ROOT/build/ggml-cuda}
DEST=${EDGEINFER_HOME:-$HOME/.cache/edgeinfer}/ggml
mkdir -p "$WORK" "$DEST"

if [ -z "${LLAMA_CPP_SRC:-}" ]; then
  SDIST=$WORK/src/llama_cpp_python-$VERSION
  if [ ! -d "$SDIST" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK/src"
    tar xzf "$SDIST.tar.gz" -C "$WORK/src"
  fi
  LLAMA_CPP_SRC=$SDIST/vendor/llama.cpp
fi

# a system toolkit without cuBLAS (some images ship only nvcc and the runtime) cannot link it
has_cublas() {
  local bin
  bin=$(command -v nvcc) || return 1
  [ -n "$(find "$(dirname "$(readlink -f "$bin")")/.." -name 'libcublas.so*' 2>/dev/null | head -1)" ]
}
if ! has_cublas; then
  TK=$WORK/toolkit/nvidia/cu13
  if [ ! -x "$TK/bin/nvcc" ]; then
    "$PY" -m pip install --target "$WORK/toolkit" "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" \
      "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.0.*" \
      "nvidia-cuda-cccl==13.0.*"
    ln -sfn lib "$TK/lib64"
    for lib in cudart cublas cublasLt; do  # CMake's FindCUDAToolkit wants unversioned names
      so=$(find "$TK/lib" -name "lib$lib.so.*" | sort | head -1)
      ln -sfn "$(basename "$so")" "$TK/lib/lib$lib.so"
    done
  fi
  export PATH=$TK/bin:$PATH CUDAToolkit_ROOT=$TK
fi

if [ -z "${CUDA_ARCH:-}" ]; then
  if ! CUDA_ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .) \
     || [ -z "$CUDA_ARCH" ]; then
    echo "error: no NVIDIA GPU found (nvidia-smi); set CUDA_ARCH (e.g. 90) to build for one" >&2
    exit 2
  fi
fi

# From llama.cpp's top level (the sdist's ggml folder is trimmed and does not configure alone),
# with nothing of llama.cpp's own built. GGML_CUDA_NO_VMM: no libcuda needed at link time.
cmake -S "$LLAMA_CPP_SRC" -B "$WORK/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU=OFF -DGGML_CUDA=ON \
  -DGGML_CUDA_NO_VMM=ON -DGGML_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$WORK/cmake" --target ggml-cuda -j "${JOBS:-$(nproc)}"
install -m 644 "$(find "$WORK/cmake" -name libggml-cuda.so | head -1)" "$DEST/libggml-cuda.so"
echo "installed $DEST/libggml-cuda.so (sm_$CUDA_ARCH, ggml of llama-cpp-python $VERSION)"
