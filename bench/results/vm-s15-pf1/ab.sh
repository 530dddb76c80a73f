#!/usr/bin/env bash
# base and new trees in alternating processes, one thread pinned; MICRO types and cases as arguments.
# usage: ab.sh BASE_TREE NEW_TREE ROUNDS "TYPES" CASES > out.jsonl
B=$1 N=$2 R=$3 TYPES=$4 CASES=$5 PY=${PY:-python3}
H="$(cd "$(dirname "$0")" && pwd)"
for r in $(seq "$R"); do for ty in $TYPES; do for v in base new; do
  t=$([ $v = base ] && echo "$B" || echo "$N")
  MICRO_TYPE=$ty PYTHONPATH="$t" taskset -c 1 "$PY" "$H/../vm-s15-q4kdec/micro.py" "$v" "$CASES"
done; done; done
