# A newcomer's two commands: `make test` and `make demo`. Both build .venv with python3.12 first.
SHELL := /bin/bash
VENV := .venv
# python3.12 from PATH, else a pyenv install of 3.12 (the shim only answers when selected).
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo $$p; break; }; done)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test test-all demo clean

# The stamp is rebuilt when missing or older than pyproject.toml.
$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: python3.12 not found (install Python 3.12)"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

venv: $(VENV)/.installed

# The fast suite, a newcomer's and a developer's loop: every op, dtype and error path at test sizes,
# real-model and compile tests excluded (marked slow). Parallel over the machine's cores.
test: venv
	JAX_PLATFORMS=cpu TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto -m "not slow" --durations=25 $(PYTEST_ARGS)

# Everything, slow tests included: what CI runs (.ci/run).
test-all: venv
	JAX_PLATFORMS=cpu TRITON_INTERPRET=1 $(PY) -m pytest -q -n auto --durations=25 $(PYTEST_ARGS)

# Decode a ≥1K-token real-text prompt through the INT2 cache and through BF16, and compare.
demo: venv
	$(PY) -m oscar_jax.demo

clean:
	rm -rf $(VENV) build *.egg-info
