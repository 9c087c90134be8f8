# The two commands of the README, each doing all of its own set-up (idempotent, fast when done).
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
PYTEST_ARGS ?=
FAULTS_ARGS ?=
MODULES ?=
MUTATION_ARGS ?=

.PHONY: example test test-long test-gpu test-fast faults mutation install install-slurm lint

## make example: install, then train the digits MLP with horovod-torch on $(NP) processes
example: install
	$(VENV)/bin/horovodrun -np $(NP) --gloo $(PY) examples/train_digits.py

## make test: install (with the Slurm daemons), then run the test suite (all but `long`)
test: install-slurm
	$(PY) -m pytest -m "not long" $(PYTEST_ARGS)

## make test-long: the longest multi-process runs (every sharded stage and pipeline schedule
## per backend, the bring-your-own examples)
test-long: install-slurm
	$(PY) -m pytest -m long $(PYTEST_ARGS)

## make test-gpu: the tests that need a GPU (elsewhere each is reported as skipped, with why)
test-gpu: install
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

## make test-fast: the suite without the multi-process (slow) tests
test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

## make faults: install, then apply each hand-written fault of tools/faults.py (gradients not
## averaged or averaged twice, a fixed dropout seed, ...) to a scratch copy of the code and run
## the tests that must catch it; fails unless every fault turns a test red (docs/faults.md)
faults: install
	$(PY) tools/faults.py $(FAULTS_ARGS)

## make mutation: install, then install the pinned mutmut (requirements-mutation.txt) and mutate
## the framework-free core module by module against its fast unit tests (tools/mutation.py, in
## scratch copies under build/mutation/); MODULES=toolkit/data/sampler.py chooses modules, all by
## default; MUTATION_ARGS=--write-doc updates the table of docs/mutation.md. Not part of make test
mutation: install
	$(VENV)/bin/pip install -q -c constraints.txt -r requirements-mutation.txt
	$(PY) tools/mutation.py $(MUTATION_ARGS) $(MODULES)

install:
	TOOLKIT_VENV=$(abspath $(VENV)) bash tools/install.sh

install-slurm:
	TOOLKIT_VENV=$(abspath $(VENV)) bash tools/install.sh --slurm

lint:
	$(VENV)/bin/ruff check toolkit adapters examples tests benchmarks
