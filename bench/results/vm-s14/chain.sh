#!/bin/bash
# session 14 chain on core 1 (nice 10): waits for the llama f16 pass, then the steps one after another
cd /work/wt-depthvm
R=bench/results/vm-s14
M=/root/.cache/cpufuse/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
PY=/work/main/.venv/bin/python
LPY=/work/main/.venv-llama/bin/python
T="taskset -c 1 nice -n 10"
while pgrep -f "llama_pass.py pass $M /tmp/s14/ids.npy f16" > /dev/null; do sleep 5; done
echo "f16 depth start $(date -u +%T) load $(cat /proc/loadavg)"
$T $PY bench/results/vm-s12/depth_ab.py --model $M --text /tmp/db/text.txt --depth 16384 --types f16 --rounds 3 \
   --core 1 --state-dir /tmp/depth_ab_state14 --json $R/depth-16384-f16.json > $R/depth-16384-f16.log 2>&1
echo "f16 depth exit $? $(date -u +%T)"
$T $PY $R/kv_convert.py $M 16528 /tmp/depth_ab_state14/cpufuse-f16-16384.state q8_0 /tmp/depth_ab_state14/cpufuse-q8_0-16384.state > $R/kv-convert-q8_0.log 2>&1
echo "convert exit $? $(date -u +%T)"
$T /usr/bin/time -v $LPY $R/llama_pass.py pass $M /tmp/s14/ids.npy q8_0 16528 8192,16384 1024 /tmp/s14 /tmp/depth_ab_state14 > $R/llama-pass-q8_0.log 2>&1
echo "llama q8_0 pass exit $? $(date -u +%T)"
$T $PY bench/results/vm-s12/depth_ab.py --model $M --text /tmp/db/text.txt --depth 16384 --types q8_0 --rounds 3 \
   --core 1 --state-dir /tmp/depth_ab_state14 --json $R/depth-16384-q8_0.json > $R/depth-16384-q8_0.log 2>&1
echo "q8_0 depth exit $? $(date -u +%T)"
