# pagedinfer — one entry point for every job.
#   make demo      generate with a small local Qwen3 checkpoint (built with random weights unless MODEL=DIR);
#                  installs only what inference needs (CPU torch and the package) into .venv
#   make test      virtual environment with [dev], lint, typecheck, layering check, the GPU
#                  preflight, all CPU tests
#   make gpu-preflight  every Triton kernel configuration the engine launches, compiled for
#                  sm_80, sm_89 and sm_90 on the CPU (no GPU); fails on compile errors and on
#                  shared memory over a target's limit; docs/testing.md
#   make test-gpu  GPU tests with the Python already on a CUDA machine (no install step)
#   make fuzz      the Hypothesis suites of tests/property at their long profile (thorough):
#                  engine state machine, mixed batches, domain machines; about an hour on 2 cores
#   make bench     CPU-scale throughput benchmark and block-pool benchmark
#   make bench-gpu one markdown report on a CUDA machine (GPU_REPORT=FILE): GPU tests, throughput
#                  vs transformers, copy bandwidth and the HBM bound, a decode/prefill profile;
#                  inside GPU_BUDGET_S seconds (450; empty: no budget), sections as they end
#   make mutation  mutation testing (mutmut) of domain/, the sampler and the stop rules; not part
#                  of make test (tens of minutes on 2 cores); see docs/testing.md
#   make test-deps before a release: the library's CPU tests against the newest torch/triton/
#                  transformers and against pyproject.toml's lower bounds, each in a new venv under
#                  .deps/ (about half an hour on 2 busy cores); not part of make test; docs/testing.md

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CORE_STAMP := $(VENV)/.installed-core
PYTEST_ARGS ?= --durations=40
MODEL ?=
GPU_REPORT ?= gpu-report.md
GPU_REPORT_ARGS ?=
MUTANTS ?=
PREFLIGHT_TARGETS ?= 80,89,90
PREFLIGHT_JOBS ?= 2
PREFLIGHT_ARGS ?=
MUTATION_JOBS ?= 2
# make test-deps: where its venvs go, the torch of its newest run (here the newest CPU build; a
# bare `torch` is the newest CUDA build, several GB), extra pip arguments (e.g. an index URL)
# and the tests it runs (docs/testing.md says why these).
DEPS_DIR ?= .deps
DEPS_NEWEST_TORCH ?= torch==2.13.0
DEPS_PIP_ARGS ?=
DEPS_TESTS ?= tests/unit/domain tests/unit/adapters tests/unit/kernels tests/unit/engine \
	tests/unit/distributed tests/unit/test_cli.py
DEPS_SHOW := '^(torch|triton|transformers|tokenizers|huggingface.hub|safetensors|xxhash|tqdm|numpy)=='

.PHONY: install lint typecheck layers gpu-preflight test test-unit test-gpu demo bench bench-pool bench-gpu clean
.PHONY: mutation test-deps test-deps-newest test-deps-lowest

install: $(STAMP)

