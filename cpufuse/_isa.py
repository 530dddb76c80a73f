"""The one ISA table, used by the build (native/ffibuild.py loads this file by path) and at run time.

No imports from the rest of the package here: the build reads it before cpufuse exists.
"""

# Compile flags shared by every native translation unit. Never -ffast-math: masks are -inf and
# NaN/inf must propagate. -ffp-contract=off keeps a*b+c as two roundings unless a kernel asks for
# an FMA explicitly, which is what makes fused RMS_NORM+MUL(+ADD) bit-identical to the unfused chain.
COMMON_CFLAGS = ["-O3", "-std=c11", "-fno-math-errno", "-ffp-contract=off", "-fPIC"]

# CPU feature bits from cf_cpu_features() (native/src/cpuinfo.c).
CPU_BITS = {
    "avx2": 1 << 0, "fma": 1 << 1, "f16c": 1 << 2, "os_avx": 1 << 3,
    "avx512f": 1 << 4, "avx512bw": 1 << 5, "avx512vl": 1 << 6, "avx512dq": 1 << 7,
    "os_avx512": 1 << 8, "avx512fp16": 1 << 9, "amx": 1 << 10, "avx512vnni": 1 << 11,
    "neon": 1 << 16, "asimdhp": 1 << 17,
}

# name: (machines it can be built for, extra cflags, CPU bits it needs at run time)
# The avx512 ISA includes AVX512_VNNI (VPDPBUSD for the quantized matmul's int8 dots), so it
# needs the avx512vnni bit: AVX-512 CPUs without VNNI (Skylake-SP/X) run the avx2 path.
# Order is priority, best first; "scalar" is the portable C baseline and cannot be vectorized
# by the compiler; "numba" is the JIT fallback (no C at all).
# The amx ISA is the avx512 build plus AMX tiles for the quantized GEMM (native/kernels/qamx.inc).
# Its "amx" CPU bit means usable: AMX-TILE and AMX-INT8, the OS's XCR0 tile state, and the OS
# permission (Linux arch_prctl ARCH_REQ_XCOMP_PERM), requested once by the CPU probe.
# CPUFUSE_AMX_EMULATE=1 at build time compiles it with the tiles emulated in C instead (a developer
# build for testing the tile kernels on an AVX-512 VNNI CPU without AMX; then it needs no amx bit).
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"]
_AVX512_NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "os_avx512", "avx2", "fma", "f16c",
                 "os_avx")
AMX_FLAGS = ["-mamx-tile", "-mamx-int8"]
AMX_EMULATE_FLAGS = ["-DCF_AMX_EMULATE"]

NATIVE_ISAS = {
    "amx": (("x86_64", "AMD64"), _AVX512_FLAGS + AMX_FLAGS, _AVX512_NEEDS + ("amx",)),
    "avx512": (("x86_64", "AMD64"),
               _AVX512_FLAGS, _AVX512_NEEDS),
    "avx2": (("x86_64", "AMD64"), ["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c", "os_avx")),
    "neon": (("aarch64", "arm64"), [], ("neon",)),
    "scalar": (None, ["-fno-tree-vectorize", "-fno-tree-slp-vectorize"], ()),
}
ALL_ISAS = ("amx", "avx512", "avx2", "neon", "scalar", "numba")


# Appended to every native object (and the link) by `make test-asan` (CPUFUSE_SANITIZE=1 in the build):
# -O1 keeps the instrumented build at ~1/4 of -O3's compile time; -g1 gives the reports file:line.
SANITIZE_CFLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g1"]


def cflags(isa, sanitize=False, amx_emulate=False):
    flags = NATIVE_ISAS[isa][1]
    if isa == "amx" and amx_emulate:
        flags = _AVX512_FLAGS + AMX_EMULATE_FLAGS
    return COMMON_CFLAGS + flags + (SANITIZE_CFLAGS if sanitize else [])


def cpu_isas_from_bits(bits, amx_emulated=False):
    """Native ISA names whose required CPU bits are all set in `bits` (amx_emulated: the amx build
    emulates the tiles, so it needs only the avx512 bits)."""
    out = []
    for name, (_, _, need) in NATIVE_ISAS.items():
        if name == "amx" and amx_emulated:
            need = _AVX512_NEEDS
        if all(bits & CPU_BITS[b] for b in need):
            out.append(name)
    return out
