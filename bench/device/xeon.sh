#!/usr/bin/env bash
# The real-shape benchmark (bench/e2e/big.py) on the lent 16-core Xeon (AVX-512 VNNI, AMX; Python
# 3.12 with numpy, numba, tokenizers, jinja2, matplotlib; no cffi / pycparser / gguf; no network;
# root), in phases that each end well inside the device's 10-minute limit per command. First, HERE:
#   bash bench/device/prepare.sh          # .whl/ (cffi, pycparser, gguf) and .dev/ (pruned llama.cpp)
# then one device call per phase, in this order, each carrying both folders:
#   run(command="bash bench/device/xeon.sh setup", carry=[".whl", ".dev"], timeout_s=600)
#   run(command="bash bench/device/xeon.sh 1b", ...)   then 1b-more, 8b, profile (optional)
#
# Phases (time: estimated for the Xeon from runs here, on a 2-core EPYC: llama-bench from the
# pruned source 13 min on 2 cores (~2 min on 16), cpufuse's extension 2.5 min (serial per ISA,
# ~1.5 min), the five 1B files 20-30 s; per 1B file at 1 thread a cpufuse process ~25-35 s, a
# llama-bench process ~33 s (less on the Xeon, where AMX speeds its pp512 warm-up and run), the
# probes ~3 s; at 4-16 threads ~10-15 s a process. Each phase stops its benchmark at PHASE_LIMIT
# seconds, default 560, and e2e_big rewrites its results after every thread count of every round,
# so a phase cut short still returns what it measured):
#   setup    wheels into /tmp/site; cpufuse's extension (setup.py build_ext --inplace) and llama-bench
#            (bench/llama_bench_build.sh --src-tar .dev/...) built at the same time; the five 1B files
#            written (bench/e2e/bigmodels.py, 4.4 GiB); cpufuse info, lscpu, tests/test_probe.py.  ~3-4 min
#   1b       1B Q4_0 at 1 / 4 / 16 threads, 2 rounds, llama.cpp = llama-bench.               ~4-5 min
#   1b-more  1B Q4_K, the Q4_K_M-like mix, Q8_0 and Q6_K at 1 / 16 threads, 1 round.         ~7-8 min
#   8b       8B Q4_0 and the Q4_K_M-like mix written (9.1 GiB, ~30 s), run at 16 threads, 2 rounds.
#                                                                                            ~6-7 min
#   t16      1B Q4_0, Q8_0, the mix and 8B Q4_0 at 16 threads, 2 rounds, after sync.      ~6 min
#   scale    1B Q4_0 at 2 and 8 threads, 2 rounds (the rest of the scaling curve).          ~3 min
#   profile  bench/e2e/profile.py on 1B Q4_0 at 16 and at 1 thread (per-op decode and pp512).  ~1-2 min
# Total ~22-26 min of device time plus the machine's start. The machine is given back ~30 s after a
# call: issue the next phase at once. Every phase checks what the earlier ones left (the builds in
# the work tree and ~/.cache/cpufuse-bench) and redoes a missing setup first (~3 min more).
# Results: $OUT/ (e2e-big-<phase>.md/.json/.png, the logs); at most 8 files per phase.
set -uo pipefail
PHASE="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/device-out}"
mkdir -p "$OUT"
T0=$SECONDS
LIMIT="${PHASE_LIMIT:-560}"
export CPUFUSE_BENCH_MODELS="${CPUFUSE_BENCH_MODELS:-$HOME/.cache/cpufuse-bench}"
LB="$CPUFUSE_BENCH_MODELS/llama-bench/build/bin/llama-bench"
PY="${PY:-python3}"
NCPU="$(nproc)"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "[xeon.sh $PHASE $((SECONDS - T0))s] $*"; }
left() { echo $((LIMIT - (SECONDS - T0))); }

