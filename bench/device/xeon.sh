#!/usr/bin/env bash
# The real-shape benchmark (bench/e2e/big.py) on the lent 16-core Xeon (no network, no cffi /
# pycparser / gguf), one device call per phase, each well inside the 10-minute limit. First, HERE:
# `bash bench/device/prepare.sh` (.whl/ and .dev/), then, carrying both folders, in this order:
#   run(command="bash bench/device/xeon.sh PHASE", carry=[".whl", ".dev"], timeout_s=600)
# Phases (each stops its benchmark at PHASE_LIMIT s, default 560; e2e.big rewrites its results after
# every thread count, so a phase cut short still returns what it measured; a phase on a fresh
# machine redoes setup first, ~3 min):
#   setup    wheels into /tmp/site; cpufuse's extension and llama-bench (bench/llama_bench_build.sh
#            --src-tar .dev/...) built side by side; the five 1B files; cpufuse info, lscpu.  ~3-4 min
#   1b       1B Q4_0 at 1 / 4 / 16 threads, 2 rounds, llama.cpp = llama-bench.              ~4-5 min
#   1b-more  1B Q4_K, the Q4_K_M-like mix, Q8_0 and Q6_K at 1 / 16 threads, 1 round.        ~7-8 min
#   8b       8B Q4_0 and the mix written (9.1 GiB), at 16 threads, 2 rounds.                ~6-7 min
#   t16      1B Q4_0, Q8_0, the mix and 8B Q4_0 at 16 threads, 2 rounds, after sync.        ~6 min
#   scale    1B Q4_0 at 2 and 8 threads, 2 rounds.                                          ~3 min
#   profile  bench/e2e/profile.py on 1B Q4_0 at 16 and 1 thread.                             ~1-2 min
#   throttle bench.throttle (E1 throttled read probe, E4 page size, E8 clock), 1 thread.   ~1 min
#   With .dev/ik_llama.cpp-pruned.tar.gz carried, setup also builds ik_llama.cpp's llama-bench, and
#   these phases add its column (-rtr 1 -fmoe 1; pp128 and pp512):
#   ik16     1B Q8_0, the mix and Q4_K at 16 threads, 2 rounds.                             ~6 min
#   ik8b     8B Q4_0 written, at 16 threads, 2 rounds.                                      ~5 min
#   ik1      1B Q8_0, the mix and Q4_K at 1 thread, 1 round, flash attention on for ik.     ~7 min
#   ik8b1    8B Q4_0 written, at 1 thread, 2 rounds, pp128, flash attention on for both peers. ~8-9 min
#   q8t16    bench/e2e/profile.py on 1B Q8_0 at 16 threads, then 1B Q8_0 at 16 threads, ROUNDS (3)
#            rounds, PP (128,512).                                                           ~5 min
#   moe      MoE shapes (MOE_MODELS: granite-1b-a400m:q8_0 olmoe-1b-7b:q4_k) at MOE_THREADS (16), with
#            ik_llama.cpp where .dev has its source; setup without the 1B files on a fresh machine;
#            MOE_ARGS adds bench.e2e.big options (e.g. --pp 64 --tg 128 for a decode-only run).  ~5-9 min
#   moeprof  bench/e2e/moeprof.py (the routed matmul's phases, a 16-worker schedule of its tasks) on
#            granite-1b-a400m Q8_0 at MOEPROF_THREADS (16,1), pp64 and pp512 and 16 decode steps, 3 rounds
#            (the file written on first use, ~1 min; no peers; builds only cpufuse).         ~3-4 min
#            MOEPROF_MODEL=gpt-oss-20b:mxfp4 (or gpt-oss-20b-4l:mxfp4) profiles that file instead.
#   depth    1B Q4_0 at DEPTH_THREADS (16) at DEPTHS (0,4096,16384) of cache, K/V types DEPTH_CTK (f16 q8_0),
#            against llama-bench -fa 1 -d with the same types; DEPTH_PURE=1: the one-type file
#            (Q4_0 head too; written when missing); DEPTH_MODEL (1b; 8b, qwen2.5-coder-1.5b) and DEPTH_TYPE
#            (q4_0) pick another shape; DEPTH_ARGS adds bench.e2e.big options (e.g. --pp 128 --tg 32). ~4-8 min
#   ab       A/B of the trees AB_TREES (".dev/ab/base .": a base tree the caller put in .dev/ab/base,
#            e.g. `git archive HEAD`, and this one; setup builds every .dev/ab/*/ tree too): builds
#            the trees and the 1B AB_TYPES files when missing (no peers; ~2 min on a fresh machine),
#            then bench/e2e/profile.py (plus AB_ARGS) at AB_THREADS (16) threads on 1B AB_TYPES
#            ("q8_0 q4_0"), the trees alternating (even rounds in reverse order), AB_ROUNDS (3) rounds;
#            AB_SHAPE: another bigmodels shape
#            (e.g. granite-1b-a400m with AB_TYPES=q8_0, gpt-oss-20b-4l with mxfp4); AB_PURE=1: the
#            one-type (--pure) files; AB_BENCH=here: every tree runs this tree's bench/e2e/profile.py
#            (copied over the others' first: the same measurement for each tree); AB_ENVS: settings each tree
#            also runs under, one process each (e.g. "CPUFUSE_MOE_GROUP=1 CPUFUSE_MOE_GROUP=4"; A=1,B=2 sets
#            both in one process); AB_GUARD_US: stop once a process's token takes longer (session 23 met hosts
#            where a 16-thread token took 20-40x its quiet time, which no ratio survives); AB_VARIANTS
#            ("pf:FA_PF_DIST=32,FA_PF_HINT=2 ..."): more trees, each a copy of this one built with
#            CPUFUSE_DEFINES (native/ffibuild.py) in /tmp/ab-variants/NAME, tagged NAME. ~1-2 min
#   spec     issue 43: bench.e2e.spec --replay of the VM's speculative traces (SPEC_TRACE) on a random-weight
#            file of Qwen2.5-Coder-1.5B's shapes (written first, ~1 GB; the real one is not on the device), at
#            SPEC_THREADS (1,16); needs only .whl.                                             ~4-6 min
#   contended  issue 42 item 5: decode (tg CONT_TG, 64) of the one-type 1B Q4_0 file (written when missing)
#            at each engine's default thread count, quiet and beside NCPU/2 busy-loop processes,
#            alternating, CONT_ROUNDS (4) rounds, the competitors running CONT_SETTLE (20) s before
#            each contended phase (cpufuse's default reads the 1-minute load average); cpufuse against
#            llama-bench (no -t); each engine's contended/quiet ratio (bench.e2e --contended). ~3-4 min
#   replicas issue 44: throughput of 1 plain `cpufuse serve` of 16 threads against 2 of 8 threads each
#            (pinned to separate cores, round-robin clients; bench.e2e.replicas --plain) on 1B Q4_0,
#            REP_ALTERNATE (2) runs of each, alternating; needs .whl/serve (prepare.sh).       ~4-6 min
#   thp      issue 42: the repacked panels on 4 KiB pages (CPUFUSE_HUGEPAGES=0) against 2 MiB (=1), in one
#            process per thread count (bench.e2e.thp: AnonHugePages after each load, decode rounds alternating,
#            the read probe over the same panels), at THP_THREADS (1,16; 1 pinned to core 0), ROUNDS (6), on
#            the one-type (--pure) 1B THP_TYPES (q4_0 q8_0) files, written on first use; then llama-bench
#            at 1 thread (core 0) on the same files; THP settings, numpy's madvise: thp-machine.txt.  ~4 min
#            THP_8B=1 adds the one-type 8B Q4_0 at 16 threads (written on first use).       +3-4 min
#   pending  the A/B knobs a session added and no Xeon has measured yet (today: session 25's CPUFUSE_MOE_TAIL=2,
#            beside CPUFUSE_MOE_GROUP=2) on granite Q8_0 and OLMoE-1B-7B Q4_K, one-type files written first, at
#            200 cells, PENDING_ROUNDS (4) rounds; needs only .whl.                            ~4-5 min
#   attnpf   one layer's decode attention (bench.attndec, cold, wall) at ATTN_THREADS (16) threads, this tree as it is
#            and under each side of ATTN_ENVS (default: the cells tasks at 16 threads), alternating processes,
#            ATTN_ROUNDS (3); ATTN_ARGS (default: Llama-3.1-8B's heads, f16 and q8_0 at 4096 and 16384 cells);
#            builds only cpufuse. At 16 threads the call's own cost is most of what it times (session 23):
#            the model at depth (profile.py --depth, the ab phase's AB_ARGS) is the better measure.  ~2-4 min
# Results: $OUT/ (e2e-big-<phase>.md/.json/.png and logs; more than PACK_OVER (12) files: all in results-PHASE.tgz).
set -uo pipefail
PHASE="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/device-out}" T0=$SECONDS LIMIT="${PHASE_LIMIT:-560}" PY="${PY:-python3}" NCPU="$(nproc)"
mkdir -p "$OUT"
export CPUFUSE_BENCH_MODELS="${CPUFUSE_BENCH_MODELS:-$HOME/.cache/cpufuse-bench}"
LB="$CPUFUSE_BENCH_MODELS/llama-bench/build/bin/llama-bench"
IKSRC="$CPUFUSE_BENCH_MODELS/ik-src" IKTAR=.dev/ik_llama.cpp-pruned.tar.gz
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "[xeon.sh $PHASE $((SECONDS - T0))s] $*"; }
# The device brings back only so many files (session 25 got 8 of 48): where a phase leaves more than PACK_OVER (12)
# in $OUT, the outermost xeon.sh packs them all into $OUT/results-PHASE.tgz as it exits (the phases that run
# xeon.sh again for a part share $OUT and leave the packing to it)
pack() {
  local n; n=$(find "$OUT" -maxdepth 1 -type f ! -name 'results-*.tgz' | wc -l)
  [ "$n" -gt "${PACK_OVER:-12}" ] || return 0
  ( cd "$OUT" && find . -maxdepth 1 -type f ! -name 'results-*.tgz' -printf '%P\n' | tar -czf "results-$PHASE.tgz" -T - &&
    find . -maxdepth 1 -type f ! -name 'results-*.tgz' -delete ) && echo "[xeon.sh] $n result files packed into $OUT/results-$PHASE.tgz"
}
if [ -z "${XEON_SH_OUTER:-}" ]; then
  export XEON_SH_OUTER=$$
  trap pack EXIT
