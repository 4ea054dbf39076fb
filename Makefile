# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# CPU machines get the local CPU build of torch; a machine with an NVIDIA GPU gets the default build.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo "torch>=2.9" || echo "torch==2.13.0")
PYTEST_ARGS ?=

.PHONY: install demo test test-quick plan bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/python -m launcher.demo

# --durations: the 40 slowest tests end the log (the suite's time is kept under ~30 min)
test: install
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -n 2 --dist loadgroup --durations=40 $(PYTEST_ARGS)

# The edit loop: everything but the tests marked slow (multi-process and training runs, Slurm,
# data_prep end to end); `make test` still runs them all.
test-quick: install
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -m "not slow" -n 2 --dist loadgroup $(PYTEST_ARGS)

plan: install
	$(BIN)/python -m launcher.plan $(ARGS)

bench: install
	$(BIN)/python bench/plan_speed.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
