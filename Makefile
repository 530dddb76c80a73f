# cpufuse: every target does its own set-up (venv, build, dependencies) from a fresh clone.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
PIN     ?= taskset -c 0
# Old-OpenBLAS tuning variables slow a current numpy's BLAS: unset them for benchmarks only.
BENCHENV := env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE

.PHONY: all venv build test test-fast bench bench-quick bench-scaling bench-peers info neon-test clean

all: test

$(VENV)/.ok: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q setuptools wheel "cffi>=1.15" numpy numba pytest pytest-benchmark gguf tokenizers jinja2
	touch $@

venv: $(VENV)/.ok

# Build and install the package (editable) into the venv; the native ISAs are compiled here.
build: venv
	$(VPY) -m pip install -q --no-build-isolation -e .

test: build
	$(VPY) -m pytest -q tests

test-fast: build
	$(VPY) -m pytest -q -m "not slow" tests

info: build
	$(VPY) -m cpufuse info

# The main job: the benchmark table, written to bench/results/latest.{json,md}. The harness pins its
# own 1-thread columns to one core and runs the all-core columns unpinned (--threads both).
bench: build
	$(BENCHENV) $(VPY) -m bench.run --threads both --json bench/results/latest.json --md bench/results/latest.md

bench-quick: build
	$(BENCHENV) $(VPY) -m bench.run --quick --threads both

# Thread scaling (1, 2, 4, 8, 16 threads, up to the cores available): make bench-scaling TAG=name
bench-scaling: build
	$(BENCHENV) $(VPY) -m bench.scaling $(if $(TAG),--tag $(TAG))

# Peers in the same table: PyTorch (CPU build), onnxruntime and ggml are optional extras.
bench-peers: build
	$(VPY) -m pip install -q onnx onnxruntime || echo "bench-peers: onnxruntime unavailable"
	$(VPY) -m pip install -q torch==2.13.0 || echo "bench-peers: torch unavailable"
	$(VPY) -m bench.peers_setup || echo "bench-peers: ggml unavailable"
	$(BENCHENV) $(VPY) -m bench.run --peers --threads both --json bench/results/peers.json --md bench/results/peers.md

# The NEON kernels, cross-compiled for aarch64 and run under qemu-user.
neon-test:
	bash native/tests/run_neon_qemu.sh

clean:
	rm -rf build *.egg-info cpufuse/_native*.so cpufuse/_native.c .pytest_cache
