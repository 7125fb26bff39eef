# loraserve developer commands. `make test` and `make demo` are the two a newcomer needs.
SHELL := /bin/bash
VENV ?= .venv
PY ?= $(VENV)/bin/python
# The GPU machine has its own python3 with torch/triton/transformers/peft preinstalled.
GPU_PY ?= python3
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: setup protos fmt lint test gpu-test bench demo down clean

# Idempotent: rebuilds the venv only when the project's requirements change.
setup: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and exactly: the CPU build on local disk, not a multi-GB CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

protos: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/adapter_store.proto protos/inference.proto

fmt: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The CPU tests interpret the kernels; every distinct launch they make is then compiled for
# sm_90 (tools/sm90_compile.py), so a kernel only the interpreter accepts fails here too.
LAUNCH_LOG ?= .launch_log
test: setup
	rm -rf $(LAUNCH_LOG)
	LORASERVE_LAUNCH_LOG=$(CURDIR)/$(LAUNCH_LOG) $(PY) -m pytest -n 2 --dist loadfile --durations=25 $(PYTEST_ARGS)
	$(PY) tools/sm90_compile.py $(LAUNCH_LOG)

# Only the folders with GPU tests: the GPU image lacks redis/boto3, which the service tests import.
GPU_TEST_DIRS := $(wildcard tests/kernels tests/model tests/inference tests/lora tests/e2e_gpu)

gpu-test:
	$(GPU_PY) -m pytest -m gpu -p no:cacheprovider $(PYTEST_ARGS) $(GPU_TEST_DIRS)

bench:
	bash bench/run_all.sh

# The whole stack on this machine (CPU), left running; `make down` stops it. DEMO_ARGS
# passes options, e.g. DEMO_ARGS="--prompts 1 --max-new-tokens 16".
DEMO_ARGS ?=
demo: setup
	$(PY) -m tools.demo $(DEMO_ARGS)

down: setup
	$(PY) -m tools.demo --down

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache $(LAUNCH_LOG)
