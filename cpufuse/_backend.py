"""The compiled extension cpufuse._native (a cffi module built by native/ffibuild.py), if any, and the
CPU's features as the extension detects them. The rest of the package imports this module as
`_backend`; only this module imports `_native`."""
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


def native_fn(symbol, isa):
    """The extension's entry point `symbol` compiled for `isa`: <symbol>__<isa> (native/kernels/
    common.h's CF_FN suffix). The one place where a kernel's C name is put together: call sites ask
    cpufuse._registry, which resolves its table through this."""
    return getattr(lib, f"{symbol}__{isa}")


def build_info(isa):
    """Flags and compiler macros that native/src/isa_<isa>.c was really built with (any compiled ISA,
    usable on this CPU or not)."""
    return ffi.string(native_fn("cf_build_info", isa)()).decode()


MACHINE = platform.machine()
