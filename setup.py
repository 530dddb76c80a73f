"""Build glue: the cffi extension plus one object file per ISA, each compiled with its own flags.

CPUFUSE_BUILD_NATIVE=0, or a machine with no working C compiler, installs the pure-Python package
(numpy + Numba paths only).
"""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def _ffibuild():
    spec = importlib.util.spec_from_file_location("_cpufuse_ffibuild", os.path.join(HERE, "native", "ffibuild.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildExt(build_ext):
    def build_extension(self, ext):
        if ext.name == "cpufuse._native":
            objs = _ffibuild().compile_isa_objects(self.compiler, self.build_temp)
            ext.extra_objects = list(ext.extra_objects or []) + objs
            # the objects are rebuilt on every run: listed as dependencies, they make setuptools relink
            # the extension (it compares only sources and depends with the built file)
            ext.depends = list(ext.depends or []) + objs
        super().build_extension(ext)


def _native_wanted():
    if os.environ.get("CPUFUSE_BUILD_NATIVE", "1") == "0":
        print("cpufuse build: CPUFUSE_BUILD_NATIVE=0: skipping the native extension (Numba paths only)")
        return False
    if not _ffibuild().have_compiler():
        print("cpufuse build: no working C compiler: skipping the native extension (Numba paths only)")
        return False
    return True


setup(
    cffi_modules=["native/ffibuild.py:ffibuilder"] if _native_wanted() else [],
    cmdclass={"build_ext": BuildExt},
)
