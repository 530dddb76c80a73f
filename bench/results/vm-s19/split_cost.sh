#!/bin/bash
# VM: the split knob's cost at 1 thread, alternating order
cd /work/main
F=~/.cache/cpufuse-bench/qwen3-30b-a3b-8l-shapes-Q4_K-pure.gguf
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="_ 128,64"; else order="128,64 _"; fi
  for e in $order; do
    if [ "$e" = _ ]; then unset CPUFUSE_FA_SPLIT; else export CPUFUSE_FA_SPLIT=$e; fi
    PYTHONPATH=/work/main taskset -c 1 /work/wt-q4kdec/.venv/bin/python -m bench.e2e.profile $F --threads 1 --fused-only --prompt 200 --steps 32 --read-mib 0 --md /tmp/splab-$e-r$r.md > /dev/null 2>&1
    echo "r$r $e $(grep -E '^\| 1 \|' /tmp/splab-$e-r$r.md | cut -d'|' -f3) ATTN=$(grep -E '^\| ATTN_SEQS' /tmp/splab-$e-r$r.md | head -1 | cut -d'|' -f3,5)"
  done
done
