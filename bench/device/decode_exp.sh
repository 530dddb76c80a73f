#!/usr/bin/env bash
# Decode experiments on the lent Xeon (issue 27), each phase after bench/device/xeon.sh's setup (redone
# on a fresh machine): run(command="bash bench/device/decode_exp.sh PHASE", carry=[".whl", ".dev"])
#   exp    bench/e2e/profile.py on 1B Q4_0 at 1-16 threads (serial, task and idle+sync per token), the E5 ramp
#          and bench/gemv.py per type, in cache and from DRAM, 1 thread (E6's two axes);
#   final  the quantized-matmul tests on avx512 and amx, 8B Q4_0 at 4 and 16 threads and 1B Q4_0 at 1
#          and 16 threads against llama-bench, one round each;
#   sync   the quantized-matmul tests, the sync table at 1, 2, 16 threads, 1B Q4_0 at 1 and 16 threads.
set -uo pipefail
PHASE="${1:-exp}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
R="${OUT:-$ROOT/build/device-out}"; mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
OUT=/tmp/xs bash bench/device/xeon.sh setup > /tmp/xs.log 2>&1 || { tail -20 /tmp/xs.log; exit 1; }
M1="$HOME/.cache/cpufuse-bench/llama-1b-shapes-Q4_0.gguf"
LB="$HOME/.cache/cpufuse-bench/llama-bench/build/bin/llama-bench"
qtests() {
  python3 -m pytest -q -x -p no:cacheprovider tests/test_qmatmul.py tests/test_qmatmul_residual.py tests/test_repack.py \
    tests/test_quant_types.py -k "avx512 or amx" 2>&1 | tail -1 | tee "$R/tests-avx512-amx.txt"
}
e2e() {  # tag model threads seconds
  timeout "$4" python3 -m bench.e2e.big --llama-bench "$LB" --models "$2" --types q4_0 --threads "$3" --rounds 1 \
    --md "$R/e2e-big-$1.md" --json "/tmp/e2e-$1.json" --png "/tmp/e2e-$1.png" 2>&1 | grep -E "cpufuse|llama.cpp|probes"
}
case "$PHASE" in
  exp)
    {
      echo "## sync"; python3 -m bench.e2e.profile "$M1" --prompt 16 --threads "${SYNC_THREADS:-1,2,4,8,16}" --steps 64
      echo; echo "## ramp (E5), 1 thread"; taskset -c 2 python3 -m bench.gemv --ramp 16,64,256,1024,4096 --types q4_0,q4_k --dram-mib 1024 --rounds 3
      echo; echo "## gemv, 1 thread"; taskset -c 2 python3 -m bench.gemv --types q4_0,q4_1,q5_0,q8_0,q4_k,q5_k,q6_k --dram-mib 1024 --rounds 3
      echo; echo "## gemv, 1 thread, avx2 build on this Xeon"; taskset -c 2 python3 -m bench.gemv --isa avx2 --types q4_0,q4_k --dram-mib 1024 --rounds 3
    } 2>&1 | tee "$R/decode-exp.md"
    ;;
  final)
    qtests
    python3 -m bench.e2e.bigmodels --models 8b --types q4_0 > /tmp/b8.log 2>&1 || tail -5 /tmp/b8.log
    e2e 8b 8b 4,16 250
    e2e 1b-final 1b 1,16 150
    ;;
  sync)
    qtests
    python3 -m bench.e2e.profile "$M1" --prompt 16 --threads 1,2,16 --steps 64 2>&1 | tee "$R/sync-final.md"
    e2e 1b-sync-final 1b 1,16 200
    ;;
  *) sed -n '2,9p' "$0"; exit 2 ;;
esac
