# Every target sets itself up: a fresh clone needs nothing but python3 (>= 3.10) and a C compiler
# (llama-cpp-python, the oracle, builds from source: a few minutes on 2 cores, once).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m-instruct
# llama.cpp's AMX kernels crash on Sapphire Rapids machines we run on (segfault in
# ggml_backend_amx_mul_mat on the first matmul, ggml-org/llama.cpp#20824), so x86-64 builds of
# llama-cpp-python leave them out; its AVX-512 and AVX2 kernels stay. pip's wheel cache would
# reuse a build made with other flags (it ignores CMAKE_ARGS), hence --no-cache-dir.
LLAMA_CMAKE_ARGS := $(if $(filter x86_64 amd64,$(shell uname -m)),-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8)

.PHONY: setup chat test test-arm cuda rpc lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc 2>/dev/null || echo 2) \
		$(BIN)/pip install --no-cache-dir -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Opens the chat TUI; the model is pulled on first use (progress on the loading screen).
chat: setup
	$(BIN)/edgeinfer chat $(MODEL)

# tests/test_rpc.py needs ggml's RPC module: built once (about a minute), then a no-op.
test: setup rpc
	$(BIN)/python -m pytest

# The tests that need no llama.cpp, on aarch64 under QEMU user-mode emulation (Linux, root:
# debootstrap and qemu-user-static come from apt-get; the arm64 system is cached in .cache/arm).
test-arm:
	tools/arm/test.sh

# ggml's CUDA backend module for --gpu-layers / --offload ...@cuda (needs an NVIDIA GPU; never part
# of `make test`): bench/build_cuda.sh builds it from the pinned llama-cpp-python's source.
cuda: setup
	bench/build_cuda.sh

# ggml's RPC backend module for --rpc and `edgeinfer rpc-server` (CPU only, small): bench/build_rpc.sh
# builds it from the pinned llama-cpp-python's source into $(EDGEINFER_HOME)/ggml, once.
rpc: setup
	bench/build_rpc.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python bench/kernels.py

clean:
	rm -rf $(VENV) build *.egg-info