fi
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
  if [ -f "$IKTAR" ] && [ ! -x "$CPUFUSE_BENCH_MODELS/ik-llama-bench/bin/llama-bench" ]; then
    say "building ik_llama.cpp's llama-bench"
    ( mkdir -p "$IKSRC" && tar -xzf "$IKTAR" -C "$IKSRC" --strip-components=1 &&
      "$PY" -c "import sys; from bench.e2e.big import build_ik; e, why = build_ik('$IKSRC', None); print(e or why)"
    ) > "$OUT/build-ik.log" 2>&1 &
    pids+=($!)
  fi
  for tree in .dev/ab/*/; do
    [ -f "$tree/setup.py" ] && [ ! -f "$tree/.built" ] || continue
    say "building the A/B tree $tree"
    ( cd "$tree" && "$PY" setup.py -q build_ext --inplace > "$OUT/build-$(basename "$tree").log" 2>&1 && touch .built ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  have_cpufuse || { say "cpufuse did not build:"; tail -30 "$OUT/build-cpufuse.log"; return 1; }
  [ -x "$LB" ] || { say "llama-bench did not build:"; tail -30 "$OUT/build-llama-bench.log"; return 1; }
  say "builds ready"
  [ "${SETUP_1B:-1}" = 0 ] && return 0
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
  have_cpufuse && [ -x "$LB" ] && "$PY" -c "import os, sys; from bench.e2e import bigmodels as b
sys.exit(not all(b.is_valid(os.path.join(b.models_dir(), b.file_name('1b', t)), '1b', t) for t in b.TYPES))" \
    2>/dev/null && return 0
  say "setup's results are missing (a fresh machine?): running setup first"
  setup
}

big() {  # written only when missing: the given bench.e2e.bigmodels arguments
  "$PY" -m bench.e2e.bigmodels "$@" > "$OUT/bigmodels-more.log" 2>&1 || { tail -20 "$OUT/bigmodels-more.log"; exit 1; }
}

IK=(--ik-llama-src "$IKSRC" --pp 128,512)
case "$PHASE" in
  ab|pending) wheels || exit 1 ;;
  attnpf) wheels || exit 1
    have_cpufuse || "$PY" setup.py -q build_ext --inplace > "$OUT/build-cpufuse.log" 2>&1 ||
      { tail -30 "$OUT/build-cpufuse.log"; exit 1; } ;;
  moeprof) wheels || exit 1
    have_cpufuse || "$PY" setup.py -q build_ext --inplace > "$OUT/build-cpufuse.log" 2>&1 ||
      { tail -30 "$OUT/build-cpufuse.log"; exit 1; } ;;
  replicas)
    [ -d .whl/serve ] || { say "no .whl/serve: run bench/device/prepare.sh here"; exit 1; }
    "$PY" -c "import starlette, uvicorn, pydantic, httpx" 2>/dev/null ||
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-serve .whl/serve/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site-serve"
    have_cpufuse && [ -x "$LB" ] || SETUP_1B=0 setup || exit 1 ;;
  moe|depth|contended|thp) have_cpufuse && [ -x "$LB" ] || SETUP_1B=0 setup || exit 1 ;;
  throttle) "$PY" -m bench.throttle --md "$OUT/throttle.md" --json "$OUT/throttle.json"; exit ;;
  spec)
    wheels || exit 1
    have_cpufuse || "$PY" setup.py -q build_ext --inplace > "$OUT/build-cpufuse.log" 2>&1
    have_cpufuse || { say "cpufuse did not build:"; tail -30 "$OUT/build-cpufuse.log"; exit 1; } ;;
  setup|1b|1b-more|8b|t16|scale|profile|ik16|ik8b|ik1|ik8b1|q8t16) [ "$PHASE" = setup ] || ready || exit 1 ;;
  *) sed -n '2,/^# Results/p' "$0"; exit 2 ;;
esac
case "$PHASE" in
  setup)
    setup || exit 1
    "$PY" -m cpufuse info > "$OUT/cpufuse-info.txt" 2>&1
    { lscpu; echo; grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u; free -g; df -h "$CPUFUSE_BENCH_MODELS"
      echo "cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"; uptime; } \
      > "$OUT/machine.txt" 2>&1
    "$PY" -m pytest -q -p no:cacheprovider tests/test_probe.py > "$OUT/test-probe.log" 2>&1; tail -1 "$OUT/test-probe.log"
    "$PY" -m bench.e2e.bigmodels --models 1b --types q4_0 --check 2>&1 | tail -1
    "$PY" -m bench.throttle --md "$OUT/throttle.md" --json "$OUT/throttle.json" > /dev/null ;;
  1b) e2e 1b --models 1b --types q4_0 --threads 1,4,16 --rounds "${ROUNDS:-2}" ;;
  1b-more) e2e 1b-more --models 1b --types q4_k,q4_k_m,q8_0,q6_k --threads 1,16 --rounds 1 ;;
  8b)
    big --models 8b --types q4_0,q4_k_m
    e2e 8b --models 8b --types q4_0,q4_k_m --threads 16 --rounds 2 ;;
  t16)  # all cores again, after the files are flushed to disk and the machine is idle
    big --models 8b --types q4_0
    sync; grep -E '^(Dirty|Writeback):' /proc/meminfo; uptime
    e2e t16-1b --models 1b --types q4_0,q8_0,q4_k_m --threads 16 --rounds 2
    e2e t16-8b --models 8b --types q4_0 --threads 16 --rounds 2 ;;
  ik16) e2e ik16 --models 1b --types q8_0,q4_k_m,q4_k --threads 16 --rounds 2 "${IK[@]}" ;;
  ik8b)
    big --models 8b --types q4_0
    e2e ik8b --models 8b --types q4_0 --threads 16 --rounds 2 "${IK[@]}" ;;
  ik1) e2e ik1 --models 1b --types q8_0,q4_k_m,q4_k --threads 1 --rounds 1 "${IK[@]}" \
         --engines cpufuse,llamacpp-fa-off,llamacpp-fa-on,ik-fa-on ;;
  ik8b1)
    big --models 8b --types q4_0
    e2e ik8b1 --models 8b --types q4_0 --threads 1 --rounds 2 --ik-llama-src "$IKSRC" --pp 128 \
      --engines cpufuse,llamacpp-fa-on,ik-fa-on ;;
  q8t16)
    timeout "$(left)" "$PY" -m bench.e2e.profile --shape 1b --type q8_0 --threads 16 --md "$OUT/profile-1b-q8_0-t16.md"
    e2e q8t16 --models 1b --types q8_0 --threads 16 --rounds "${ROUNDS:-3}" --pp "${PP:-128,512}" \
      --engines cpufuse,llamacpp-fa-off,llamacpp-fa-on ;;
  ab)
    TREES=(${AB_TREES:-.dev/ab/base .})
    declare -A VDEF=()
    for var in ${AB_VARIANTS:-}; do  # NAME:DEFINES, a copy of this tree built with CPUFUSE_DEFINES=DEFINES
      vdir="/tmp/ab-variants/${var%%:*}"
      if [ ! -f "$vdir/.built" ]; then
        rm -rf "$vdir" && mkdir -p "$vdir"
        tar -cf - --exclude=./.dev --exclude=./.whl --exclude=./build --exclude=./.git --exclude='*.so' . | tar -xf - -C "$vdir"
      fi
      VDEF[$vdir]="${var#*:}"
      TREES+=("$vdir")
    done
    have_cpufuse || "$PY" setup.py -q build_ext --inplace > "$OUT/build-cpufuse.log" 2>&1 &
    for tree in "${TREES[@]}"; do
      [ "$tree" = . ] && continue
      [ -f "$tree/setup.py" ] || { say "no tree in $tree"; exit 1; }
      [ -f "$tree/.built" ] || ( cd "$tree" && CPUFUSE_DEFINES="${VDEF[$tree]:-}" "$PY" setup.py -q build_ext --inplace \
                                   > "$OUT/build-$(basename "$tree").log" 2>&1 && touch .built ) &
    done
    wait
    have_cpufuse || { say "this tree did not build"; tail -5 "$OUT/build-cpufuse.log"; exit 1; }
    for tree in "${TREES[@]}"; do
      [ "$tree" = . ] || [ -f "$tree/.built" ] || { say "$tree did not build"; tail -5 "$OUT/build-$(basename "$tree").log"; exit 1; }
    done
    ABP= ABPURE=() ABPY=False
    [ "${AB_PURE:-0}" = 1 ] && ABP=-pure ABPURE=(--pure) ABPY=True
    ABN=${AB_NAME:+-$AB_NAME}  # in the result names: runs of one phase at other AB_ARGS
    big --models "${AB_SHAPE:-1b}" --types "$(echo ${AB_TYPES:-q8_0 q4_0} | tr ' ' ,)" "${ABPURE[@]}"
    if [ "${AB_BENCH:-}" = here ]; then
      for tree in "${TREES[@]}"; do [ "$tree" = . ] || cp bench/e2e/profile.py "$tree/bench/e2e/profile.py"; done
    fi
    say "builds and files ready"
    # (tree, setting) in round 1's order; the even rounds run them backwards: on the lent Xeon the first
    # process of a round ran slower, whatever it ran (bench/results/xeon16-s19/README.md)
    PAIRS=()
    for tree in "${TREES[@]}"; do for ev in ${AB_ENVS:-_}; do PAIRS+=("$tree|$ev"); done; done
    for r in $(seq "${AB_ROUNDS:-3}"); do
      for ty in ${AB_TYPES:-q8_0 q4_0}; do
        f=$("$PY" -c "from bench.e2e.bigmodels import file_name; print(file_name('${AB_SHAPE:-1b}', '$ty', $ABPY))")
        ORDER=("${PAIRS[@]}")
        [ $((r % 2)) = 0 ] && ORDER=($(printf '%s\n' "${PAIRS[@]}" | tac))
        for pair in "${ORDER[@]}"; do
          tree=${pair%%|*} ev=${pair#*|}
          [ "$(left)" -gt 40 ] || break 3
          tag=$([ "$tree" = . ] && echo new || basename "$tree")
          [ "$ev" = _ ] || tag="$tag-$(echo "$ev" | sed 's/CPUFUSE_//g' | tr 'A-Z=,' 'a-z-+')"
          ( cd "$tree" && [ "$ev" = _ ] || for e in ${ev//,/ }; do export "$e"; done
            PYTHONPATH="/tmp/site:$PWD" timeout "$(left)" "$PY" -m bench.e2e.profile "$CPUFUSE_BENCH_MODELS/$f" \
              --threads "${AB_THREADS:-16}" --read-mib 0 ${AB_ARGS:-} --md "$OUT/ab-$ty$ABP$ABN-$tag-r$r.md" > "$OUT/ab-$ty$ABP$ABN-$tag-r$r.log" 2>&1 )
          say "round $r $ty$ABP$ABN $tag: $(grep -E '^\| [0-9]+ \|' "$OUT/ab-$ty$ABP$ABN-$tag-r$r.md" | head -1)"
          tok=$(grep -E '^\| [0-9]+ \|' "$OUT/ab-$ty$ABP$ABN-$tag-r$r.md" | head -1 | cut -d'|' -f3 | tr -d ' ')
          if [ -n "${AB_GUARD_US:-}" ] && [[ "$tok" =~ ^[0-9]+$ ]] && [ "$tok" -gt "$AB_GUARD_US" ]; then
            say "a token took ${tok:-?} µs, past AB_GUARD_US=$AB_GUARD_US: a busy host, the phase stops"; uptime; break 3
          fi
        done
      done
    done ;;
  pending)  # the knobs no Xeon has measured yet (session 25's), each file an ab phase of its own share of the time
    export AB_PURE=1 AB_TREES=. AB_ENVS="_ CPUFUSE_MOE_TAIL=2 CPUFUSE_MOE_GROUP=2" AB_GUARD_US=20000
    export AB_ARGS="--prompt 200 --steps 64 --fused-only --read-mib 1024"
    # the builds while the files are written; then sync, so no writeback runs in the rounds
    for mt in granite-1b-a400m:q8_0 olmoe-1b-7b:q4_k; do
      AB_SHAPE="${mt%%:*}" AB_TYPES="${mt##*:}" AB_ROUNDS=0 PHASE_LIMIT=$(left) bash "$0" ab
    done
    sync; grep -E '^(Dirty|Writeback):' /proc/meminfo; uptime
    i=2  # runs left, each given its share of the time left
    for mt in granite-1b-a400m:q8_0 olmoe-1b-7b:q4_k; do
      AB_SHAPE="${mt%%:*}" AB_TYPES="${mt##*:}" AB_ROUNDS=${PENDING_ROUNDS:-4} PHASE_LIMIT=$(( $(left) / i-- )) bash "$0" ab
    done
    uptime ;;
  attnpf)  # issue 42: decode attention's prefetch at 16 threads
    timeout "$(left)" "$PY" -m bench.attndec --rounds "${ATTN_ROUNDS:-3}" --core "0-$((NCPU - 1))" \
      --envs "${ATTN_ENVS:-CPUFUSE_FA_CELLS_NTH=64}" \
      -- --threads "${ATTN_THREADS:-16}" --cold ${ATTN_ARGS:---heads 32,8,128 --depths 4096,16384 --types f16,q8_0 --reps 20} \
      > "$OUT/attnpf.md" 2> "$OUT/attnpf.log"
    cat "$OUT/attnpf.md" ;;
  moe)  # issue 41: the MoE shapes at MOE_THREADS (16), each file written on first use
    for mt in ${MOE_MODELS:-granite-1b-a400m:q8_0 olmoe-1b-7b:q4_k}; do
      e2e "moe-${mt%%:*}-t${MOE_THREADS:-16}" --models "${mt%%:*}" --types "${mt##*:}" --threads "${MOE_THREADS:-16}" \
        --rounds "${ROUNDS:-1}" --ik-llama-src "$IKSRC" --engines "${MOE_ENGINES:-cpufuse,llamacpp-fa-off,llamacpp-fa-on,ik-fa-on}" \
        ${MOE_ARGS:-}
    done ;;
  moeprof)  # issue 41: where the routed matmul's time goes at 16 threads; MOEPROF_MODEL shape:type (granite-1b-a400m:q8_0)
    mp=${MOEPROF_MODEL:-granite-1b-a400m:q8_0}
    big --models "${mp%%:*}" --types "${mp##*:}"
    mf=$("$PY" -c "import os, sys; from bench.e2e import bigmodels as b; print(os.path.join(b.models_dir(), b.file_name(*sys.argv[1:])))" \
      "${mp%%:*}" "${mp##*:}")
    timeout "$(left)" "$PY" -m bench.e2e.moeprof "$mf" --prompt 64,512 --decode 16 --threads "${MOEPROF_THREADS:-16,1}" \
      --rounds 3 > "$OUT/moeprof-${mp%%:*}-${mp##*:}.md" 2>&1
    tail -25 "$OUT/moeprof-${mp%%:*}-${mp##*:}.md" ;;
  depth)  # issue 42: 1B Q4_0 at DEPTH_THREADS (16) after DEPTHS tokens of cache, for each K/V type of DEPTH_CTK
    PURE=()
    DM=${DEPTH_MODEL:-1b} DT=${DEPTH_TYPE:-q4_0}
    [ "${DEPTH_PURE:-0}" = 1 ] && PURE=(--pure) && big --models "$DM" --types "$DT" --pure
    for ct in ${DEPTH_CTK:-f16 q8_0}; do
      e2e "depth-$DM-$DT-$ct-t${DEPTH_THREADS:-16}${PURE:+-pure}" --models "$DM" --types "$DT" --threads "${DEPTH_THREADS:-16}" \
        --rounds 1 --depth "${DEPTHS:-0,4096,16384}" --ctk "$ct" --engines "${DEPTH_ENGINES:-cpufuse,llamacpp-fa-on}" \
        "${PURE[@]}" ${DEPTH_ARGS:-}
    done ;;
  contended)  # issue 42 item 5: default thread counts, quiet against NCPU/2 competitors
    big --models 1b --types q4_0 --pure
    uptime
    timeout "$(left)" "$PY" -m bench.e2e --contended --model "$CPUFUSE_BENCH_MODELS/llama-1b-shapes-Q4_0-pure.gguf" \
      --tg "${CONT_TG:-64}" --rounds "${CONT_ROUNDS:-4}" --settle "${CONT_SETTLE:-20}" --llama-bench "$LB" --json "$OUT/e2e-contended.json" \
      --md "$OUT/e2e-contended.md" 2>&1 | tee "$OUT/e2e-contended.log" ;;
  replicas)
    big --models 1b --types q4_0
    f="$("$PY" -c "import os; from bench.e2e import bigmodels as b; print(os.path.join(b.models_dir(), b.file_name('1b', 'q4_0')))")"
    timeout "$(left)" "$PY" -m bench.e2e.replicas "$f" --plain --threads "${REP_THREADS:-16}" --replicas 2 --parallel 8 \
      --clients "${REP_CLIENTS:-16}" --rounds 1 --max-tokens "${REP_TOKENS:-64}" --alternate "${REP_ALTERNATE:-2}" \
      --json "$OUT/replicas.json" 2>&1 | tee "$OUT/replicas.log" ;;
  spec)  # issue 43: the decoder calls of the VM's real runs (traces), timed on the same shapes
    big --models qwen2.5-coder-1.5b --types q4_k_m
    f="$("$PY" -c "import os; from bench.e2e import bigmodels as b; print(os.path.join(b.models_dir(), b.file_name('qwen2.5-coder-1.5b', 'q4_k_m')))")"
    timeout "$(left)" "$PY" -m bench.e2e.spec --model "$f" --replay "${SPEC_TRACE:-bench/results/vm-s9/spec-qwen2.5-coder-1.5b-t1.json}" \
      --threads "${SPEC_THREADS:-1,16}" --out "$OUT/spec-replay.json" 2>&1 | tee "$OUT/spec-replay.log" ;;
  thp)  # issue 42: page size of the repacked panels, A/B in one process; llama.cpp at 1 thread beside it
    THP_TYPES="${THP_TYPES-q4_0 q8_0}"   # THP_TYPES= (empty) with THP_8B=1: the 8B file only
    [ -z "$THP_TYPES" ] || big --models 1b --types "$(echo $THP_TYPES | tr ' ' ,)" --pure
    { uname -r; for f in enabled defrag khugepaged/defrag; do echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f)"; done
      "$PY" -c "import numpy as n; c = getattr(n, '_core', None) or n.core; print('numpy', n.__version__, 'madvise_hugepage', c.multiarray._get_madvise_hugepage())"
      grep -iE 'huge|MemFree|MemAvailable' /proc/meminfo; cat /proc/buddyinfo; "$PY" -m cpufuse info | grep -i huge; } > "$OUT/thp-machine.txt" 2>&1
    cat "$OUT/thp-machine.txt"
    for ty in $THP_TYPES; do
      [ "$(left)" -gt 60 ] || break
      f="$("$PY" -c "import os; from bench.e2e import bigmodels as b; print(os.path.join(b.models_dir(), b.file_name('1b', '$ty', True)))")"
      timeout "$(left)" "$PY" -m bench.e2e.thp "$f" --threads "${THP_THREADS:-1,16}" --rounds "${ROUNDS:-6}" \
        --md "$OUT/thp-1b-$ty-pure.md" --json "$OUT/thp-1b-$ty-pure.json" 2>&1 | grep -E '^\| |^Per round|^THP'
      [ "$(left)" -gt 40 ] || break
      timeout "$(left)" taskset -c 0 "$LB" -m "$f" -t 1 -p 0 -n 32 -r 3 -o md 2>/dev/null | tee "$OUT/thp-1b-$ty-pure-llamabench-t1.md" | grep -E 'tg32'
    done
    if [ "${THP_8B:-0}" = 1 ] && [ "$(left)" -gt 150 ]; then   # 8B Q4_0 one-type at 16 threads (a 4.3 GB file)
      big --models 8b --types q4_0 --pure
      f="$("$PY" -c "import os; from bench.e2e import bigmodels as b; print(os.path.join(b.models_dir(), b.file_name('8b', 'q4_0', True)))")"
      timeout "$(left)" "$PY" -m bench.e2e.thp "$f" --threads 16 --rounds "${ROUNDS:-6}" --md "$OUT/thp-8b-q4_0-pure.md" \
        --json "$OUT/thp-8b-q4_0-pure.json" 2>&1 | grep -E '^\| |^Per round'
    fi ;;
  scale) e2e scale --models 1b --types q4_0 --threads 2,8 --rounds 2 ;;   # 1/4/16 come from 1b and t16
  profile)
    for t in 16 1; do
      [ "$(left)" -gt 90 ] || break
      timeout "$(left)" "$PY" -m bench.e2e.profile --shape 1b --type q4_0 --threads "$t" --md "$OUT/profile-1b-q4_0-t$t.md"
    done ;;
esac
