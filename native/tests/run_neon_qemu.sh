#!/usr/bin/env bash
# Cross-compile native/tests/neon_test.c with the neon and scalar kernels (and the thread pool)
# for aarch64 and run it under qemu-user. The test's prototypes are native/cdef.h itself (through
# native/tests/cf_protos.h; the descriptor layouts come from native/kernels/layouts.h), so they
# follow the kernels. Exit status: 0 pass, 1 fail (build or test), 77 when the cross compiler or
# qemu-aarch64 is missing (the reason is printed). Last line of a run: "neon: N passed, M failed".
# Then native/tests/neon_quant_test.c (the quantized matmul) is built and run the same way, plain,
# with the dot-product extension and with i8mm (qemu-aarch64's default cpu, max, has both); the three
# must print the same q8 digest (bit-identical results); the last line gives the totals of all runs.
# Needs (Debian/Ubuntu): apt-get install -y gcc-aarch64-linux-gnu qemu-user libc6-dev-arm64-cross
set -u

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NATIVE="$(dirname "$HERE")"
CC="${AARCH64_CC:-aarch64-linux-gnu-gcc}"
QEMU="${QEMU_AARCH64:-qemu-aarch64}"
SYSROOT="${QEMU_LD_PREFIX:-/usr/aarch64-linux-gnu}"

if ! command -v "$CC" >/dev/null 2>&1; then
  echo "skip: $CC not found (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross)"
  exit 77
fi
if ! command -v "$QEMU" >/dev/null 2>&1; then
  echo "skip: $QEMU not found (apt-get install qemu-user)"
  exit 77
fi

TMP="$(mktemp -d "${TMPDIR:-/tmp}/cf_neon.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# the flags of cpufuse/_isa.py (COMMON_CFLAGS without -fPIC, plus -static), per ISA
BASE=(-O3 -std=c11 -fno-math-errno -ffp-contract=off)
COMMON=("${BASE[@]}" -static)
SCALAR_EXTRA=(-fno-tree-vectorize -fno-tree-slp-vectorize)

compile() { # out.o src extra-flags...
  local out="$1" src="$2"
  shift 2
  local flags=("${COMMON[@]}" "$@")
  if ! "$CC" "${flags[@]}" -DCF_BUILD_FLAGS="\"${flags[*]}\"" -c "$src" -o "$out"; then
    echo "neon: build of $(basename "$src") failed"
    exit 1
  fi
}
# the kernel objects are the slow compiles: built concurrently (the dotprod and i8mm objects for
# the quantized-matmul runs below too), each one's failure reported as by compile()
DOT=(-march=armv8.2-a+dotprod)
MM=(-march=armv8.6-a+i8mm) # armv8.6-a includes the dot-product extension
bg_pids=()
compile_bg() { compile "$@" & bg_pids+=($!); }
wait_bg() {
  local p ok=1
  for p in "${bg_pids[@]}"; do wait "$p" || ok=0; done
  bg_pids=()
  [ "$ok" -eq 1 ] || exit 1
}
compile_bg "$TMP/isa_neon.o" "$NATIVE/src/isa_neon.c"
compile_bg "$TMP/isa_scalar.o" "$NATIVE/src/isa_scalar.c" "${SCALAR_EXTRA[@]}"
compile_bg "$TMP/isa_neon_dot.o" "$NATIVE/src/isa_neon.c" "${DOT[@]}"
compile_bg "$TMP/isa_neon_mm.o" "$NATIVE/src/isa_neon.c" "${MM[@]}"
compile "$TMP/neon_test.o" "$HERE/neon_test.c"

OBJS=("$TMP/neon_test.o" "$TMP/isa_neon.o" "$TMP/isa_scalar.o")
# the thread pool the kernels call (native/src/pool.c) and the P16 repacking of quantized weights
# (native/src/repack.c), baseline flags, when the tree has them
if [ -f "$NATIVE/src/pool.c" ]; then
  compile "$TMP/pool.o" "$NATIVE/src/pool.c" -pthread
  OBJS+=("$TMP/pool.o")
fi
if [ -f "$NATIVE/src/repack.c" ]; then
  compile "$TMP/repack.o" "$NATIVE/src/repack.c"
  OBJS+=("$TMP/repack.o")
fi
wait_bg
RUN=("$QEMU")
if ! "$CC" "${COMMON[@]}" "${OBJS[@]}" -o "$TMP/neon_test" -lm -pthread 2>"$TMP/link.err"; then
  echo "static link failed ($(tail -n 1 "$TMP/link.err")); linking dynamically, QEMU_LD_PREFIX=$SYSROOT"
  if ! "$CC" "${BASE[@]}" "${OBJS[@]}" -o "$TMP/neon_test" -lm -pthread; then
    echo "neon: link failed"
    exit 1
  fi
  RUN=(env QEMU_LD_PREFIX="$SYSROOT" "$QEMU")
fi

