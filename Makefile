# Every target sets itself up: a fresh clone needs nothing but python3 (>= 3.10) and a C compiler
# (llama-cpp-python, the oracle, builds from source: a few minutes on 2 cores, once).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m-instruct

.PHONY: setup chat test lint format bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc 2>/dev/null || echo 2) $(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Opens the chat TUI; the model is pulled on first use (progress on the loading screen).
chat: setup
	$(BIN)/edgeinfer chat $(MODEL)

test: setup
	$(BIN)/python -m pytest

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
