"""Make the ggml peer available for `python -m bench.run --peers`.

    python -m bench.peers_setup [--pip] [--force]

Details: bench/README.md, "bench.peers_setup".
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import time

from . import peers

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
ROOT = peers.GGML_LOCAL
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON",
               "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF", "-DGGML_BACKEND_DL=OFF",
               # what llama.cpp's top-level CMake turns on (ggml's own default for LLAMAFILE is OFF): the
               # quantized-matmul section's ggml column should run the paths llama.cpp runs (docs/quant-design.md)
               "-DGGML_LLAMAFILE=ON", "-DGGML_CPU_REPACK=ON"]


class SetupError(Exception):
    pass


def _run(cmd, log, **kw):
    print("+ " + " ".join(cmd), flush=True)
    with open(log, "a") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if r.returncode:
        tail = open(log).read()[-2000:]
        raise SetupError(f"`{' '.join(cmd[:3])} ...` failed (exit {r.returncode}); log {log}:\n{tail}")


def _source(log):
    src = os.environ.get("CPUFUSE_GGML_SRC")
    if src:
        if not os.path.isfile(os.path.join(src, "CMakeLists.txt")):
            raise SetupError(f"CPUFUSE_GGML_SRC={src} has no CMakeLists.txt")
        return src, f"CPUFUSE_GGML_SRC={src}"
    dl = os.path.join(ROOT, "src")
    os.makedirs(dl, exist_ok=True)
    sdists = glob.glob(os.path.join(dl, "llama_cpp_python-*.tar.gz"))
    if not sdists:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              LLAMA_CPP_PYTHON, "-d", dl], log)
        sdists = glob.glob(os.path.join(dl, "llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise SetupError(f"pip download {LLAMA_CPP_PYTHON} produced no sdist")
    sdist = sorted(sdists)[-1]
    top = os.path.basename(sdist)[:-len(".tar.gz")]
    ggml = os.path.join(dl, top, "vendor", "llama.cpp", "ggml")
    if not os.path.isfile(os.path.join(ggml, "CMakeLists.txt")):
        print(f"extracting ggml from {sdist}", flush=True)
        with tarfile.open(sdist) as t:
            members = [m for m in t.getmembers() if m.name.startswith(f"{top}/vendor/llama.cpp/ggml/")]
            try:
                t.extractall(dl, members=members, filter="data")
            except TypeError:  # Python < 3.12 without the filter argument
                t.extractall(dl, members=members)
    if not os.path.isfile(os.path.join(ggml, "CMakeLists.txt")):
        raise SetupError(f"{sdist} has no vendor/llama.cpp/ggml")
    return ggml, os.path.basename(sdist)


def build_ggml(log):
    for tool in ("cmake", "c++", "cc"):
        if not shutil.which(tool):
            raise SetupError(f"{tool} not found on PATH")
    src, origin = _source(log)
    pc = os.path.join(src, "ggml.pc.in")
    if not os.path.exists(pc):  # the llama-cpp-python sdist omits it; a standalone configure wants it
        with open(pc, "w") as f:
            f.write("Name: ggml\nDescription: ggml\nVersion: @GGML_VERSION@\n")
    build = os.path.join(ROOT, "build")
    t0 = time.time()
    _run(["cmake", "-S", src, "-B", build] + CMAKE_FLAGS, log)
    _run(["cmake", "--build", build, "--config", "Release", "-j", str(os.cpu_count() or 2),
          "--target", "ggml-base", "ggml-cpu"], log)
    lib = os.path.join(ROOT, "lib")
    os.makedirs(lib, exist_ok=True)
    found = [p for p in glob.glob(os.path.join(build, "**", "libggml-*.so*"), recursive=True)]
    if not found:
        raise SetupError(f"the build left no libggml-*.so under {build}")
    for p in found:
        dst = os.path.join(lib, os.path.basename(p))
        if os.path.islink(p):
            if os.path.lexists(dst):
                os.remove(dst)
            os.symlink(os.readlink(p), dst)
        else:
            shutil.copy2(p, dst)
    shutil.copytree(os.path.join(src, "include"), os.path.join(ROOT, "include"), dirs_exist_ok=True)
    commit = next((ln.split(":", 1)[1].strip() for ln in open(log) if "ggml commit:" in ln), "?")
    with open(os.path.join(ROOT, "ORIGIN.txt"), "w") as f:
        f.write(f"ggml from {origin}, commit {commit}\ncmake {' '.join(CMAKE_FLAGS)}\nbuilt in {time.time() - t0:.0f} s\n")
    print(f"ggml built in {time.time() - t0:.0f} s into {lib}", flush=True)


def pip_llama_cpp(log):
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                                      "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF",
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    _run([sys.executable, "-m", "pip", "install", "--no-cache-dir", LLAMA_CPP_PYTHON], log, env=env)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.peers_setup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pip", action="store_true", help="pip install llama-cpp-python instead (slow)")
    ap.add_argument("--force", action="store_true", help="rebuild even if ggml already loads")
    a = ap.parse_args(argv)
    if not a.force:
        g, why = peers._load_ggml()
        if g is not None:
            print(f"ggml peer ready: {g.dir}")
            return 0
    os.makedirs(ROOT, exist_ok=True)
    log = os.path.join(ROOT, "setup.log")
    try:
        (pip_llama_cpp if a.pip else build_ggml)(log)
    except SetupError as e:
        print(f"ggml peer unavailable: {e}", flush=True)
        return 0
    except Exception as e:  # never fail the calling make target
        print(f"ggml peer unavailable: {type(e).__name__}: {e}", flush=True)
        return 0
    peers._load_ggml.cache_clear()
    g, why = peers._load_ggml()
    print(f"ggml peer ready: {g.dir}" if g is not None else f"ggml peer unavailable: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
