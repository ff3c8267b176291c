# Set-up and the two everyday commands. `make test` and `make run` create the
# virtual environment on first use (CPU torch 2.13.0, then this package).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test run setup

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest

run: setup
	$(VENV)/bin/serve run configs/tiny.yaml
