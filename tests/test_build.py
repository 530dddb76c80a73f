"""What the build produced: per-ISA compile flags and compiler macros, a scalar baseline with no
packed-float arithmetic, and a pure-Python wheel (CPUFUSE_BUILD_NATIVE=0) that works on Numba."""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import cpufuse
from cpufuse import _backend, _isa
from _util import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_native = pytest.mark.skipif(_backend.lib is None, reason=f"native extension not built: {_backend.LOAD_ERROR}")

EXPECTED_MACROS = {
    "amx": {"AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ", "AVX512VNNI", "AVX2", "FMA", "F16C"},
    "avx2": {"AVX2", "FMA", "F16C"},
    "avx512": {"AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ", "AVX512VNNI", "AVX2", "FMA", "F16C"},
    "neon": {"NEON"},
    "scalar": set(),
}
EXPECTED_FLAGS = {
    "amx": {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"},
    "avx2": {"-mavx2", "-mfma", "-mf16c"},
    "avx512": {"-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"},
    "neon": set(),
    "scalar": {"-fno-tree-vectorize", "-fno-tree-slp-vectorize"},
}


def parse_build_info(s):
    m = re.fullmatch(r"flags=(.*) macros=(.*)", s.strip())
    assert m, f"unexpected build info {s!r}"
    return m.group(1).split(), set(m.group(2).split())


def compiled_isa_params():
    return [pytest.param(i, marks=pytest.mark.skipif(i not in _backend.COMPILED, reason=f"{i}: not compiled into this build"))
            for i in _isa.NATIVE_ISAS]


@needs_native
@pytest.mark.parametrize("isa", compiled_isa_params())
def test_build_flags_and_macros(isa):
    flags, macros = parse_build_info(_backend.build_info(isa))
    emulated = "AMX_EMULATE" in macros  # a CPUFUSE_AMX_EMULATE developer build
    assert flags == _isa.cflags(isa, sanitize="SANITIZE_ADDRESS" in macros, amx_emulate=emulated), \
        "the object was not built with the flags in cpufuse/_isa.py"
    if isa == "amx":
        assert (emulated and "-DCF_AMX_EMULATE" in flags) or {"AMX_TILE", "AMX_INT8"} <= macros, sorted(macros)
    assert EXPECTED_FLAGS[isa] <= set(flags)
    assert EXPECTED_MACROS[isa] <= macros, f"{isa}: macros {sorted(macros)}"
    assert "FAST_MATH" not in macros and "-ffast-math" not in flags
    assert not any(f.startswith(("-Ofast", "-funsafe-math", "-ffinite-math", "-fassociative-math")) for f in flags)
    assert "-ffp-contract=off" in flags
    if isa == "scalar":
        assert not {m for m in macros if m.startswith("AVX") or m in ("FMA", "F16C", "NEON")}, sorted(macros)
    if isa == "avx2":
        assert not {m for m in macros if m.startswith("AVX512")}
    assert cpufuse.info()["build_flags"][isa] == _backend.build_info(isa)


@needs_native
def test_compiled_isas_for_this_machine():
    for isa in _backend.COMPILED:
        arches = _isa.NATIVE_ISAS[isa][0]
        assert arches is None or _backend.MACHINE in arches
    assert "scalar" in _backend.COMPILED


# ------------------------------------------------------------------------------------------------
# the scalar baseline really is scalar

PACKED = re.compile(r"^v?(?:mul|add|sub|div|max|min|sqrt|hadd|hsub|addsub)ps$|^v?f(?:n)?m(?:add|sub|addsub|subadd)\d{3}ps$")


def disassemble():
    if shutil.which("objdump") is None:
        pytest.skip("objdump is not installed")
    so = _backend._ext.__file__
    r = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    funcs, cur = {}, None
    for line in r.stdout.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            cur = m.group(1)
            funcs.setdefault(cur, [])
            continue
        if cur and "\t" in line:
            parts = line.split("\t")
            if len(parts) >= 2:
                mnem = parts[1].split()[0] if parts[1].split() else ""
                funcs[cur].append((mnem, line.strip()))
    return funcs


def packed_ops(insns):
    return [l for m, l in insns if PACKED.match(m)]


@needs_native
def test_scalar_has_no_packed_float_arithmetic():
    if _backend.MACHINE not in ("x86_64", "AMD64"):
        pytest.skip(f"the packed-mnemonic check is written for x86 (this is {_backend.MACHINE})")
    funcs = disassemble()
    scalar = {n: i for n, i in funcs.items() if "__scalar" in n and not n.endswith("@plt")}
    assert any(n.startswith("cf_softmax_f32__scalar") for n in scalar), sorted(scalar)[:20]
    bad = {n: packed_ops(i)[:3] for n, i in scalar.items() if packed_ops(i)}
    assert not bad, f"packed float arithmetic in scalar functions: {bad}"
    # the check can see packed code: the vector ISAs' kernels are full of it
    for isa in ("avx2", "avx512"):
        if isa in _backend.COMPILED:
            assert packed_ops(funcs.get(f"cf_exp_f32__{isa}", [])) or any(
                packed_ops(i) for n, i in funcs.items() if n.endswith(f"__{isa}")), f"no packed ops found in {isa}"


# ------------------------------------------------------------------------------------------------
# native/cdef.h is compiled against the definitions

def _ffibuild():
    """native/ffibuild.py as setup.py loads it (loading it runs no compiler)"""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_cpufuse_ffibuild_test", os.path.join(ROOT, "native", "ffibuild.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# (file of the copied tree, text in it, its replacement, what the compiler must say)
CDEF_MUTATIONS = [
    ("cdef.h", "void CF_FN(cf_exp_f32)(int64_t n,", "void CF_FN(cf_exp_f32)(int n,", "conflicting types for .cf_exp_f32__scalar"),
    ("cdef.h", "const char *CF_FN(cf_build_info)(void);", "char *CF_FN(cf_build_info)(void);",
     "conflicting types for .cf_build_info__scalar"),
    ("cdef.h", "const double *fp, void *y, int nth);", "const double *fp, void *y);", "conflicting types for .cf_rope_f32__scalar"),
    ("cdef.h", "void CF_FN(cf_silu_f32)(int64_t n, const float *a, float *y);\n", "",
     "no previous prototype for .cf_silu_f32__scalar"),   # a definition nobody declared
    ("kernels/graph.inc", "void CF_FN(cf_scale_f32)(int64_t n, const float *a, float s, float *y) {",
     "void CF_FN(cf_scale_f32)(int64_t n, const float *a, double s, float *y) {", "conflicting types for .cf_scale_f32__scalar"),
    ("cdef.h", "int64_t cf_p16_bytes(int64_t type,", "int cf_p16_bytes(int64_t type,", "conflicting types for .cf_p16_bytes"),
    ("cdef.h", "uint32_t cf_cpu_features(void);", "int cf_cpu_features(void);", "conflicting types for .cf_cpu_features"),
    ("cdef.h", "void cf_pool_profile(int on, uint64_t *out);", "void cf_pool_profile(int on, int64_t *out);",
     "conflicting types for .cf_pool_profile"),
]


def _syntax_check(fb, native, src, isa="scalar"):
    """compile native/<src> of a copied tree as the build does (no code generated)"""
    flags = fb.isa_table.cflags(isa) + fb.CHECK_FLAGS if src.startswith("src/isa_") else ["-std=c11"]
    r = subprocess.run(fb.compiler_cmd() + flags + ["-fsyntax-only", os.path.join(native, src)],
                       capture_output=True, text=True, timeout=300)
    return r.returncode, r.stderr


def test_cdef_declarations_are_what_the_compiler_checks(tmp_path):
    """every translation unit that defines a function of native/cdef.h includes it first, so a
    declaration and a definition that differ (a parameter's type, the return type, a parameter
    fewer), or an exported kernel nobody declared, fail the build; cffi reads the same file"""
    fb = _ffibuild()
    if not fb.have_compiler():
        pytest.skip("no working C compiler")
    native = str(tmp_path / "native")
    shutil.copytree(os.path.join(ROOT, "native"), native)
    srcs = ["src/isa_scalar.c", "src/cpuinfo.c", "src/pool.c", "src/repack.c"]
    for src in srcs:
        rc, err = _syntax_check(fb, native, src)
        assert rc == 0, f"{src}: {err}"
    cdef = open(os.path.join(native, "cdef.h")).read()
    for path, old, new, expect in CDEF_MUTATIONS:
        full = os.path.join(native, path)
        text = open(full).read()
        assert text.count(old) == 1, f"{path}: {old!r} not found once (update the test)"
        with open(full, "w") as f:
            f.write(text.replace(old, new))
        try:
            errs = {src: _syntax_check(fb, native, src) for src in srcs}
        finally:
            with open(full, "w") as f:
                f.write(text)
        assert any(rc != 0 and re.search(expect, err) for rc, err in errs.values()), (path, new, errs)
    # cffi's side: the same declarations, once per ISA for the kernels
    decls = fb.declarations(["scalar", "avx2"])
    assert "int cf_rope_f32__avx2(const int64_t *d," in decls and "void cf_exp_f32__scalar(int64_t n," in decls
    assert decls.count("cf_cpu_features") == 1 and "CF_FN" not in decls and "#" not in decls
    n_kernels = len(re.findall(r"\bCF_FN\(", re.sub(r"/\*.*?\*/", "", cdef, flags=re.S)))
    assert len(re.findall(r"__scalar\(", decls)) == len(re.findall(r"__avx2\(", decls)) == n_kernels


@needs_native
def test_every_declared_kernel_is_in_the_extension():
    decls = _ffibuild().declarations(_backend.COMPILED)
    for name in re.findall(r"\b(cf_\w+)\(", decls):
        assert hasattr(_backend.lib, name), name


@pytest.mark.slow
def test_build_runs_ffibuild_once(tmp_path):
    """pip's whole build of a copied tree (metadata, then the wheel with the scalar kernels): each
    process loads native/ffibuild.py once, and the ISAs are probed and compiled once"""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.so", "*.o", "__pycache__", "*.egg-info", "tests", "bench", ".venv*",
        ".pytest_cache", ".benchmarks", "_native.c"))
    log = tmp_path / "loads.log"
    fb = src / "native" / "ffibuild.py"
    text = fb.read_text()
    fb.write_text(f"import os as _o\nopen({str(log)!r}, 'a').write(str(_o.getpid()) + chr(10))\n" + text)
    env = clean_env(CPUFUSE_BUILD_ISAS="scalar", PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-v", "-w",
                        str(tmp_path / "wheels"), str(src)], capture_output=True, text=True, env=env, timeout=600,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(list((tmp_path / "wheels").glob("cpufuse-*.whl"))) == 1
    pids = log.read_text().split()
    assert len(pids) == len(set(pids)) <= 2, pids   # the metadata step and the build, once each
    out = r.stdout + r.stderr
    assert out.count("cpufuse build: ISAs scalar") == 1, out[-3000:]
    assert out.count("cpufuse build: scalar: ") == 1, out[-3000:]


