#!/usr/bin/env bash
# Issue 27 on the lent Xeon, after bench/device/xeon.sh's setup (redone on a fresh machine):
#   run(command="bash bench/device/peers.sh PHASE", carry=[".whl", ".dev"])
# .dev holds llama.cpp's pruned source (prepare.sh), ik_llama.cpp's pruned source
# (.dev/ik_llama.cpp-pruned.tar.gz) and the base tree of an A/B (.dev/ab/base).
#   q4k  the quantized-matmul tests on avx512/amx; the prompt-shaped matmul (bench/device/mm_ab.py),
#        base tree against this one, alternating, 1 and 16 threads; 1B Q4_K at 1 and 16 threads
#        against llama-bench.
#   ik   llama.cpp's and ik_llama.cpp's llama-bench (-rtr 1) on the 1B files at 1, 2, 4, 8, 16 threads,
#        pp128, pp512 and tg128 (flash attention on; one run after llama-bench's warm-up), into
#        peers-<threads>.json, and cpufuse (bench.e2e.big --engines cpufuse) at the same thread counts.
set -uo pipefail
PHASE="${1:-q4k}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && ROOT="$PWD"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT"
R="${OUT:-$ROOT/build/device-out}"; mkdir -p "$R"
M="$HOME/.cache/cpufuse-bench"
LB="$M/llama-bench/build/bin/llama-bench"
IK="$M/ik/build/bin/llama-bench"
build_ik() {
  [ -x "$IK" ] && return 0
  mkdir -p "$M/ik" && tar -xzf .dev/ik_llama.cpp-pruned.tar.gz -C "$M/ik" --strip-components=1 &&
  cmake -S "$M/ik" -B "$M/ik/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF > /tmp/ik-cfg.log 2>&1 &&
  cmake --build "$M/ik/build" --target llama-bench -j "$(nproc)" > /tmp/ik-build.log 2>&1
  echo "ik build exit $? ($(ls "$IK" 2>/dev/null))"
}
build_base() {
  [ -f .dev/ab/base/cpufuse/_native.abi3.so ] && return 0
  ( cd .dev/ab/base && CPUFUSE_BUILD_ISAS="avx512 amx" python3 setup.py -q build_ext --inplace > /tmp/base-build.log 2>&1 )
  echo "base build exit $?"
}
build_ik > /tmp/ik.log 2>&1 &
[ "$PHASE" = q4k ] && { build_base > /tmp/base.log 2>&1 & }
OUT=/tmp/xs bash bench/device/xeon.sh setup > /tmp/xs.log 2>&1 || { tail -20 /tmp/xs.log; exit 1; }
wait; cat /tmp/ik.log /tmp/base.log 2>/dev/null; tail -3 /tmp/ik-build.log
python3 -m bench.e2e.bigmodels --models 1b --types q4_k > /dev/null 2>&1
case "$PHASE" in
  q4k)
    python3 -m pytest -q -x -p no:cacheprovider tests/test_qmatmul.py tests/test_qmatmul_residual.py tests/test_repack.py \
      tests/test_quant_types.py -k "avx512 or amx" 2>&1 | tail -1 | tee "$R/tests-avx512-amx.txt"
    for nth in 1 16; do
      for r in 1 2 3; do
        for v in base head; do
          d="$ROOT"; [ $v = base ] && d="$ROOT/.dev/ab/base"
          pin=""; [ $nth = 1 ] && pin="taskset -c 2"
          echo "{\"tree\": \"$v\", \"threads\": $nth, \"round\": $r, \"t\": $(cd "$d" && PYTHONPATH="/tmp/site:$d" $pin python3 "$ROOT/bench/device/mm_ab.py" amx $nth q4_k,q6_k,q4_0 128,512)}"
        done
      done
    done | tee "$R/mm-ab.jsonl"
    timeout 300 python3 -m bench.e2e.big --llama-bench "$LB" --models 1b --types q4_k --threads 1,16 --rounds 1 \
      --md "$R/e2e-big-1b-q4k.md" --json /tmp/e.json --png /tmp/e.png 2>&1 | grep -E "cpufuse|llama.cpp" | tail -8
    ;;
  ik)
    for t in ${IK_THREADS:-1 2 4 8 16}; do
      for f in ${IK_MODELS:-q4_0 q4_k}; do
        g="$M/llama-1b-shapes-${f^^}.gguf"; pin=""; [ $t = 1 ] && pin="taskset -c 0"
        for e in llama ik; do
          exe=$LB; extra=""; [ $e = ik ] && { exe=$IK; extra="-rtr 1"; }
          echo "== $e $f t=$t"
          mkdir -p /tmp/pe; timeout 200 $pin "$exe" -m "$g" -p 128,512 -n 128 -t $t -fa 1 -r ${IK_REPS:-1} $extra -o json \
            > "/tmp/pe/$e-$f-$t.json" 2> "/tmp/pe/$e-$f-$t.err" || tail -3 "/tmp/pe/$e-$f-$t.err"
        done
      done
    done
    T=$(echo ${IK_THREADS:-1 2 4 8 16} | tr ' ' -); TC=$(echo $T | tr - ,)
    timeout 300 python3 -m bench.e2e.big --engines cpufuse --models 1b --types q4_0,q4_k --threads "$TC" --rounds 1 \
      --md "$R/e2e-cf-$T.md" --json "$R/e2e-cf-$T.json" --png /tmp/e.png 2>&1 | grep -E "cpufuse" | tail -12
    python3 -c "import glob, json, os; print(json.dumps({os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob('/tmp/pe/*.json')) if os.path.getsize(f)}))" > "$R/peers-$T.json"
    ;;
esac
ls -la "$R"