"${RUN[@]}" "$TMP/neon_test" | tee "$TMP/neon_test.out"
rc=${PIPESTATUS[0]}
case "$rc" in
  0|1) ;; # 1: failures, already reported with the summary line
  *) echo "neon: test program died with status $rc (crash or signal; 139 = SIGSEGV, e.g. a read past an array)"
     exit 1 ;;
esac

# The quantized matmul (native/simd/neon_q.h, neon_p.h): native/tests/neon_quant_test.c, built and
# run three times, against isa_neon.c as built above (plain armv8-a: SMULL int8 dots) and against
# isa_neon.c objects with the dot-product extension (SDOT) and with i8mm (SMMLA on row pairs in the
# multi-row panel tile, USDOT for Q8_0). Its descriptor layout (QM_*/QW_*) and type ids come from
# the generated headers native/kernels/layouts.h and qtypes.h. The last line is the total of all runs.
pass=0
fail=0
tally() { # adds the counts of the summary line ending the output file $1
  if [[ "$(tail -n 1 "$1")" =~ ([0-9]+)\ passed,\ ([0-9]+)\ failed ]]; then
    pass=$((pass + BASH_REMATCH[1]))
    fail=$((fail + BASH_REMATCH[2]))
  else
    fail=$((fail + 1))
  fi
}
tally "$TMP/neon_test.out"
# neon_test again against the dot-product object (the SDOT decode tile over a quantized K,
# flash_attn.inc FA_QN): its checks, and the same quantized-cache attention bits as the plain build
if "$CC" "${COMMON[@]}" "$TMP/neon_test.o" "$TMP/isa_neon_dot.o" "${OBJS[@]:2}" -o "$TMP/neon_test_dot" -lm -pthread \
     2>/dev/null || "$CC" "${BASE[@]}" "$TMP/neon_test.o" "$TMP/isa_neon_dot.o" "${OBJS[@]:2}" -o "$TMP/neon_test_dot" \
     -lm -pthread; then
  "${RUN[@]}" "$TMP/neon_test_dot" > "$TMP/neon_test_dot.out"
  rc=$?
  tail -n 1 "$TMP/neon_test_dot.out" | sed 's/^/dotprod build: /'
  if [ "$rc" -gt 1 ]; then
    echo "neon: neon_test (dotprod) died with status $rc"
    fail=$((fail + 1))
  else
    tally "$TMP/neon_test_dot.out"
  fi
  fd="$(grep -h '^neon flash_attn quantized: digest' "$TMP/neon_test.out" "$TMP/neon_test_dot.out" | sort -u)"
  echo "$fd"
  if [ "$(echo "$fd" | grep -c .)" -ne 1 ]; then
    echo "neon: FAIL the plain and dotprod builds differ in their quantized-cache attention results"
    fail=$((fail + 1))
  else
    pass=$((pass + 1))
  fi
else
  echo "neon: link of neon_test (dotprod) failed"
  fail=$((fail + 1))
fi
LINK=("${BASE[@]}")
[ "${#RUN[@]}" -eq 1 ] && LINK=("${COMMON[@]}") # static unless the link above fell back
for v in plain dotprod i8mm; do
  extra=()
  neon_obj="$TMP/isa_neon.o"
  if [ "$v" = dotprod ]; then extra=("${DOT[@]}"); neon_obj="$TMP/isa_neon_dot.o"; fi
  if [ "$v" = i8mm ]; then extra=("${MM[@]}"); neon_obj="$TMP/isa_neon_mm.o"; fi
  compile "$TMP/nq_$v.o" "$HERE/neon_quant_test.c" ${extra[@]+"${extra[@]}"}
  if ! "$CC" "${LINK[@]}" ${extra[@]+"${extra[@]}"} "$TMP/nq_$v.o" "$neon_obj" "${OBJS[@]:2}" \
       -o "$TMP/nq_$v" -lm -pthread; then
    echo "neon: link of neon_quant_test ($v) failed"
    exit 1
  fi
  "${RUN[@]}" "$TMP/nq_$v" "$v" | tee "$TMP/nq_$v.out"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -gt 1 ]; then
    echo "neon: neon_quant_test ($v) died with status $rc (crash or signal; 132 = SIGILL, 139 = SIGSEGV)"
    fail=$((fail + 1))
  else
    tally "$TMP/nq_$v.out"
  fi
done
# the three builds' integer dots differ, their q8 results must not
digests="$(cat "$TMP"/nq_*.out | sed -n 's/^neon quant \[\(.*\)\]: q8 digest \([0-9a-f]*\)$/\1 \2/p')"
echo "$digests"
if [ "$(echo "$digests" | grep -c .)" -ne 3 ] || [ "$(echo "$digests" | awk '{print $2}' | sort -u | grep -c .)" -ne 1 ]; then
  echo "neon: FAIL the plain, dotprod and i8mm builds differ in their q8 results (digests above)"
  fail=$((fail + 1))
else
  pass=$((pass + 1))
fi
echo "neon: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