# ------------------------------------------------------------------------------------------------
# pure-Python wheel

# The dev venv has cpufuse installed editable; its meta-path finder would resolve
# cpufuse._native to the source tree's .so even for the package imported from the wheel. Drop it
# so the subprocess sees only what the wheel installed.
HIDE_EDITABLE = textwrap.dedent("""
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not str(getattr(h, "__module__", "")).startswith("__editable__")]
    sys.path_importer_cache.clear()
""")

CHECK = HIDE_EDITABLE + textwrap.dedent("""
    import json, sys
    import numpy as np
    import cpufuse
    from cpufuse import reference
    i = cpufuse.info()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 37)).astype(np.float32)
    m = rng.uniform(-1, 1, (1, 3, 5, 37)).astype(np.float16)
    y = cpufuse.softmax(x, m, scale=0.5, max_bias=8.0)
    e1 = reference.nmse(reference.softmax(x, m, scale=0.5, max_bias=8.0), y)
    w = rng.uniform(-2, 2, 37).astype(np.float32)
    z = cpufuse.rms_norm(x, w, eps=1e-6, bias=w)
    e2 = reference.nmse(reference.rms_norm(x, 1e-6, w, w), z)
    h, z2 = cpufuse.add_rms_norm(x, x, w, eps=1e-6)
    e3 = reference.nmse(reference.rms_norm(x, 1e-6, w, residual=x)[1], z2)
    print(json.dumps({"file": cpufuse.__file__, "native": i["native_extension"], "avail": list(cpufuse.available_isas()),
                      "auto": i["auto_isa"], "nmse": [e1, e2, e3], "h_ok": bool(np.array_equal(h, x + x))}))
""")


