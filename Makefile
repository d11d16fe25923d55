# ampfuse developer entry points.
#   make demo    - run the mixed-precision demo (bootstraps everything on a fresh machine)
#   make test    - build the native library and run the C++ and Python test suites, then run them
#                  again with CPU tensors going through the CUDA kernels under the emulator, once in
#                  forward order and once in a seeded random block/thread order (CUEMU_SEED=N
#                  replays one)
#   make bench   - CPU benchmarks against torch, and the host cost of the CUDA dispatch path with
#                  the launches stubbed (results under benchmarks/results/)
#   make build   - configure + build the native library, install it into python/ampfuse
#   make docs    - the manual (docs/, Sphinx + MyST) into build/docs/html, warnings as errors
#   make wheel   - dist/: an sdist and a binary wheel built from it (tools/build_wheel.py)
#   make test-torch-matrix - CPU-only build + the Python suites against every supported torch
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
# builds one) reuses the objects of the first. The sanitized emulator compiles with -g, for which
# ccache would also hash the working directory (a miss in every new clone); the debug info's paths
# are the only thing that differs, so it is told not to.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all venv sysdeps build test test-cpp test-py test-emulated test-sanitize $(SANITIZED_LIB) demo bench clean \
  cuda-coverage cuda-mutants wheel test-torch-matrix test-oldest-torch docs typecheck

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

# --- release artifacts -------------------------------------------------------------------------------
# dist/ampfuse-<version>.tar.gz and dist/ampfuse-<version>+torch<X.Y><cuda>-py3-none-manylinux_*.whl
# for the development virtualenv's torch; CUDA kernels for CUDA_ARCHS. The wheel is built from the
# sdist with the same compile flags as `make build` (ccache hits).
wheel: | venv sysdeps
	MAX_JOBS=$(MAX_JOBS) AMPFUSE_CUDA=$(AMPFUSE_CUDA) $(PY) tools/build_wheel.py --cuda-archs "$(CUDA_ARCHS)"

# --- supported torch range ---------------------------------------------------------------------------
# CPU-only builds (AMPFUSE_CUDA=OFF) against every torch release the README lists as tested, each in
# its own cached virtualenv and build directory (tools/test_torch.sh); "dev" is .venv's torch.
# TORCH_OLDEST is the oldest supported release: `make test` runs the op, optimizer and scaler
# suites against it.
TORCH_OLDEST := 2.13.0+cpu
TORCH_MATRIX := $(TORCH_OLDEST) dev
MATRIX_IGNORE := --ignore=tests/integrations --ignore=tests/test_packaging.py --ignore=tests/test_ptxas.py \
  --ignore=tests/test_gpu_check.py --ignore=tests/test_bench.py --ignore=tests/test_demo.py \
  --ignore=tests/test_cpp_crosslang.py --ignore=tests/test_cuda_kernels.py
OLDEST_SUITES := tests/test_ops.py tests/test_optim.py tests/test_grad_scaler.py

test-oldest-torch: | sysdeps
	MAX_JOBS=$(MAX_JOBS) tools/test_torch.sh $(TORCH_OLDEST) $(XDIST) $(OLDEST_SUITES)

test-torch-matrix: | venv sysdeps
	set -e; for v in $(TORCH_MATRIX); do MAX_JOBS=$(MAX_JOBS) tools/test_torch.sh $$v $(XDIST) $(MATRIX_IGNORE) tests; done

# --- tests -------------------------------------------------------------------------------------------
# Passes (CONTRIBUTING.md describes each):
#   test-cpp        ctest: the C++ API's gtests, the cross-language and consumer-package tests
#   test-py         every Python suite on the CPU kernels but the kernel-level one (test-sanitize
#                   runs it), pytest-xdist over both cores
#   test-emulated   CPU tensors through the CUDA kernels under the emulator
#                   (AMPFUSE_CPU_KERNELS=cuda-emulated): ctest and every suite that reaches a kernel
#                   but the kernel-level and op suites, in forward order; then ctest and the launch
#                   suite in a seeded random block and thread order with two worker threads (printed;
#                   `make test-emulated CUEMU_SEED=N` replays it)
#   test-sanitize   the kernel-level suite (tests/test_cuda_kernels.py: the CUDA table against the
#                   CPU table, case by case) and the op suite through the emulated CUDA table built
#                   with ASan + UBSan in forward order, then the kernel-level suite in the seeded
#                   random order; any report fails
#   test-oldest-torch  a CPU-only build against the oldest supported torch: op, optimizer, scaler suites
#   docs            the manual, warnings as errors; typecheck: mypy over the package
# Every suite that reaches a kernel thus runs natively and emulated, the kernel-level and op suites
# under both schedules (with the sanitizers, which change no result, only add checks). The
# multi-process (torch.distributed), packaging, integration, demo, benchmark and GPU-check suites
# test no kernel code of their own and run in the native pass only.
ifndef CUEMU_SEED
CUEMU_SEED := $(shell date +%s)
endif
PYTEST := AMPFUSE_CPP_BUILD_DIR=$(abspath $(BUILD_DIR)) AMPFUSE_REQUIRE_EMULATION=1 PYTHONPATH=python $(PY) -m pytest -q \
  -p no:cacheprovider --durations=8
