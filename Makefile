# A newcomer's two commands: `make test` and `make demo`. Both build .venv with python3.12 first.
SHELL := /bin/bash
VENV := .venv
# python3.12 from PATH, else a pyenv install of 3.12 (the shim only answers when selected).
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test test-fast demo clean

# The stamp is rebuilt when missing or older than pyproject.toml.
$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: python3.12 not found (install Python 3.12)"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

venv: $(VENV)/.installed

# --durations: the CI log names the slowest tests (the suite's time is watched: benchmarks/NOTES.md v18).
test: venv
	JAX_PLATFORMS=cpu TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

# Inner loop: skip the slow real-model tests.
test-fast: venv
	JAX_PLATFORMS=cpu TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Decode a ≥1K-token real-text prompt through the INT2 cache and through BF16, and compare.
demo: venv
	$(PY) -m oscar_jax.demo

clean:
	rm -rf $(VENV) build *.egg-info
