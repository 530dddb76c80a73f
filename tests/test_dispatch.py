"""ISA selection: per-call isa= > use_isa() > CPUFUSE_ISA > best available; info(); the
`python -m cpufuse info` command under CPUFUSE_ISA overrides."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import cpufuse
from cpufuse import _dispatch, _registry
from cpufuse.ops.checks import clear_plans
from _util import AVAILABLE, clean_env

X = np.random.default_rng(3).standard_normal((3, 40)).astype(np.float32)
W = np.ones(40, np.float32)


SPIED = ("softmax", "softmax_unfused", "rms_norm", "rms_norm_unfused", "rms_norm_rows")


def record(monkeypatch, calls, ops=SPIED):
    """wrap the registry's entries of ops (every ISA here) so that each call appends (op, isa) to calls
    (the ops' call plans hold the kernels they were made with: they are cleared before and after)"""
    clear_plans()
    for op in ops:
        for isa in AVAILABLE:
            try:
                fn = _registry.kernel(op, isa)  # (loads the Numba entry)
            except ValueError:
                continue

            def rec(*a, _fn=fn, _k=(op, isa)):
                calls.append(_k)
                return _fn(*a)
            monkeypatch.setitem(_registry.table(op), isa, rec)


@pytest.fixture
def spy(monkeypatch):
    """a function returning the ISAs of the kernels called since its last call"""
    calls = []
    record(monkeypatch, calls)

    def used():
        isas = [isa for _, isa in calls]
        calls.clear()
        return isas
    yield used
    clear_plans()  # (monkeypatch restores the entries after this)


def run_all(**kw):
    cpufuse.softmax(X, **kw)
    cpufuse.rms_norm(X, W, eps=1e-6, **kw)   # the row kernel (a plan)
    cpufuse.rms_norm(X[None], W, eps=1e-6, **kw)
    cpufuse.add_rms_norm(X, X, eps=1e-6, **kw)


def env_override():
    return os.environ.get("CPUFUSE_ISA", "").strip() or None


def test_available_isas():
    av = cpufuse.available_isas()
    assert isinstance(av, tuple) and len(av) >= 1
    assert set(av) <= set(cpufuse.ALL_ISAS)
    assert list(av) == [i for i in cpufuse.ALL_ISAS if i in av]  # priority order kept
    assert cpufuse.ALL_ISAS == ("amx", "avx512", "avx2", "neon", "scalar", "numba")


def test_auto_picks_best(spy):
    if env_override():
        pytest.skip(f"CPUFUSE_ISA={env_override()} is set for this run")
    assert _dispatch.current() == cpufuse.available_isas()[0]
    assert _dispatch.override() is None
    run_all()
    assert set(spy()) == {cpufuse.available_isas()[0]}


@pytest.mark.parametrize("name", AVAILABLE)
def test_use_isa_routes_every_op(name, spy):
    with cpufuse.use_isa(name) as got:
        assert got == name
        assert _dispatch.current() == name
        run_all()
    assert set(spy()) == {name}


def test_use_isa_nesting_and_restoration(spy):
    before = _dispatch.current()
    av = list(AVAILABLE)
    outer, inner = av[-1], av[0]
    with cpufuse.use_isa(outer):
        cpufuse.softmax(X)
        assert spy() == [outer]
        with cpufuse.use_isa(inner):
            cpufuse.softmax(X)
            assert spy() == [inner]
            assert _dispatch.override() == "use_isa"
        assert _dispatch.current() == outer
        cpufuse.softmax(X)
        assert spy() == [outer]
    assert _dispatch.current() == before
    # restored after an exception inside the block too
    with pytest.raises(RuntimeError):
        with cpufuse.use_isa(outer):
            raise RuntimeError("boom")
    assert _dispatch.current() == before
    # and after a failed use_isa
    with pytest.raises(ValueError):
        with cpufuse.use_isa("foo"):
            pass
    assert _dispatch.current() == before


def test_use_isa_case_insensitive():
    name = AVAILABLE[-1]
    with cpufuse.use_isa(name.upper()):
        assert _dispatch.current() == name


def test_call_isa_beats_use_isa(spy):
    av = list(AVAILABLE)
    for ctx in av:
        for call in av:
            with cpufuse.use_isa(ctx):
                run_all(isa=call)
                assert set(spy()) == {call}, (ctx, call)


def test_use_isa_is_per_thread():
    """the context is a contextvar: another thread keeps the default"""
    seen = []
    with cpufuse.use_isa(AVAILABLE[-1]):
        t = threading.Thread(target=lambda: seen.append(_dispatch.current()))
        t.start()
        t.join()
    assert seen == [_dispatch.DEFAULT]


def test_results_follow_isa():
    """the ISA in force gives the same bits as asking for it per call"""
    for name in AVAILABLE:
        with cpufuse.use_isa(name):
            a = cpufuse.softmax(X, scale=0.3)
            b = cpufuse.rms_norm(X, W, eps=1e-6)
        assert np.array_equal(a, cpufuse.softmax(X, scale=0.3, isa=name))
        assert np.array_equal(b, cpufuse.rms_norm(X, W, eps=1e-6, isa=name))


INFO_KEYS = {"version", "machine", "native_extension", "native_load_error", "compiled_isas", "cpu_features",
             "cpu_isas", "available_isas", "auto_isa", "override", "isa", "build_flags"}


def run_every_op():
    """one call of each op of cpufuse.OPS (run_all's, plus flash_attn, matmul and rope)"""
    from cpufuse.reference import quant as qref
    run_all()
    q = np.ones((1, 2, 3, 8), np.float32)
    cpufuse.flash_attn(q, q, q, scale=0.5)
    w = qref.random_blocks("Q8_0", 4, 32, np.random.default_rng(0))
    cpufuse.matmul(np.ones((2, 32), np.float32), w)
    cpufuse.rope(np.ones((2, 1, 8), np.float32), np.arange(2, dtype=np.int32), n_dims=8)


def test_info(monkeypatch):
    i = cpufuse.info()
    assert INFO_KEYS <= set(i)
    assert i["version"] == cpufuse.__version__
    assert i["available_isas"] == list(cpufuse.available_isas())
    assert i["auto_isa"] == cpufuse.available_isas()[0]
    # "isa" is what every op runs now: the kernels a call of each op reaches are that ISA's
    calls = []
    record(monkeypatch, calls, SPIED + ("flash_attn", "flash_attn_unfused", "qmatmul", "quantize_act", "rope"))

    def ran():
        run_every_op()
        ops = {op.replace("_unfused", "").replace("_rows", "") for op, _ in calls}
        isas = {isa for _, isa in calls}
        calls.clear()
        assert ops >= {"softmax", "rms_norm", "flash_attn", "qmatmul", "rope"}, ops
        return isas
    assert ran() == {i["isa"]}
    assert i["native_extension"] == (i["native_load_error"] is None)
    assert set(i["build_flags"]) == set(i["compiled_isas"])
    for isa in i["available_isas"]:
        assert isa == "numba" or (isa in i["compiled_isas"] and isa in i["cpu_isas"])
    if not env_override():
        assert i["override"] == {"source": None, "isa": None}
    for name in AVAILABLE:
        with cpufuse.use_isa(name):
            j = cpufuse.info()
            assert ran() == {name} and j["isa"] == name
        assert j["override"] == {"source": "use_isa", "isa": name}
    clear_plans()  # (the plans made hold the wrappers)


# ------------------------------------------------------------------------------------------------
# python -m cpufuse info

def run_info(**env):
    return subprocess.run([sys.executable, "-m", "cpufuse", "info"], capture_output=True, text=True,
                          env=clean_env(**env), timeout=120, cwd=os.path.dirname(__file__))


def test_cli_info_auto():
    r = run_info()
    assert r.returncode == 0, r.stderr
    best = cpufuse.available_isas()[0]
    assert f"(auto: {best})" in r.stdout
    assert "override         : none" in r.stdout
    assert f"ISA in force     : {best} (every op: {', '.join(cpufuse.OPS)})" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["scalar", "numba"])
