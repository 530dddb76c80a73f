#!/usr/bin/env bash
# Decode experiments on the lent Xeon (issue 27), after bench/device/xeon.sh's setup (redone if missing):
#   sync   bench/sync.py on 1B Q4_0 at 1, 2, 4, 8, 16 threads: serial, task and idle+sync time per token;
#   ramp   bench/gemv.py --ramp (E5): one-row matmul time per call against bytes per call, from DRAM;
#   gemv   bench/gemv.py in cache and from DRAM per type, 1 thread (E6's two axes).
#   run(command="bash bench/device/decode_exp.sh", carry=[".whl", ".dev"])
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
R="${OUT:-$ROOT/build/device-out}"; mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
OUT=/tmp/xs bash bench/device/xeon.sh setup > /tmp/xs.log 2>&1 || { tail -20 /tmp/xs.log; exit 1; }
M="$HOME/.cache/cpufuse-bench/llama-1b-shapes-Q4_0.gguf"
{
  echo "## sync"; python3 -m bench.sync "$M" --threads ${SYNC_THREADS:-1,2,4,8,16} --steps 64
  echo; echo "## ramp (E5), 1 thread"; taskset -c 2 python3 -m bench.gemv --ramp 16,64,256,1024,4096 --types q4_0,q4_k --dram-mib 1024 --rounds 3
  echo; echo "## gemv, 1 thread"; taskset -c 2 python3 -m bench.gemv --types q4_0,q4_1,q5_0,q8_0,q4_k,q5_k,q6_k --dram-mib 1024 --rounds 3
  echo; echo "## gemv, 1 thread, avx2 build on this Xeon"; taskset -c 2 python3 -m bench.gemv --isa avx2 --types q4_0,q4_k --dram-mib 1024 --rounds 3
} 2>&1 | tee "$R/decode-exp.md"