@pytest.mark.slow
def test_pure_python_wheel(tmp_path):
    # build from a copy of the source tree: an in-tree build would write build/ and *.egg-info
    # into the working copy others are editing (and could pick up a stale build/lib)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.so", "*.o", "__pycache__", "*.egg-info", "tests", "bench", ".venv*",
        ".pytest_cache", ".benchmarks", "_native.c"))
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    env = clean_env(CPUFUSE_BUILD_NATIVE="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                        str(wheels), str(src)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    built = list(wheels.glob("cpufuse-*.whl"))
    assert len(built) == 1, built
    assert built[0].name.endswith("-py3-none-any.whl"), f"not a pure-Python wheel: {built[0].name}"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                        str(built[0])], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list(target.glob("cpufuse/*.so")), "native code in the pure-Python wheel"
    run_env = clean_env(PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=run_env, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["file"].startswith(str(target)), f"imported {res['file']}, not the installed wheel"
    assert res["native"] is False
    assert res["avail"] == ["numba"] and res["auto"] == "numba"
    assert all(e <= 1e-12 for e in res["nmse"]), res["nmse"]
    assert res["h_ok"]
    # and the CLI reports it
    cli = HIDE_EDITABLE + "import runpy; sys.argv = ['cpufuse', 'info']; runpy.run_module('cpufuse', run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", cli], capture_output=True, text=True, env=run_env, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "native extension : missing" in r.stdout and "(auto: numba)" in r.stdout


def test_cpufuse_defines_flags():
    """CPUFUSE_DEFINES (a developer build of a kernel constant's variant, bench/device/xeon.sh AB_VARIANTS): NAME or
    NAME=VALUE items, space- or comma-separated, become -D flags; anything else is a ValueError naming the item, so
    the variable cannot carry other compiler options"""
    fb = _ffibuild()
    assert fb.defines_flags("") == [] and fb.defines_flags(None) == []
    assert fb.defines_flags("FA_PF_DIST=32, FA_PF_HINT=2") == ["-DFA_PF_DIST=32", "-DFA_PF_HINT=2"]
    assert fb.defines_flags(" QM_TAIL=-1.5e3 P16_PREFETCH ") == ["-DQM_TAIL=-1.5e3", "-DP16_PREFETCH"]
    for bad in ("fa_pf_dist=3", "-O0", "X=1;rm", "X=$(id)", "X=a b=c"):
        with pytest.raises(ValueError, match="CPUFUSE_DEFINES"):
            fb.defines_flags(bad)
