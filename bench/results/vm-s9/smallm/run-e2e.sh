#!/bin/bash
# alternating base/head: verify cost (qwen 1.5B) rows 1,2,3,4,5,6,7,8,9,12,15,16 and granite pp32,pp512
OUT=/tmp/smallm_e2e; mkdir -p $OUT
Q=/root/.cache/cpufuse/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
G=/root/.cache/cpufuse-bench/granite-1b-a400m-shapes-Q8_0.gguf
for r in 1 2; do
  if [ $r = 1 ]; then order="base head"; else order="head base"; fi
  for t in $order; do
    if [ $t = base ]; then T=/tmp/smallm_base; else T=/work/wt-smallm; fi
    cd $T
    PYTHONPATH=$T nice taskset -c 1 /work/main/.venv/bin/python /work/wt-smallm/bench/results/vm-s9/smallm-moe-pp.py $G 32,512 > $OUT/granite_${t}_r$r.json 2>$OUT/err_g_${t}_$r.txt
    PYTHONPATH=$T nice taskset -c 1 /work/main/.venv/bin/python -m bench.smallrows --verify $Q --rows 1-9,12,15,16 --json $OUT/verify_${t}_r$r.json > /dev/null 2>$OUT/err_v_${t}_$r.txt
  done
done
echo done > $OUT/DONE
