"""The compiled extension, if any, and the CPU's features as the extension detects them."""
import platform

from ._isa import CPU_BITS, cpu_isas_from_bits

try:
    from . import _native as _ext  # type: ignore[attr-defined]
    ffi, lib = _ext.ffi, _ext.lib
    COMPILED = tuple(x for x in ffi.string(lib.cf_compiled_isas()).decode().split(",") if x)
    CPU_FEATURE_BITS = int(lib.cf_cpu_features())
    LOAD_ERROR = None
except ImportError as e:  # pure-Python install (CPUFUSE_BUILD_NATIVE=0 or no compiler)
    ffi = lib = None
    COMPILED = ()
    CPU_FEATURE_BITS = 0
    LOAD_ERROR = str(e)


def cpu_features():
    """Names of the CPU features detected at run time (CPUID+XGETBV / HWCAP)."""
    if lib is None:
        return ()
    return tuple(name for name, bit in CPU_BITS.items() if CPU_FEATURE_BITS & bit)


def amx_emulated():
    """True when the compiled amx ISA emulates the tile instructions (CPUFUSE_AMX_EMULATE build)."""
    return "amx" in COMPILED and "CF_AMX_EMULATE" in build_info("amx")


def cpu_isas():
    """Native ISAs this CPU can run (whether or not they were compiled)."""
    if lib is None:
        # without the extension there is no CPUID probe; say what the machine architecture implies
        return ("scalar",)
    return tuple(cpu_isas_from_bits(CPU_FEATURE_BITS, amx_emulated()))


def build_info(isa):
    """Flags and compiler macros that native/src/isa_<isa>.c was really built with."""
    return ffi.string(getattr(lib, f"cf_build_info__{isa}")()).decode()


MACHINE = platform.machine()
