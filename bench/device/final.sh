#!/usr/bin/env bash
# One lease, after the merges (issue 27's closing run): the quantized matmul tests on avx512 and amx
# (every type, the new ones included), then 8B Q4_0 at 4 and 16 threads and 1B Q4_0 at 1 and 16
# threads against llama-bench, one round each.
#   run(command="bash bench/device/final.sh", carry=[".whl", ".dev"])
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
R="${OUT:-$ROOT/build/device-out}"; mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
OUT=/tmp/xs bash bench/device/xeon.sh setup > /tmp/xs.log 2>&1 || { tail -20 /tmp/xs.log; exit 1; }
python3 -m pytest -q -x -p no:cacheprovider tests/test_qmatmul.py tests/test_qmatmul_residual.py tests/test_repack.py \
  $(ls tests/test_quant_new*.py 2>/dev/null) -k "avx512 or amx" 2>&1 | tail -3 | tee "$R/tests-avx512-amx.txt"
python3 -m bench.bigmodels --models 8b --types q4_0 > /tmp/b8.log 2>&1 || tail -5 /tmp/b8.log
LB="$HOME/.cache/cpufuse-bench/llama-bench/build/bin/llama-bench"
timeout 250 python3 -m bench.e2e_big --llama-bench "$LB" --models 8b --types q4_0 --threads 4,16 --rounds 1 \
  --md "$R/e2e-big-8b.md" --json /tmp/e8.json --png /tmp/e8.png 2>&1 | grep -E "cpufuse|llama.cpp|probes" 
timeout 150 python3 -m bench.e2e_big --llama-bench "$LB" --models 1b --types q4_0 --threads 1,16 --rounds 1 \
  --md "$R/e2e-big-1b-final.md" --json /tmp/e1.json --png /tmp/e1.png 2>&1 | grep -E "cpufuse|llama.cpp|probes"
grep -E "^\| (8b|1b)" "$R"/e2e-big-*.md
