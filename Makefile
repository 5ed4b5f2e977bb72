# All set-up lives here: `make demo` and `make test` work on a fresh machine and do not
# reinstall what is already current.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCHREC_VERSION := 1.9.2
BUILD_DIR ?= build/dev
ASAN_DIR ?= build/asan
MARCH ?= native
JOBS ?= $(shell nproc)
SITE = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYTEST_ARGS ?=
# A compiler cache when the machine has one (several checkouts of one tree rebuild fast).
CCACHE := $(shell command -v ccache 2>/dev/null)
CMAKE_LAUNCHER := $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE))
export CCACHE_BASEDIR ?= $(CURDIR)

.PHONY: all setup system-deps build native-test asan-test lint test test-fast demo bench clean

all: build

# ---- environment -------------------------------------------------------------------------
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps-stamp: requirements-cpu.txt | $(VENV)/bin/python
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps torchrec==$(TORCHREC_VERSION)
	touch $@

# UCX backs the rdma transport; installed from apt where we can (root + apt-get).
system-deps:
	@if ! pkg-config --exists ucx 2>/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libucx-dev"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx-dev pkg-config) >/dev/null \
	      || echo "warning: could not install libucx-dev; the rdma transport will not be built"; \
	  else echo "note: UCX (libucx-dev) not found; the rdma transport will not be built"; fi; \
	fi

setup: $(VENV)/.deps-stamp system-deps

# ---- native build (development: the extension lands next to the Python sources) -----------
$(BUILD_DIR)/CMakeCache.txt: | $(VENV)/.deps-stamp
	$(VENV)/bin/cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DPython_EXECUTABLE=$(abspath $(PY)) -DBAGPIPE_INPLACE=ON -DBAGPIPE_MARCH=$(MARCH) \
	  -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) $(CMAKE_LAUNCHER)

build: setup $(BUILD_DIR)/CMakeCache.txt
	$(VENV)/bin/cmake --build $(BUILD_DIR) -j $(JOBS)
	@# Expose this checkout to the venv (a .pth entry plus the console scripts), unless the
	@# venv is shared with another checkout (a git worktree pointing at someone else's venv).
	@case "$$(realpath $(VENV))/" in "$(CURDIR)"/*) \
	  echo "$(CURDIR)" > "$(SITE)/torchrec_bagpipe_dev.pth"; \
	  for s in ps:torchrec_bagpipe.ps.server launch:torchrec_bagpipe.launch; do \
	    f=$(VENV)/bin/torchrec-bagpipe-$${s%%:*}; \
	    printf '#!%s\nimport sys\nfrom %s import main\nsys.exit(main())\n' "$(abspath $(PY))" "$${s#*:}" > $$f; \
	    chmod +x $$f; done;; esac

# Every native wait has its own timeout; `timeout` is the backstop that turns a hang into a
# failure (the last [ ok ] line names the test before the one that hung).
NATIVE_TEST_TIMEOUT ?= 900

native-test: build
	timeout $(NATIVE_TEST_TIMEOUT) $(BUILD_DIR)/bagpipe_native_tests

$(ASAN_DIR)/CMakeCache.txt: | $(VENV)/.deps-stamp
	$(VENV)/bin/cmake -S . -B $(ASAN_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DBAGPIPE_BUILD_PYTHON=OFF -DBAGPIPE_SANITIZE=ON \
	  -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV)/bin/ninja) $(CMAKE_LAUNCHER)

asan-test: setup $(ASAN_DIR)/CMakeCache.txt
	$(VENV)/bin/cmake --build $(ASAN_DIR) -j $(JOBS) --target bagpipe_native_tests
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  timeout $(NATIVE_TEST_TIMEOUT) $(ASAN_DIR)/bagpipe_native_tests

lint: setup
	$(VENV)/bin/ruff check $(wildcard torchrec_bagpipe tests benchmarks examples)

# ---- the two README commands -------------------------------------------------------------
test: build
	$(MAKE) --no-print-directory native-test
	$(MAKE) --no-print-directory asan-test
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest $(PYTEST_ARGS)

# Everything except the multi-process suites (inner development loop).
test-fast: build
	$(PY) -m pytest -m "not slow" -x -q $(PYTEST_ARGS)

# DLRM on 2 ranks with the BagPipe PS for a short run; prints the metrics table at the end.
# (The storage-engine demo stays available as `python -m torchrec_bagpipe.demo`.)
DEMO_ARGS ?= --limit_train_batches 300 --batch_size 256 --num_embeddings 20000 \
  --embedding_dim 16 --dense_arch_layer_sizes 64,16 --over_arch_layer_sizes 64,32,1 \
  --learning_rate 1.0 --limit_val_batches 4 --limit_test_batches 4 --seed 1 \
  --read-mode bagpipe --optimization-cache-capacity 128 --lookahead 8 --placement-min-rows 0
demo: build
	PYTHONPATH=$(CURDIR) $(PY) -m torchrec_bagpipe.launch --nproc-per-node 2 \
	  examples/dlrm/dlrm_main.py $(DEMO_ARGS)

bench: build
	$(PY) benchmarks/ps_store.py --quick
	$(PY) benchmarks/ps_transport.py --quick

clean:
	rm -rf build torchrec_bagpipe/_C*.so torchrec_bagpipe/testing/_C_testing*.so