wheels() {
  "$PY" -c "import cffi, pycparser, gguf" 2>/dev/null && return 0
  ls .whl/*.whl >/dev/null 2>&1 || { say "no .whl/: run bench/device/prepare.sh here and carry .whl"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}

have_cpufuse() { "$PY" -c "import cpufuse, sys; sys.exit(0 if cpufuse.available_isas()[0] != 'numba' else 1)" 2>/dev/null; }

setup() {
  wheels || return 1
  local pids=()
  if ! have_cpufuse; then
    say "building cpufuse's extension"
    ( "$PY" setup.py -q build_ext --inplace > "$OUT/build-cpufuse.log" 2>&1; echo "exit $?" >> "$OUT/build-cpufuse.log" ) &
    pids+=($!)
  fi
  if [ ! -x "$LB" ]; then
    [ -f .dev/llama.cpp-0.3.36-pruned.tar.gz ] || { say "no .dev/: run bench/device/prepare.sh here and carry .dev"; return 1; }
    say "building llama-bench"
    ( bash bench/llama_bench_build.sh --src-tar .dev/llama.cpp-0.3.36-pruned.tar.gz -j "$NCPU" \
        > "$OUT/build-llama-bench.log" 2>&1; echo "exit $?" >> "$OUT/build-llama-bench.log" ) &
    pids+=($!)
  fi
  for p in "${pids[@]}"; do wait "$p"; done
  have_cpufuse || { say "cpufuse did not build:"; tail -30 "$OUT/build-cpufuse.log"; return 1; }
  [ -x "$LB" ] || { say "llama-bench did not build:"; tail -30 "$OUT/build-llama-bench.log"; return 1; }
  say "builds ready"
  "$PY" -m bench.e2e.bigmodels --models 1b --types all > "$OUT/bigmodels.log" 2>&1 || { tail -20 "$OUT/bigmodels.log"; return 1; }
  say "1B files ready"
}

e2e() {  # tag, then bench.e2e.big arguments
  local tag="$1"; shift
  local t; t="$(left)"
  [ "$t" -gt 60 ] || { say "no time left for $tag"; return 1; }
  say "bench.e2e.big $* (stops after ${t}s)"
  timeout "$t" "$PY" -m bench.e2e.big --llama-bench "$LB" --md "$OUT/e2e-big-$tag.md" \
    --json "$OUT/e2e-big-$tag.json" --png "$OUT/e2e-big-$tag.png" "$@" 2>&1 | tee "$OUT/e2e-big-$tag.log"
  say "done (exit ${PIPESTATUS[0]})"
}

ready() {  # the builds and the 1B files of `setup`, redone if the machine is a fresh one
  if have_cpufuse && [ -x "$LB" ] && "$PY" -c "
import os, sys
from bench import bigmodels as b
sys.exit(0 if all(b.is_valid(os.path.join(b.models_dir(), b.file_name('1b', t)), '1b', t) for t in b.TYPES) else 1)" 2>/dev/null; then
    return 0
  fi
  say "setup's results are missing (a fresh machine?): running setup first"
  setup
}

case "$PHASE" in
  setup)
    setup || exit 1
    "$PY" -m cpufuse info > "$OUT/cpufuse-info.txt" 2>&1
    { lscpu; echo; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u; free -g; df -h "$CPUFUSE_BENCH_MODELS"; } > "$OUT/machine.txt" 2>&1
    "$PY" -m pytest -q -p no:cacheprovider tests/test_probe.py > "$OUT/test-probe.log" 2>&1; tail -1 "$OUT/test-probe.log"
    "$PY" -m bench.e2e.bigmodels --models 1b --types q4_0 --check 2>&1 | tail -1
    ;;
  1b)
    ready || exit 1
    e2e 1b --models 1b --types q4_0 --threads 1,4,16 --rounds 2
    ;;
  1b-more)
    ready || exit 1
    e2e 1b-more --models 1b --types q4_k,q4_k_m,q8_0,q6_k --threads 1,16 --rounds 1
    ;;
  8b)
    ready || exit 1
    "$PY" -m bench.e2e.bigmodels --models 8b --types q4_0,q4_k_m > "$OUT/bigmodels-8b.log" 2>&1 || { tail -20 "$OUT/bigmodels-8b.log"; exit 1; }
    say "8B files ready"
    e2e 8b --models 8b --types q4_0,q4_k_m --threads 16 --rounds 2
    ;;
  t16)  # all cores again, after the files are flushed to disk (os.sync) and the machine is idle
    ready || exit 1
    "$PY" -m bench.e2e.bigmodels --models 8b --types q4_0 > "$OUT/bigmodels-8b.log" 2>&1 || { tail -20 "$OUT/bigmodels-8b.log"; exit 1; }
    sync; grep -E '^(Dirty|Writeback):' /proc/meminfo; uptime
    e2e t16-1b --models 1b --types q4_0,q8_0,q4_k_m --threads 16 --rounds 2
    e2e t16-8b --models 8b --types q4_0 --threads 16 --rounds 2
    ;;
  scale)  # the rest of the scaling curve of 1B Q4_0 (1/4/16 come from `1b` and `t16`)
    ready || exit 1
    e2e scale --models 1b --types q4_0 --threads 2,8 --rounds 2
    ;;
  profile)
    ready || exit 1
    for t in 16 1; do
      [ "$(left)" -gt 90 ] || break
      timeout "$(left)" "$PY" -m bench.e2e.profile --shape 1b --type q4_0 --threads "$t" --md "$OUT/profile-1b-q4_0-t$t.md"
    done
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | grep '^#'
    exit 2
    ;;
esac
