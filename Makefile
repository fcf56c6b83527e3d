# Every user-facing target depends on the virtual environment, so a fresh clone needs nothing but `make <target>`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test lint bench-norm clean

venv: $(STAMP)

# The stamp depends on pyproject.toml: editing dependencies reinstalls, otherwise a second call installs nothing.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The default suite (what CI runs): lint, then every test not marked slow.
test: lint
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

bench-norm: $(STAMP)
	$(PY) -m mabn.bench norm --out docs/bench-norm-$$($(PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')").md

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
