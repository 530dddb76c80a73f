"""Build glue: the cffi extension plus one object file per ISA, each compiled with its own flags.

native/ffibuild.py is loaded once per process (importing it runs no compiler); its work (probing
which ISAs the compiler can build, writing the extension's C source, compiling the ISA objects)
runs once per build, in build_ext, so the metadata steps of pip never probe the compiler for ISAs.

CPUFUSE_BUILD_NATIVE=0, or a machine with no working C compiler, installs the pure-Python package
(numpy + Numba paths only).
"""
import importlib.util
import os
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
_FFIBUILD = []


def _ffibuild():
    if not _FFIBUILD:
        spec = importlib.util.spec_from_file_location("_cpufuse_ffibuild", os.path.join(HERE, "native", "ffibuild.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _FFIBUILD.append(mod)
    return _FFIBUILD[0]


class BuildExt(build_ext):
    def build_extension(self, ext):
        if ext.name == "cpufuse._native":
            fb = _ffibuild()
            isas = fb.buildable_isas()
            print(f"cpufuse build: ISAs {','.join(isas)}", flush=True)
            # the glue: cffi writes it only when its text changes (so an unchanged one is not recompiled)
            c_file = os.path.join(self.build_temp, "cpufuse._native.c")
            os.makedirs(self.build_temp, exist_ok=True)
            fb.make_ffi(isas).emit_c_code(c_file)
            ext.sources = [c_file] + [s for s in ext.sources if s != c_file]
            objs = fb.compile_isa_objects(self.compiler, self.build_temp, isas)
            ext.extra_objects = list(ext.extra_objects or []) + objs
            # the objects are rebuilt on every run: listed as dependencies, they make setuptools relink
            # the extension (it compares only sources and depends with the built file)
            ext.depends = list(ext.depends or []) + objs
        super().build_extension(ext)


def _native_extension():
    """The extension (its sources are completed by BuildExt), or None for a pure-Python build."""
    if os.environ.get("CPUFUSE_BUILD_NATIVE", "1") == "0":
        print("cpufuse build: CPUFUSE_BUILD_NATIVE=0: skipping the native extension (Numba paths only)")
        return None
    fb = _ffibuild()
    if not fb.have_compiler():
        print("cpufuse build: no working C compiler: skipping the native extension (Numba paths only)")
        return None
    kw = dict(fb.EXTENSION_KW)
    # as cffi's own setuptools hook does: the stable ABI (an .abi3.so) where the interpreter has one
    limited = not hasattr(sys, "gettotalrefcount") and not sysconfig.get_config_var("Py_GIL_DISABLED")
    if not limited:
        kw["define_macros"] = [("_CFFI_NO_LIMITED_API", None)]
    return Extension(fb.MODULE, py_limited_api=limited, **kw)


_EXT = _native_extension()
setup(
    ext_modules=[_EXT] if _EXT is not None else [],
    cmdclass={"build_ext": BuildExt},
)
