#!/usr/bin/env bash
# llama.cpp's and ik_llama.cpp's llama-bench (-rtr 1) against cpufuse on the lent Xeon, after
# bench/device/xeon.sh's setup (redone on a fresh machine): run(command="bash bench/device/peers.sh",
# carry=[".whl", ".dev"]); .dev holds ik_llama.cpp's pruned source (bench/device/prepare.sh). The 1B
# files at 1, 2, 4, 8, 16 threads (IK_THREADS), pp128, pp512, tg128, flash attention on, into
# peers-<threads>.json, and bench.e2e.big --engines cpufuse at the same thread counts.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && ROOT="$PWD"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$ROOT"
R="${OUT:-$ROOT/build/device-out}"; mkdir -p "$R" /tmp/pe
M="$HOME/.cache/cpufuse-bench"
LB="$M/llama-bench/build/bin/llama-bench"
IK="$M/ik/build/bin/llama-bench"
if [ ! -x "$IK" ]; then
  ( mkdir -p "$M/ik" && tar -xzf .dev/ik_llama.cpp-pruned.tar.gz -C "$M/ik" --strip-components=1 &&
    cmake -S "$M/ik" -B "$M/ik/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF > /tmp/ik-cfg.log 2>&1 &&
    cmake --build "$M/ik/build" --target llama-bench -j "$(nproc)" > /tmp/ik-build.log 2>&1
    echo "ik build exit $?" ) > /tmp/ik.log 2>&1 &
fi
OUT=/tmp/xs bash bench/device/xeon.sh setup > /tmp/xs.log 2>&1 || { tail -20 /tmp/xs.log; exit 1; }
wait; cat /tmp/ik.log 2>/dev/null
python3 -m bench.e2e.bigmodels --models 1b --types q4_k > /dev/null 2>&1
for t in ${IK_THREADS:-1 2 4 8 16}; do
  for f in ${IK_MODELS:-q4_0 q4_k}; do
    g="$M/llama-1b-shapes-${f^^}.gguf"; pin=""; [ "$t" = 1 ] && pin="taskset -c 0"
    for e in llama ik; do
      exe=$LB; extra=""; [ $e = ik ] && { exe=$IK; extra="-rtr 1"; }
      echo "== $e $f t=$t"
      timeout 200 $pin "$exe" -m "$g" -p 128,512 -n 128 -t "$t" -fa 1 -r "${IK_REPS:-1}" $extra -o json \
        > "/tmp/pe/$e-$f-$t.json" 2> "/tmp/pe/$e-$f-$t.err" || tail -3 "/tmp/pe/$e-$f-$t.err"
    done
  done
done
T=$(echo ${IK_THREADS:-1 2 4 8 16} | tr ' ' -)
timeout 300 python3 -m bench.e2e.big --engines cpufuse --models 1b --types q4_0,q4_k --threads "${T//-/,}" \
  --rounds 1 --md "$R/e2e-cf-$T.md" --json "$R/e2e-cf-$T.json" --png /tmp/e.png 2>&1 | grep -E "cpufuse" | tail -12
python3 -c "import glob, json, os; print(json.dumps({os.path.basename(f)[:-5]: json.load(open(f))
  for f in sorted(glob.glob('/tmp/pe/*.json')) if os.path.getsize(f)}))" > "$R/peers-$T.json"
ls -la "$R"