def test_cli_info_override(name):
    if name not in AVAILABLE:
        pytest.skip(f"{name}: not available here")
    r = run_info(CPUFUSE_ISA=name)
    assert r.returncode == 0, r.stderr
    assert f"CPUFUSE_ISA = {name}" in r.stdout
    assert f"ISA in force     : {name} (every op" in r.stdout, r.stdout
    # case and whitespace are forgiven
    r = run_info(CPUFUSE_ISA=f" {name.upper()} ")
    assert r.returncode == 0 and f"CPUFUSE_ISA = {name}" in r.stdout


def test_cli_env_override_in_process_behaviour():
    """CPUFUSE_ISA changes what a call without isa= runs (checked in a fresh interpreter)"""
    name = AVAILABLE[-1]
    code = ("import cpufuse, cpufuse._dispatch as d, numpy as np; "
            "x = np.ones((2, 9), np.float32); cpufuse.softmax(x); "
            "print(d.current(), d.override(), cpufuse.info()['isa'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=clean_env(CPUFUSE_ISA=name), cwd=os.path.dirname(__file__))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [name, "CPUFUSE_ISA", name]


def _assert_lists_available(text):
    assert "available" in text
    for ok in cpufuse.available_isas():
        assert ok in text, text


def test_cli_bogus_env():
    r = run_info(CPUFUSE_ISA="bogus")
    assert r.returncode != 0
    err = r.stderr
    assert "CPUFUSE_ISA" in err and "bogus" in err
    _assert_lists_available(err)


def test_cli_unsupported_env():
    missing = [i for i in cpufuse.ALL_ISAS if i not in AVAILABLE]
    if not missing:
        pytest.skip("every ISA is available here")
    r = run_info(CPUFUSE_ISA=missing[0])
    assert r.returncode != 0
    assert "CPUFUSE_ISA" in r.stderr and missing[0] in r.stderr
    _assert_lists_available(r.stderr)


def test_cli_usage():
    r = subprocess.run([sys.executable, "-m", "cpufuse"], capture_output=True, text=True, env=clean_env(),
                       timeout=120)
    assert r.returncode != 0 and "usage" in r.stderr
