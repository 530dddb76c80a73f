"""The build of cpufuse._native, a cffi extension; setup.py loads this file once per process and
its build_ext calls it once per build (importing it runs no compiler).

Each ISA's translation unit (native/src/isa_<isa>.c) is compiled with that ISA's flags only (the
table in cpufuse/_isa.py) into an object file (compile_isa_objects), and linked into one cffi
extension; the extension's own sources (cpuinfo.c, pool.c, repack.c and the glue, make_ffi) get
the baseline flags. Both sides read their prototypes from native/cdef.h: cffi through
declarations(), the C compiler by including it, so a definition that does not match its
declaration fails the build. An ISA the compiler cannot build is dropped with a message
(buildable_isas), and the cdef lists only what was built. `CPUFUSE_BUILD_ISAS=scalar,avx2`
restricts the set (used by tests of the drop path).

`CPUFUSE_SANITIZE=1` (used by `make test-asan`, which builds a copy of the tree) appends
_isa.SANITIZE_CFLAGS (-fsanitize=address,undefined ...) to every native object and to the link; the
build info then shows them and the macros SANITIZE_ADDRESS / SANITIZE_UNDEFINED. `CPUFUSE_DEFINES`
(below) adds -D flags to the ISA objects, for timing a kernel constant's variants.
"""
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _load_isa_table():
    spec = importlib.util.spec_from_file_location("_cpufuse_isa", os.path.join(ROOT, "cpufuse", "_isa.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


isa_table = _load_isa_table()

SANITIZE = os.environ.get("CPUFUSE_SANITIZE", "0") not in ("", "0")
AMX_EMULATE = os.environ.get("CPUFUSE_AMX_EMULATE", "0") not in ("", "0")  # a developer build: see _isa.py
SANITIZE_FLAGS = isa_table.SANITIZE_CFLAGS if SANITIZE else []  # for the glue and the link
# `CPUFUSE_DEFINES="FA_PF_DIST=32 FA_PF_HINT=2"` (a developer build, for timing variants of a kernel's
# compile-time constants: bench/device/xeon.sh's AB_VARIANTS): -D flags for every ISA object, shown in its
# build info. Names and values are checked, so the variable cannot inject other compiler options.
_DEFINE = re.compile(r"[A-Z_][A-Z0-9_]*(=[-+.0-9A-Za-z_]+)?")


def defines_flags(text):
    """CPUFUSE_DEFINES's text (space- or comma-separated NAME or NAME=VALUE) as -D flags; ValueError names
    a bad item"""
    out = []
    for item in re.split(r"[\s,]+", (text or "").strip()):
        if not item:
            continue
        if not _DEFINE.fullmatch(item):
            raise ValueError(f"CPUFUSE_DEFINES: expected NAME or NAME=VALUE (upper-case name; value of letters, "
                             f"digits, _ . + -), got {item!r}")
        out.append("-D" + item)
    return out


DEFINE_FLAGS = defines_flags(os.environ.get("CPUFUSE_DEFINES", ""))
# The ISA objects are compiled with these too (not part of the flags their build info reports): a
# function they export must be declared first, i.e. be in native/cdef.h, whose declarations each
# translation unit includes before the definitions (a definition that differs is a compile error).
CHECK_FLAGS = ["-Werror=missing-prototypes"]


def compiler_cmd():
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


def _try_compile(src, flags):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.c")
        with open(path, "w") as f:
            f.write(src)
        try:
            r = subprocess.run(compiler_cmd() + flags + ["-I", HERE, "-c", path, "-o", os.path.join(tmp, "probe.o")],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            return False, str(e)
        return r.returncode == 0, (r.stderr or "").strip().splitlines()[-1:] or [""]


def have_compiler():
    ok, _ = _try_compile("int cf_probe(void) { return 0; }\n", [])
    return ok


def buildable_isas():
    machine = platform.machine()
    only = os.environ.get("CPUFUSE_BUILD_ISAS")
    only = set(only.split(",")) if only else None
    out = []
    for isa, (arches, _, _) in isa_table.NATIVE_ISAS.items():
        if arches is not None and machine not in arches:
            continue
        if only is not None and isa not in only:
            print(f"cpufuse build: {isa}: skipped (CPUFUSE_BUILD_ISAS={os.environ['CPUFUSE_BUILD_ISAS']})")
            continue
        probe = f'#include "simd/{isa}.h"\nint cf_probe(void) {{ return VW; }}\n'
        ok, why = _try_compile(probe, isa_table.cflags(isa, amx_emulate=AMX_EMULATE))
        if ok:
            out.append(isa)
        else:
            print(f"cpufuse build: {isa}: dropped, the compiler cannot build it with "
                  f"{' '.join(isa_table.cflags(isa))}: {why}")
    return out


def declarations(isas):
    """native/cdef.h as cffi reads it: comments and preprocessor lines dropped, the declarations
    outside `#ifdef CF_ISA` once, then those with CF_FN(name) once per ISA in isas, as name__<isa>."""
    with open(os.path.join(HERE, "cdef.h")) as f:
        text = re.sub(r"/\*.*?\*/", " ", f.read(), flags=re.S)
    text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    decls = [" ".join(d.split()) + ";" for d in text.split(";") if d.strip()]
    common = [d for d in decls if "CF_FN(" not in d]
    per_isa = [d for d in decls if "CF_FN(" in d]
    return "\n".join(common + [re.sub(r"\bCF_FN\((\w+)\)", rf"\1__{isa}", d) for isa in isas for d in per_isa]) + "\n"


MODULE = "cpufuse._native"
# the extension's own C sources and arguments (baseline flags); setup.py's Extension takes the same
EXTENSION_KW = dict(
    sources=[os.path.relpath(os.path.join(HERE, "src", f), ROOT) for f in ("cpuinfo.c", "pool.c", "repack.c")],
    extra_compile_args=["-O2", "-fno-math-errno", "-std=c11"] + SANITIZE_FLAGS,
    extra_link_args=SANITIZE_FLAGS,
    libraries=["m", "pthread"],
)


def make_ffi(isas):
    """The cffi builder of the extension with the kernels of isas."""
    decls = declarations(isas)
    ffi = FFI()
    ffi.cdef(decls)
    ffi.set_source(MODULE, "#include <stdint.h>\n" + decls + "\n"
                   f'const char *cf_compiled_isas(void) {{ return "{",".join(isas)}"; }}\n', **EXTENSION_KW)
    return ffi


def compile_isa_objects(compiler, build_temp, isas):
    """Compile native/src/isa_<isa>.c for every ISA in isas with its own flags (plus CHECK_FLAGS),
    the ISAs in parallel (one compiler process each, up to the CPU count); return the objects in
    isas order."""
    def one(isa):
        flags = isa_table.cflags(isa, sanitize=SANITIZE, amx_emulate=AMX_EMULATE) + DEFINE_FLAGS
        src = os.path.relpath(os.path.join(HERE, "src", f"isa_{isa}.c"), ROOT)
        print(f"cpufuse build: {isa}: {' '.join(flags)}", flush=True)
        macros = [("CF_BUILD_FLAGS", '"' + " ".join(flags) + '"')] + [("CF_SANITIZE_UNDEFINED", None)] * SANITIZE
        return compiler.compile([src], output_dir=os.path.join(build_temp, "cpufuse_isa"), macros=macros,
                                extra_postargs=flags + CHECK_FLAGS)
    with ThreadPoolExecutor(max_workers=max(1, min(len(isas), os.cpu_count() or 1))) as pool:
        return [o for objs in pool.map(one, isas) for o in objs]


if __name__ == "__main__":
    print("buildable:", buildable_isas() if have_compiler() else [])