# What inference needs: the CPU torch and the package with its [engine] extra (no triton:
# CPU inference compiles no kernel; plain `-e .` would be the core install, the scheduler
# alone). make demo stops here; make install / make test add [dev] to the same venv.
$(CORE_STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -c constraints-cpu.txt torch==2.13.0
	$(VPY) -m pip install --quiet -c constraints-cpu.txt -e '.[engine]'
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(VPY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

layers: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache

# Compiles with Triton's own compiler: TRITON_INTERPRET must be unset for it.
gpu-preflight: $(STAMP)
	env -u TRITON_INTERPRET $(VPY) -m pagedinfer.adapters.kernels.preflight \
		--targets $(PREFLIGHT_TARGETS) --jobs $(PREFLIGHT_JOBS) $(PREFLIGHT_ARGS)

test: lint typecheck layers gpu-preflight
	$(VPY) -m pytest -m "not gpu" $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(VPY) -m pytest -m "not gpu" $(PYTEST_ARGS)

.PHONY: fuzz
fuzz: $(STAMP)
	PAGEDINFER_PROPERTY_PROFILE=thorough PAGEDINFER_PROPERTY_PROGRESS=30 $(VPY) -m pytest -q tests/property $(PYTEST_ARGS)

# Runs on a CUDA machine with the interpreter that already has torch (no network needed).
# The device machines have no network: the GPU tests' optional wheels (llguidance) are in
# tests/gpu/wheels/ and installed offline into GPU_SITE (never into PYTHON's site-packages).
GPU_SITE ?= .gpu-site
test-gpu:
	sh tests/gpu/offline_wheels.sh $(PYTHON) $(GPU_SITE)
	PYTHONPATH=src:$(GPU_SITE) $(PYTHON) -m pytest -m gpu tests/gpu -p no:cacheprovider $(PYTEST_ARGS)

demo: $(CORE_STAMP)
	$(VPY) -m pagedinfer demo $(if $(MODEL),--model $(MODEL),) $(if $(NUM_THREADS),--num-threads $(NUM_THREADS),)

bench: bench-pool $(STAMP)
	$(VPY) benchmarks/throughput.py --device cpu --scale cpu

bench-pool: $(STAMP)
	$(VPY) benchmarks/block_pool.py

# Runs on a CUDA machine with the interpreter that already has torch (no install, no network);
# about 8 minutes on one H100 (estimated: 4 measured before the transformers sweep and the FP8
# and structured-outputs runs). GPU_REPORT_ARGS=--all-tests runs every GPU test.
# GPU_BUDGET_S: the budgeted report (most needed sections first, each written to
# $(GPU_REPORT) without .md as it ends, what does not fit skipped); empty: every section.
GPU_BUDGET_S ?= 450
bench-gpu:
	sh tests/gpu/offline_wheels.sh $(PYTHON) $(GPU_SITE)
	PYTHONPATH=src:$(GPU_SITE) $(PYTHON) benchmarks/gpu_report.py --out $(GPU_REPORT) $(if $(GPU_BUDGET_S),--budget-s $(GPU_BUDGET_S),) $(GPU_REPORT_ARGS)

# Mutants live in a copy (mutants/), never in src/. A plain run starts afresh; MUTANTS="glob"
# (e.g. MUTANTS='pagedinfer.domain.block_pool*') re-runs only those, keeping the other results.
mutation: $(STAMP)
	$(if $(MUTANTS),,rm -rf mutants)
	nice -n 10 $(VENV)/bin/mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS)
	$(VPY) tests/mutation/scores.py

# The library's CPU tests (DEPS_TESTS) in two new venvs: (a) the newest torch (DEPS_NEWEST_TORCH),
# triton and transformers pip finds, (b) every requirement of the package and its [test] extra
# pinned at its lower bound in pyproject.toml. Each prints the versions it ran with.
test-deps: test-deps-newest test-deps-lowest

test-deps-newest:
	rm -rf $(DEPS_DIR)/newest
	$(PYTHON) -m venv $(DEPS_DIR)/newest
	$(DEPS_DIR)/newest/bin/python -m pip install --quiet --upgrade pip
	$(DEPS_DIR)/newest/bin/python -m pip install --quiet $(DEPS_PIP_ARGS) '$(DEPS_NEWEST_TORCH)' -e '.[test]'
	$(DEPS_DIR)/newest/bin/python -m pip list --format=freeze > $(DEPS_DIR)/newest.txt
	@echo "test-deps-newest runs with:" && grep -iE $(DEPS_SHOW) $(DEPS_DIR)/newest.txt
	$(DEPS_DIR)/newest/bin/python -m pytest -m "not gpu" -p no:cacheprovider -q $(DEPS_TESTS) $(PYTEST_ARGS)

test-deps-lowest:
	rm -rf $(DEPS_DIR)/lowest
	$(PYTHON) -m venv $(DEPS_DIR)/lowest
	$(DEPS_DIR)/lowest/bin/python -m pip install --quiet --upgrade pip
	$(DEPS_DIR)/lowest/bin/python tests/deps/lowest_constraints.py test > $(DEPS_DIR)/lowest-constraints.txt
	$(DEPS_DIR)/lowest/bin/python -m pip install --quiet $(DEPS_PIP_ARGS) -c $(DEPS_DIR)/lowest-constraints.txt -e '.[test]'
	$(DEPS_DIR)/lowest/bin/python -m pip list --format=freeze > $(DEPS_DIR)/lowest.txt
	@echo "test-deps-lowest runs with:" && grep -iE $(DEPS_SHOW) $(DEPS_DIR)/lowest.txt
	$(DEPS_DIR)/lowest/bin/python -m pytest -m "not gpu" -p no:cacheprovider -q $(DEPS_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(DEPS_DIR) .mypy_cache .ruff_cache .pytest_cache .hypothesis mutants