XDIST := -n $(MAX_JOBS) --dist loadfile --no-loadscope-reorder
XDIST_TESTS := -n $(MAX_JOBS) --dist load
EMULATED := AMPFUSE_CPU_KERNELS=cuda-emulated
NOT_EMULATED_CTEST := -E "ampfuse_cpp_consumer|cuemu_selftest"
NATIVE_ONLY := --ignore=tests/test_bench.py --ignore=tests/test_gpu_check.py --ignore=tests/test_packaging.py \
  --ignore=tests/test_demo.py --ignore=tests/integrations --ignore=tests/test_distributed.py \
  --ignore=tests/test_distributed_mesh.py --ignore=tests/test_ptxas.py
KERNEL_SUITES := tests/test_cuda_kernels.py tests/test_ops.py
FORWARD := CUEMU_BLOCK_ORDER=forward CUEMU_THREAD_ORDER=forward CUEMU_WORKERS=1
RANDOM := CUEMU_BLOCK_ORDER=random CUEMU_THREAD_ORDER=random CUEMU_WORKERS=2 CUEMU_SEED=$(CUEMU_SEED)
# ASan must be the first library of the process; libstdc++ is preloaded with it because python
# itself does not link it and the sanitizer runtime's C++ interceptors need it at start-up.
SANITIZED_LIB := $(abspath $(BUILD_DIR))/libampfuse_cuemu_sanitized.so
# The sanitizer's random-schedule pass leaves out the optimizer steps' exhaustive dtype x offset x
# option cases: they test indexing, which the forward pass covers; block order matters for the
# cross-block work (reductions, tickets, the step counters), which the other optimizer cases of
# the kernel-level suite reach in this pass too (more tensors than one launch, grids smaller
# than the chunks, skipped steps). Leaving them out keeps the pass short.
RANDOM_SANITIZE_SELECT := -k "not every_dtype_offset_and_option"
SANITIZE := AMPFUSE_TEST_CUEMU=0 LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)" \
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 AMPFUSE_CUEMU_LIBRARY=$(SANITIZED_LIB)

test-cpp: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(MAX_JOBS)

test-py: build
	$(PYTEST) $(XDIST) --ignore=tests/test_cuda_kernels.py tests

test-emulated: build
	@echo "== emulated CUDA kernels, forward schedule"
	cd $(BUILD_DIR) && $(EMULATED) $(FORWARD) ctest --output-on-failure -j $(MAX_JOBS) $(NOT_EMULATED_CTEST)
	$(EMULATED) $(FORWARD) $(PYTEST) $(XDIST) $(NATIVE_ONLY) $(KERNEL_SUITES:%=--ignore=%) tests
	@echo "== emulated CUDA kernels, random schedule: CUEMU_SEED=$(CUEMU_SEED)"
	cd $(BUILD_DIR) && $(EMULATED) $(RANDOM) ctest --output-on-failure -j $(MAX_JOBS) $(NOT_EMULATED_CTEST)
	$(EMULATED) $(RANDOM) $(PYTEST) tests/test_launches.py

$(SANITIZED_LIB): build
	cmake --build $(BUILD_DIR) -j $(MAX_JOBS) --target ampfuse_cuemu_sanitized

test-sanitize: $(SANITIZED_LIB)
	@echo "== emulated CUDA kernels with ASan + UBSan, forward schedule"
	$(SANITIZE) $(EMULATED) $(FORWARD) $(PYTEST) $(XDIST_TESTS) $(KERNEL_SUITES)
	@echo "== emulated CUDA kernels with ASan + UBSan, random schedule: CUEMU_SEED=$(CUEMU_SEED)"
	$(SANITIZE) $(EMULATED) $(RANDOM) $(PYTEST) $(XDIST_TESTS) $(RANDOM_SANITIZE_SELECT) tests/test_cuda_kernels.py

test: test-cpp test-py test-emulated test-sanitize test-oldest-torch docs typecheck

# --- the manual and the type check -------------------------------------------------------------------
# The Performance page's figures are generated from the newest benchmarks/results/*.json first.
DOCS_OUT := $(BUILD_DIR)/docs
docs: build
	PYTHONPATH=python $(PY) benchmarks/report.py --docs docs/_generated/results.md
	PYTHONPATH=python $(PY) -m sphinx -W --keep-going -q -b html -d $(DOCS_OUT)/doctrees docs $(DOCS_OUT)/html
	@echo "the manual: $(DOCS_OUT)/html/index.html"

typecheck: build
	$(PY) -m mypy --config-file pyproject.toml

# --- demo and benchmarks -----------------------------------------------------------------------------
demo: build
	PYTHONPATH=python $(PY) -m ampfuse.demo $(ARGS)

bench: build
	$(PY) -m pip install -q --no-deps -r benchmarks/requirements-peers.txt
	PYTHONPATH=python $(PY) benchmarks/run.py $(ARGS)
	PYTHONPATH=python $(PY) benchmarks/host_overhead.py

clean:
	rm -rf $(BUILD_DIR) python/ampfuse/lib python/ampfuse/include python/ampfuse/share

# --- evidence for the emulated CUDA suites (on demand, after `make build`) ---------------------------
cuda-coverage: build
	$(PY) tests/cuemu/coverage.py

cuda-mutants: build
	$(PY) tests/cuemu/mutants.py
