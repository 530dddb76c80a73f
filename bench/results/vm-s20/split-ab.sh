# (session 20) the split-KV defaults A/B on the VM: bash split-ab.sh MODEL THREADS ROUNDS PROMPT
M=$1; T=$2; R=$3; P=$4
for r in $(seq $R); do
  ORDER="_ CPUFUSE_FA_SPLIT=512,256"; [ $((r % 2)) = 0 ] && ORDER="CPUFUSE_FA_SPLIT=512,256 _"
  for ev in $ORDER; do
    if [ "$ev" = _ ]; then E=""; else E="$ev"; fi
    out=$(env $E PYTHONPATH=/work/main /work/wt-q4kdec/.venv/bin/python -m bench.e2e.profile $M --threads $T --read-mib 0 --fused-only --prompt $P --steps 48 2>/dev/null)
    tok=$(echo "$out" | grep -m1 "^| $T |" | awk -F'|' '{print $3}')
    att=$(echo "$out" | grep -m1 "^| ATTN_SEQS" | awk -F'|' '{print $3}')
    echo "r$r $ev token$tok attn$att"
  done
done
