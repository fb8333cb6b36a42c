# The two commands of the README: `make demo` and `make test`. Each sets everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo test bench lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build (a bare `torch` would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,deepspeed,lightning,hf]" torch==2.13.0
	# strace proves the fsync order of a save; install it when we may (root), else that test skips
	-command -v strace >/dev/null || (command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && apt-get install -y -qq strace) >/dev/null 2>&1)
	touch $@

demo: setup
	$(PY) examples/demo.py

test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=30

bench: setup
	$(PY) benchmarks/compare.py

lint: setup
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy
