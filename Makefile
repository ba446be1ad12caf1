# Two commands from a bare machine (Python 3.11+ and make):
#   make demo   creates .venv on first use, installs stmoe with what the demo needs,
#               runs `stmoe demo` on the shipped model, which ends with where the report is
#   make test   the same environment plus the test tools, then lint and the test suite
# VENV=path chooses another environment folder; PYTHON=python3.12 another interpreter.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# stamps: reinstall only when pyproject.toml changes
$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[hf]'
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[hf,dev]'
	touch $@ $(VENV)/.installed-demo

# its last line says where the report is (stmoe-demo/index.html, or in ARGS="-o DIR")
demo: $(VENV)/.installed-demo
	$(BIN)/stmoe demo $(ARGS)

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

clean-venv:
	rm -rf $(VENV)
