# ampfuse developer entry points.
#   make demo    - run the mixed-precision demo (bootstraps everything on a fresh machine)
#   make test    - build the native library and run the C++ and Python test suites, then run them
#                  again with CPU tensors going through the CUDA kernels under the emulator, once in
#                  forward order and once in a seeded random block/thread order (CUEMU_SEED=N
#                  replays one)
#   make bench   - CPU benchmarks against torch (results under benchmarks/results/)
#   make build   - configure + build the native library, install it into python/ampfuse
#
# The Python environment lives outside the clone in a cache keyed by requirements-dev.txt
# (AMPFUSE_CACHE, default ~/.cache/ampfuse) and .venv links to it, so a second run (or a second
# clone) reinstalls nothing. Build options: AMPFUSE_CUDA=auto|ON|OFF, DEBUG=1, MAX_JOBS=N,
# CUDA_ARCHS="80;90".

SHELL := /bin/bash
PYTHON_BOOTSTRAP ?= python3
AMPFUSE_CACHE ?= $(HOME)/.cache/ampfuse
REQS := requirements-dev.txt
REQ_HASH := $(shell cat $(REQS) | sha256sum | cut -c1-16)-$(shell $(PYTHON_BOOTSTRAP) -c 'import sys;print("py%d%d" % sys.version_info[:2])')
VENV_DIR := $(AMPFUSE_CACHE)/venv-$(REQ_HASH)
VENV_STAMP := $(VENV_DIR)/.ampfuse-complete
PY := .venv/bin/python
BUILD_DIR ?= build
AMPFUSE_CUDA ?= auto
CUDA_ARCHS ?= 80;90
BUILD_TYPE := $(if $(DEBUG),Debug,Release)
MAX_JOBS ?= $(shell nproc)
# ccache keys compiles on paths relative to the checkout, so a second clone (the pip-install test
# builds one) reuses the objects of the first.
export CCACHE_BASEDIR := $(CURDIR)

.PHONY: all venv sysdeps build test test-cpp test-py test-emulated demo bench clean cuda-coverage cuda-mutants

all: build

# --- system packages (GoogleTest headers/sources, ccache) from Debian --------------------------
sysdeps:
	@missing=""; \
	for p in libgtest-dev ccache libboost-context-dev; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

# --- python environment --------------------------------------------------------------------------
# No file prerequisite: the hash in VENV_DIR already keys the environment on $(REQS), and a fresh
# clone (new mtimes) must reuse it.
$(VENV_STAMP):
	@echo "creating $(VENV_DIR)"
	rm -rf $(VENV_DIR)
	mkdir -p $(AMPFUSE_CACHE)
	$(PYTHON_BOOTSTRAP) -m venv $(VENV_DIR)
	$(VENV_DIR)/bin/python -m pip install -q --upgrade pip
	$(VENV_DIR)/bin/python -m pip install -q -r $(REQS)
	touch $(VENV_STAMP)

.venv: $(VENV_STAMP)
	@if [ "$$(readlink .venv)" != "$(VENV_DIR)" ]; then rm -rf .venv; ln -s $(VENV_DIR) .venv; fi

venv: .venv

# --- native build ----------------------------------------------------------------------------------
$(BUILD_DIR)/build.ninja: CMakeLists.txt | venv sysdeps
	cmake -S . -B $(BUILD_DIR) -G Ninja \
	  -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) \
	  -DAMPFUSE_PYTHON=$(abspath $(PY)) \
	  -DAMPFUSE_CUDA=$(AMPFUSE_CUDA) \
	  -DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" \
	  -DAMPFUSE_BUILD_TESTS=ON \
	  -DAMPFUSE_CUDA_EMULATION=ON \
	  -DCMAKE_INSTALL_PREFIX=$(abspath python/ampfuse)

build: $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(MAX_JOBS)
	cmake --install $(BUILD_DIR) > /dev/null

# --- tests -------------------------------------------------------------------------------------------
# The emulated runs repeat every suite with CPU tensors going through the CUDA kernels
# (AMPFUSE_CPU_KERNELS=cuda-emulated): once in forward order, once in random block and thread order
# with two worker threads and a fresh seed (printed; `make test-emulated CUEMU_SEED=N` replays it).
# The package-consumer and packaging tests, the emulator's self-test, the demo and the benchmark
# and GPU-check smoke tests, which test no kernel code of their own (the packaging test builds and
# runs an installed wheel, never the emulated table), run only in the native pass.
ifndef CUEMU_SEED
CUEMU_SEED := $(shell date +%s)
endif
PYTEST := AMPFUSE_CPP_BUILD_DIR=$(abspath $(BUILD_DIR)) AMPFUSE_REQUIRE_EMULATION=1 PYTHONPATH=python $(PY) -m pytest -q -p no:cacheprovider
EMULATED := AMPFUSE_CPU_KERNELS=cuda-emulated
NOT_EMULATED_CTEST := -E "ampfuse_cpp_consumer|cuemu_selftest"
NOT_EMULATED_PYTEST := --ignore=tests/test_bench.py --ignore=tests/test_gpu_check.py --ignore=tests/test_packaging.py \
  --ignore=tests/test_demo.py --ignore=tests/integrations
FORWARD := CUEMU_BLOCK_ORDER=forward CUEMU_THREAD_ORDER=forward CUEMU_WORKERS=1
RANDOM := CUEMU_BLOCK_ORDER=random CUEMU_THREAD_ORDER=random CUEMU_WORKERS=2 CUEMU_SEED=$(CUEMU_SEED)

test-cpp: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(MAX_JOBS)

test-py: build
	$(PYTEST) tests

test-emulated: build
	@echo "== emulated CUDA kernels, forward schedule"
	cd $(BUILD_DIR) && $(EMULATED) $(FORWARD) ctest --output-on-failure -j $(MAX_JOBS) $(NOT_EMULATED_CTEST)
	$(EMULATED) $(FORWARD) $(PYTEST) $(NOT_EMULATED_PYTEST) tests
	@echo "== emulated CUDA kernels, random schedule: CUEMU_SEED=$(CUEMU_SEED)"
	cd $(BUILD_DIR) && $(EMULATED) $(RANDOM) ctest --output-on-failure -j $(MAX_JOBS) $(NOT_EMULATED_CTEST)
	$(EMULATED) $(RANDOM) $(PYTEST) $(NOT_EMULATED_PYTEST) tests

test: test-cpp test-py test-emulated

# --- demo and benchmarks -----------------------------------------------------------------------------
demo: build
	PYTHONPATH=python $(PY) -m ampfuse.demo $(ARGS)

bench: build
	PYTHONPATH=python $(PY) benchmarks/run.py $(ARGS)

clean:
	rm -rf $(BUILD_DIR) python/ampfuse/lib python/ampfuse/include python/ampfuse/share

# --- evidence for the emulated CUDA suites (on demand, after `make build`) ---------------------------
cuda-coverage: build
	$(PY) tests/cuemu/coverage.py

cuda-mutants: build
	$(PY) tests/cuemu/mutants.py
