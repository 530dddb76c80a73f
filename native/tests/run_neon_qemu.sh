#!/usr/bin/env bash
# Cross-compile native/tests/neon_test.c with the neon and scalar kernels for aarch64 and run it
# under qemu-user. Exit status: 0 pass, 1 fail (build or test), 77 when the cross compiler or
# qemu-aarch64 is missing (the reason is printed). Last line of a run: "neon: N passed, M failed".
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
compile "$TMP/isa_neon.o" "$NATIVE/src/isa_neon.c"
compile "$TMP/isa_scalar.o" "$NATIVE/src/isa_scalar.c" "${SCALAR_EXTRA[@]}"
compile "$TMP/neon_test.o" "$HERE/neon_test.c"

OBJS=("$TMP/neon_test.o" "$TMP/isa_neon.o" "$TMP/isa_scalar.o")
RUN=("$QEMU")
if ! "$CC" "${COMMON[@]}" "${OBJS[@]}" -o "$TMP/neon_test" -lm 2>"$TMP/link.err"; then
  echo "static link failed ($(tail -n 1 "$TMP/link.err")); linking dynamically, QEMU_LD_PREFIX=$SYSROOT"
  if ! "$CC" "${BASE[@]}" "${OBJS[@]}" -o "$TMP/neon_test" -lm; then
    echo "neon: link failed"
    exit 1
  fi
  RUN=(env QEMU_LD_PREFIX="$SYSROOT" "$QEMU")
fi

"${RUN[@]}" "$TMP/neon_test"
rc=$?
case "$rc" in
  0) exit 0 ;;
  1) exit 1 ;; # failures, already reported with the summary line
  *) echo "neon: test program died with status $rc (crash or signal; 139 = SIGSEGV, e.g. a read past an array)"
     exit 1 ;;
esac
