# pagedinfer — one entry point for every job.
#   make demo      generate with a small local Qwen3 checkpoint (built with random weights unless MODEL=DIR)
#   make test      fresh virtual environment, lint, typecheck, layering check, all CPU tests
#   make test-gpu  GPU tests with the Python already on a CUDA machine (no install step)
#   make bench     CPU-scale throughput benchmark and block-pool benchmark
#   make bench-gpu one markdown report on a CUDA machine (GPU_REPORT=FILE): GPU tests, throughput
#                  vs transformers, copy bandwidth and the HBM bound, a decode/prefill profile
#   make mutation  mutation testing (mutmut) of domain/, the sampler and the stop rules; not part
#                  of make test (tens of minutes on 2 cores); see docs/testing.md

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
MODEL ?=
GPU_REPORT ?= gpu-report.md
GPU_REPORT_ARGS ?=
MUTANTS ?=
MUTATION_JOBS ?= 2

.PHONY: install lint typecheck layers test test-unit test-gpu demo bench bench-pool bench-gpu clean
.PHONY: mutation

install: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -c constraints-cpu.txt torch==2.13.0
	$(VPY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

layers: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache

test: lint typecheck layers
	$(VPY) -m pytest -m "not gpu" $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(VPY) -m pytest -m "not gpu" $(PYTEST_ARGS)

# Runs on a CUDA machine with the interpreter that already has torch (no network needed).
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest -m gpu tests/gpu -p no:cacheprovider $(PYTEST_ARGS)

demo: $(STAMP)
	$(VPY) -m pagedinfer demo $(if $(MODEL),--model $(MODEL),) $(if $(NUM_THREADS),--num-threads $(NUM_THREADS),)

bench: bench-pool $(STAMP)
	$(VPY) benchmarks/throughput.py --device cpu --scale cpu

bench-pool: $(STAMP)
	$(VPY) benchmarks/block_pool.py

# Runs on a CUDA machine with the interpreter that already has torch (no install, no network);
# about 5 minutes on one H100 (measured). GPU_REPORT_ARGS=--all-tests runs every GPU test.
bench-gpu:
	PYTHONPATH=src $(PYTHON) benchmarks/gpu_report.py --out $(GPU_REPORT) $(GPU_REPORT_ARGS)

# Mutants live in a copy (mutants/), never in src/. A plain run starts afresh; MUTANTS="glob"
# (e.g. MUTANTS='pagedinfer.domain.block_pool*') re-runs only those, keeping the other results.
mutation: $(STAMP)
	$(if $(MUTANTS),,rm -rf mutants)
	nice -n 10 $(VENV)/bin/mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	$(VPY) tests/mutation/scores.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis mutants
