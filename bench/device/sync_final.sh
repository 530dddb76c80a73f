#!/usr/bin/env bash
# The sync table after the vector activation quantizer, and 1B Q4_0 against llama-bench at 1 and 16
# threads, in one lease: run(command="bash bench/device/sync_final.sh", carry=[".whl", ".dev"])
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
R="${OUT:-$ROOT/build/device-out}"; mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
OUT=/tmp/xs bash bench/device/xeon.sh setup > /tmp/xs.log 2>&1 || { tail -20 /tmp/xs.log; exit 1; }
python3 -m pytest -q -x -p no:cacheprovider tests/test_qmatmul.py tests/test_quant_types.py -k "avx512 or amx" 2>&1 | tail -1
python3 -m bench.sync "$HOME/.cache/cpufuse-bench/llama-1b-shapes-Q4_0.gguf" --threads 1,2,16 --steps 64 2>&1 | tee "$R/sync-final.md"
LB="$HOME/.cache/cpufuse-bench/llama-bench/build/bin/llama-bench"
timeout 200 python3 -m bench.e2e_big --llama-bench "$LB" --models 1b --types q4_0 --threads 1,16 --rounds 1 \
  --md "$R/e2e-big-1b-sync-final.md" --json /tmp/e1.json --png /tmp/e1.png 2>&1 | grep -E "cpufuse|llama.cpp|probes"
