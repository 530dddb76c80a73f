#!/usr/bin/env bash
# The decode-kernel A/B on the lent Xeon (issue 27): the one-row matmul (bench/gemv.py) in cache and
# from DRAM, one thread, for builds that differ only in the decode tile, run in alternating processes.
#   variants: base (the tree in .dev/ab/base: the previous commit, carried) and this tree built with
#   -DP16_NP=1, 2 and 4 (panels per pass of the one-row tile). Each built for one ISA ($AB_ISA, default
#   avx512) in .dev/ab/<variant>.
# Run HERE first: mkdir -p .dev/ab/base && git archive <base> | tar -x -C .dev/ab/base (and copy
# bench/gemv.py into it); then run(command="bash bench/device/decode_ab.sh", carry=[".whl", ".dev"]).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/build/device-out}"; mkdir -p "$OUT"
PY="${PY:-python3}"
ISA="${AB_ISA:-avx512}"
ROUNDS="${AB_ROUNDS:-3}"
VARIANTS="${AB_VARIANTS:-base np1 np2 np4}"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
export PYTHONUNBUFFERED=1
"$PY" -c "import cffi, pycparser, gguf" 2>/dev/null || \
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
for v in $VARIANTS; do
  d=.dev/ab/$v
  if [ "$v" != base ]; then
    rm -rf "$d"; mkdir -p "$d"
    tar --exclude=./.dev --exclude=./.whl --exclude=./build --exclude=./.venv -cf - . | tar -xf - -C "$d"
  fi
  n="${v#np}"; [ "$v" = base ] && n=4
  ( cd "$d" && CPUFUSE_BUILD_ISAS="$ISA" CC="gcc -DP16_NP=$n" "$PY" setup.py -q build_ext --inplace \
      > "$OUT/build-$v.log" 2>&1; echo "build $v exit $?" ) &
done
wait
for r in $(seq "$ROUNDS"); do
  for v in $VARIANTS; do
    echo "== round $r $v"
    ( cd .dev/ab/$v && PYTHONPATH="$PWD:$PYTHONPATH" taskset -c 2 "$PY" -m bench.gemv --isa "$ISA" --rounds 3 \
        --dram-mib 1024 ${AB_ARGS:-} 2>&1 | tail -6 )
  done
done 2>&1 | tee "$OUT/decode-ab.log"
