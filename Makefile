# Two commands from a bare machine (Python 3.11+ and make):
#   make demo   creates .venv on first use, installs stmoe with what the demo needs,
#               runs `stmoe demo` on the shipped model, which ends with where the report is
#   make test   the same environment plus the test tools, then lint and the test suite
#               (and the vLLM plugin's tests in a second environment, $(VENV)-vllm, with
#               vLLM's CPU build: docs/vllm.md; and the tests of stmoe's transformers glue
#               against the GPU machines' transformers: test-gpu-versions)
# VENV=path chooses another environment folder; PYTHON=python3.12 another interpreter.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

VLLM_VENV := $(VENV)-vllm
VLLM_BIN := $(VLLM_VENV)/bin

.PHONY: demo test test-vllm test-gpu-versions clean-venv

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

# The main suite two tests at a time (pytest-xdist: its tests take about one core each, so
# two workers take 5.6 minutes where one took 8.4, journal 2026-12-07-ci-time), each worker's
# torch on one thread (OMP_NUM_THREADS=1: two threads a worker on two cores spun against
# each other, 635 s against 524 s, journal 2026-12-08-ci-time); then the GPU machines'
# releases' tests the same way while .venv-vllm installs beside them, then the vLLM plugin's
# tests
test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2
	$(MAKE) -j2 --output-sync=target test-gpu-versions $(VLLM_VENV)/.installed-vllm
	$(MAKE) test-vllm

# the vLLM plugin's tests inside the real vLLM (the main run skips them: no vLLM there), two
# files at a time (tests/conftest.py says why and how)
test-vllm: $(VLLM_VENV)/.installed-vllm
	$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile \
		--no-loadscope-reorder tests/vllm_plugin

# The GPU machines the prepared check runs on (benchmarks/gpu_check.py, docs/runtime.md) hold
# older releases than .venv's (read there: transformers 5.17, huggingface_hub 1.33,
# accelerate 1.15), and nothing can be installed there but carried wheels. Code that works
# only with the newest transformers fails there, or gives wrong tokens with no error (5.17
# passes the KV cache by another name), and a GPU session is too short to find out. So the
# tests of everything that touches transformers' modules run again with those three
# releases laid over .venv's (PYTHONPATH; torch stays .venv's).
GPU_TRANSFORMERS := 5.17.0
GPU_VERSIONS := transformers==$(GPU_TRANSFORMERS) huggingface-hub==1.33.0 accelerate==1.15.0
GPU_SITE := $(VENV)-gpu-versions
GPU_TESTS := tests/hf tests/serve/test_step_forward.py tests/serve/test_step_rows.py \
	tests/runtime/test_transformers_versions.py tests/runtime/test_quantized.py \
	tests/runtime/test_gpu_tiers.py tests/runtime/test_gpu_quantized.py \
	tests/runtime/test_gpu_check.py tests/runtime/test_gpu_check_rerun.py \
	tests/runtime/test_host_lock.py tests/runtime/test_stream_order.py

$(GPU_SITE)/.installed: Makefile | $(BIN)/python
	rm -rf $(GPU_SITE)
	$(BIN)/python -m pip install --quiet --no-deps --no-compile --target $(GPU_SITE) \
		$(GPU_VERSIONS)
	touch $@

test-gpu-versions: $(VENV)/.installed-test $(GPU_SITE)/.installed
	PYTHONPATH=$(abspath $(GPU_SITE)) $(BIN)/python -c 'import transformers as t; \
		assert t.__version__ == "$(GPU_TRANSFORMERS)", t.__file__'
	PYTHONPATH=$(abspath $(GPU_SITE)) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q \
		-p no:cacheprovider -n 2 $(GPU_TESTS)

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(GPU_SITE)
