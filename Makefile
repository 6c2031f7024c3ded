# dynamiq-mpi: build and test.
#
#   make test             venv + build, serial suite, then MPI suite at NP_LIST world sizes
#                         (6: nodes of 2 and 3 for the hierarchical call)
#   make test-installed   same suites with $(PYTHON) and the packages it already has
#                         (the GPU machine: system Python 3.12 + Open MPI, no package index)
#   make demo             venv + build, then mpiexec -n $(DEMO_NP) python -m dynamiq_mpi demo
#   make venv / build / wheels / clean / distclean
#
# Overridable: NP_LIST="2 3 4 6 8"  PYTHON=python3 (test-installed)  PYTHON_BOOT=python3
#              (creates the venv)  MPI_TIMEOUT=600 (seconds per world size)  DEMO_NP=4
#              PYTEST_ARGS="-k ring -x"  MPI_TESTS=tests/mpi  SERIAL_TESTS=tests
# See tools/testing/run_tests.sh for the rest.
#
# pytest-mpi on a machine without a package index (test-installed): run `make wheels`
# where PyPI is reachable and carry .whl/ along; when $(PYTHON) cannot import
# pytest_mpi, tools/testing/run_tests.sh installs .whl/pytest_mpi*.whl with
#   $(PYTHON) -m pip install --no-index --no-deps --target /tmp/site .whl/pytest_mpi*.whl
# and puts /tmp/site on PYTHONPATH (PYTEST_MPI_SITE overrides the folder).

SHELL        := /bin/bash
.DEFAULT_GOAL := test

PYTHON_BOOT  ?= python3
PYTHON       ?= python3
VENV         ?= .venv
NP_LIST      ?= 2 3 4 6 8
MPI_TIMEOUT  ?= 600
DEMO_NP      ?= 4

export MPI_TIMEOUT

# The CUDA kernels of a development build: SASS for the test GPUs (H100/H200)
# only, one architecture's compile time where a user install's default builds
# every data-centre GPU nvcc supports (setup.py).  Override: DYNAMIQ_CUDA_ARCH="80;90" make ...
DYNAMIQ_CUDA_ARCH ?= 90
export DYNAMIQ_CUDA_ARCH

VPY          := $(VENV)/bin/python
DEPS_STAMP   := $(VENV)/.deps-stamp
BUILD_STAMP  := $(VENV)/.build-stamp
# Anything whose change needs the extension rebuilt.
EXT_SOURCES  := setup.py setup.cfg pyproject.toml \
                $(wildcard pyx/*.pyx pyx/*.pxd pyx/*.pxi dynamiq_mpi/*.pxd \
                           src_cuda/*.h src_cuda/*.hpp src_cuda/*.cpp src_cuda/*.cu src_cuda/*.cuh)

# Run from outside the tree: the extension must import through the editable install,
# from this checkout.
export EXT_CHECK := import sys, dynamiq_mpi._cpu as m; sys.exit(not m.__file__.startswith(sys.argv[1] + "/"))

# Open MPI switches for every mpiexec call (MPICH ignores them); OMP_NUM_THREADS=1
# keeps N ranks from each starting a thread per core.
MPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
           OMPI_MCA_rmaps_base_oversubscribe=1 \
           PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe \
           OMP_NUM_THREADS=1 MPIEXEC_TIMEOUT=$(MPI_TIMEOUT)

.PHONY: venv build test test-installed build-installed demo demo-installed wheels clean distclean

# ------------------------------------------------------------------ venv
venv: $(DEPS_STAMP)

# requirements-torch.txt: the PyTorch adapter's tests and mpi_examples/train_lm.py
# (torch pinned to the CPU wheel on the CI machine's disk).
$(DEPS_STAMP): requirements-dev.txt requirements-torch.txt
	@test -x $(VPY) || { echo "creating $(VENV) with $(PYTHON_BOOT)"; $(PYTHON_BOOT) -m venv $(VENV); }
	$(VPY) -m pip install -r requirements-dev.txt -r requirements-torch.txt
	@touch $@

# ------------------------------------------------------------------ build
# Editable install of the package (compiles dynamiq_mpi._cpu in place).  Redone
# when a source of the extension changed or the extension no longer imports.
build: $(DEPS_STAMP)
	@if [ -f $(BUILD_STAMP) ] && [ -z "$$(find $(EXT_SOURCES) -newer $(BUILD_STAMP) 2>/dev/null)" ] \
	     && (cd / && $(CURDIR)/$(VPY) -c "$$EXT_CHECK" $(CURDIR)) 2>/dev/null; then \
	    echo "build: up to date"; \
	else \
	    set -e; t0=$$(date +%s); \
	    $(VPY) -m pip install --no-build-isolation --no-deps -e .; \
	    touch $(BUILD_STAMP); echo "build: done in $$(( $$(date +%s) - t0 ))s"; \
	fi

# ------------------------------------------------------------------ tests
test: build
	tools/testing/run_tests.sh $(VPY) $(NP_LIST)

# On the GPU machine: no venv, no index.  Editable install if pip can do it
# (it cannot on an externally managed system Python), else an in-place build.
build-installed:
	@$(PYTHON) -m pip install --no-build-isolation --no-deps -e . \
	  || { echo "build-installed: pip editable install unavailable; building in place"; \
	       $(PYTHON) setup.py build_ext --inplace; }

test-installed: build-installed
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} tools/testing/run_tests.sh $(PYTHON) $(NP_LIST)

# ------------------------------------------------------------------ demo
demo: build
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(MPI_ENV) \
	  timeout -k 15 $$(( $(MPI_TIMEOUT) + 30 )) mpiexec -n $(DEMO_NP) $(VPY) -m dynamiq_mpi demo </dev/null

demo-installed: build-installed
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(MPI_ENV) \
	  timeout -k 15 $$(( $(MPI_TIMEOUT) + 30 )) mpiexec -n $(DEMO_NP) $(PYTHON) -m dynamiq_mpi demo </dev/null

# ------------------------------------------------------------------ misc
# The pytest-mpi wheel to carry to a machine without a package index.
wheels: $(DEPS_STAMP)
	$(VPY) -m pip download --no-deps --only-binary :all: -d .whl \
	  "$$(grep -i '^pytest-mpi==' requirements-dev.txt)"

clean:
	rm -rf build dist *.egg-info .mpi-logs .pytest_cache $(BUILD_STAMP)
	find dynamiq_mpi -name '*.so' -delete
	rm -f pyx/*.cpp
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
