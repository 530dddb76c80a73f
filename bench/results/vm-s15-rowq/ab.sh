#!/bin/bash
# A/B of a decode token's serial time: ../vm-s14-moeserial/serial.py from two trees in alternating processes
# (the order flips each round). usage: BASE=/path/to/main TREE=/path/to/this PY=python bash ab.sh MODEL ROUNDS STEPS OUT.jsonl
# 1 thread pinned to core 1 (core 0 ran another helper's timings), 2 threads on cores 0,1;
# each line: {"tree": A (BASE) | B (TREE), "round", "res"}
M=$1; R=$2; S=$3; OUT=$4; HERE=$(cd "$(dirname "$0")" && pwd); : > "$OUT"
for r in $(seq 1 "$R"); do
  for nth in 1 2; do
    if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
    for t in $order; do
      if [ $t = A ]; then P=$BASE E=${AENV:-}; else P=$TREE E=${BENV:-}; fi
      if [ $nth = 1 ]; then cpus=1; else cpus=0,1; fi
      line=$(cd /tmp && env $E PYTHONPATH=$P taskset -c $cpus nice "${PY:-python}" "$HERE/../vm-s14-moeserial/serial.py" "$M" $nth "$S" 2>/dev/null | grep '^{')
      echo "{\"tree\": \"$t\", \"round\": $r, \"res\": $line}" >> "$OUT"
    done
  done
done
