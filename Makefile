# The two set-up commands: `make train` and `make test`. Both create .venv when missing and install
# the project into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trmoe-installed
# The torch build to install when the venv has none. On a CPU-only machine this pin picks the CPU wheel
# (an open `torch` requirement would pull a multi-GB CUDA build); on a GPU machine use e.g.
# `make train TORCH_SPEC=torch`.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# Test processes (pytest-xdist; `auto` = one per core). Each test file runs whole in one process, so a file's
# module fixtures are built once; TEST_WORKERS=0 runs everything in this process. `make test` runs every tier
# (CI's); ARGS='-m "not slow and not subprocess"' is the quick local one (tests/README.md).
# --no-loadscope-reorder: the files start in the order tests/conftest.py gives them (the longest first), not
# pytest-xdist's (the most tests first), so a long file does not start last with the other core idle.
TEST_WORKERS ?= auto

.PHONY: install train test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --disable-pip-version-check -q "$(TORCH_SPEC)"
	$(PY) -m pip install --disable-pip-version-check -q -e ".[dev]"
	@touch $(STAMP)

train: $(STAMP)
	$(PY) -m trmoe.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check trmoe tests
	$(VENV)/bin/ruff format --check trmoe tests

clean:
	rm -rf $(VENV) build dist *.egg-info
