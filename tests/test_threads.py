"""Threads (issue 5): every op gives bit-identical results at 1, 2, 3 and 7 threads (fixed
chunking, docs/semantics.md §1), concurrent calls from several Python threads are correct, the GIL is
released during native calls, and the thread-count settings are validated."""
import threading

import numpy as np
import pytest

import cpufuse
from cpufuse.reference import block as blocks
from cpufuse import reference as ref
from _util import assert_bit_identical, assert_nmse

THREADS = (1, 2, 3, 7)


def _softmax_case(rng):
    x = rng.uniform(-4, 4, (2, 3, 37, 1029)).astype(np.float32)
    m = rng.uniform(-1, 1, (1, 3, 40, 1029)).astype(np.float16)
    m[..., ::5] = -np.inf
    sinks = rng.uniform(-1, 1, 3).astype(np.float32)
    return x, m, sinks


def test_softmax_any_thread_count(isa, rng):
    x, m, sinks = _softmax_case(rng)
    outs = [cpufuse.softmax(x, m, scale=0.5, max_bias=8.0, sinks=sinks, isa=isa, n_threads=t) for t in THREADS]
    for t, o in zip(THREADS[1:], outs[1:]):
        assert_bit_identical(outs[0], o, f"softmax {isa} n_threads={t}")
    if isa != "numba":
        u = [cpufuse.softmax(x, m, scale=0.5, max_bias=8.0, sinks=sinks, isa=isa, fused=False, n_threads=t)
             for t in THREADS]
        for o in u[1:]:
            assert_bit_identical(u[0], o, f"softmax unfused {isa}")
    assert_nmse(ref.softmax(x, m, 0.5, 8.0, sinks), outs[0], 1e-12)


def test_rms_norm_any_thread_count(isa, rng):
    x = rng.uniform(-3, 3, (3, 5, 29, 1031)).astype(np.float32)
    w = rng.uniform(-2, 2, 1031).astype(np.float32)
    b = rng.uniform(-2, 2, (5, 1, 1031)).astype(np.float32)
    r = rng.uniform(-2, 2, (29, 1031)).astype(np.float32)
    x2 = x.reshape(-1, 1031)
    runs = {
        "plain": lambda t: cpufuse.rms_norm(x, eps=1e-5, isa=isa, n_threads=t),
        "planned": lambda t: cpufuse.rms_norm(x2, w, eps=1e-5, isa=isa, n_threads=t),
        "weight+bias": lambda t: cpufuse.rms_norm(x, w, eps=1e-5, bias=b, isa=isa, n_threads=t),
        "add_rms_norm": lambda t: np.concatenate([a.ravel() for a in cpufuse.add_rms_norm(
            x, r, w, eps=1e-5, isa=isa, n_threads=t)]),
    }
    for name, run in runs.items():
        outs = [run(t) for t in THREADS]
        for t, o in zip(THREADS[1:], outs[1:]):
            assert_bit_identical(outs[0], o, f"{name} {isa} n_threads={t}")


@pytest.mark.parametrize("strategy", ["rows", "tiled", "split"])
def test_flash_attn_any_thread_count(native_isa, strategy, rng):
    q = rng.uniform(-1, 1, (2, 8, 1 if strategy == "split" else 70, 64)).astype(np.float32)
    k = rng.uniform(-1, 1, (2, 2, 700, 64)).astype(np.float16)
    v = rng.uniform(-1, 1, (2, 2, 700, 64)).astype(np.float16)
    m = rng.uniform(-1, 1, (1, 1, q.shape[2], 700)).astype(np.float16)
    m[..., 100:200] = -np.inf
    sinks = rng.uniform(-3, 3, 8).astype(np.float32)
    outs = [cpufuse.flash_attn(q, k, v, m, scale=0.125, sinks=sinks, isa=native_isa, strategy=strategy,
                               chunk=128, n_threads=t) for t in THREADS]
    for t, o in zip(THREADS[1:], outs[1:]):
        assert_bit_identical(outs[0], o, f"flash_attn {strategy} {native_isa} n_threads={t}")
    assert_nmse(ref.flash_attn(q, k, v, m, 0.125, 0.0, 0.0, sinks), outs[0], 1e-10)


def test_numba_flash_attn_any_thread_count(rng):
    if "numba" not in cpufuse.available_isas():
        pytest.skip("numba: not installed")
    q = rng.uniform(-1, 1, (1, 4, 5, 32)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, 2, 90, 32)).astype(np.float32)
    v = rng.uniform(-1, 1, (1, 2, 90, 32)).astype(np.float32)
    outs = [cpufuse.flash_attn(q, k, v, scale=0.2, isa="numba", n_threads=t) for t in THREADS]
    for o in outs[1:]:
        assert_bit_identical(outs[0], o, "numba flash_attn")


def test_graph_plan_any_thread_count(rng):
    cfg = dict(d=64, n_head=4, n_kv=2, head_dim=16, ffn=96, eps=1e-5)
    W = blocks.make_weights(cfg, rng)
    inp = blocks.make_inputs(cfg, 9, 5, rng)
    plan = blocks.build_graph(cfg, W, 9, 5).compile()
    outs = [plan.run(copy=True, n_threads=t, **inp)[0] for t in THREADS]
    for o in outs[1:]:
        assert_bit_identical(outs[0], o, "decoder block plan")


def test_concurrent_python_threads(rng):
    """4 Python threads run ops at once (each kernel may itself ask for 2 threads: the pool runs one
    parallel job at a time and the others run serially), all results match the reference."""
    cases = []
    for i in range(8):
        x = rng.uniform(-3, 3, (16, 2053)).astype(np.float32)
        w = rng.uniform(-1, 1, 2053).astype(np.float32)
        cases.append((x, w))
    expect = [(ref.softmax(x), ref.rms_norm(x, 1e-5, w)) for x, w in cases]
    errors = []

    def work(j):
        try:
            for it in range(20):
                i = (j + it) % len(cases)
                x, w = cases[i]
                s = cpufuse.softmax(x, n_threads=2)
                r = cpufuse.rms_norm(x, w, eps=1e-5, n_threads=2)
                assert ref.nmse(expect[i][0], s) <= 1e-12
                assert ref.nmse(expect[i][1], r) <= 1e-12
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(j,)) for j in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def test_gil_released_during_native_call(rng):
    """a Python thread keeps running while another thread is inside a long native call"""
    if cpufuse.available_isas()[0] == "numba":
        pytest.skip("native extension not built")
    q = rng.uniform(-1, 1, (1, 8, 256, 64)).astype(np.float32)
    k = rng.uniform(-1, 1, (1, 8, 2048, 64)).astype(np.float32)
    done = threading.Event()
    ticks = [0]

    def ticker():
        while not done.is_set():
            ticks[0] += 1

    t = threading.Thread(target=ticker)
    t.start()
    before = ticks[0]
    cpufuse.flash_attn(q, k, k, scale=0.125, n_threads=1)
    during = ticks[0] - before
    done.set()
    t.join()
    assert during > 100, f"the ticker thread advanced only {during} times during the native call"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_thread_counts(bad):
    x = np.ones((2, 8), np.float32)
    with pytest.raises(ValueError, match="n_threads"):
        cpufuse.softmax(x, n_threads=bad)
    with pytest.raises(ValueError, match="n_threads"):
        cpufuse.set_num_threads(bad)


def test_set_num_threads_roundtrip():
    old = cpufuse.get_num_threads()
    try:
        cpufuse.set_num_threads(3)
        assert cpufuse.get_num_threads() == 3
        assert cpufuse.info()["num_threads"] == 3
    finally:
        cpufuse.set_num_threads(old)


def test_parallel_call_in_a_forked_child(rng):
    """a child forked after the parent started the pool (multiprocessing's default on Linux)
    must not wait for workers it does not have"""
    import multiprocessing as mp
    import os
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    x = rng.uniform(-3, 3, (64, 1024)).astype(np.float32)
    expect = cpufuse.softmax(x, n_threads=2)  # starts the pool in the parent
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_child_softmax, (x,)).get(timeout=60)
    assert_bit_identical(expect, got, "softmax in a forked child")


def _child_softmax(x):
    return cpufuse.softmax(x, n_threads=2)


def test_default_threads_counts_the_load():
    from cpufuse import _dispatch
    assert _dispatch.default_threads(cores=2, load=0.0, machine=2) == 2
    assert _dispatch.default_threads(cores=2, load=5.0, machine=2) == 1      # the busy 2-vCPU VM
    assert _dispatch.default_threads(cores=16, load=4.0, machine=16) == 12
    assert _dispatch.default_threads(cores=4, load=8.0, machine=16) == 2     # affinity: its share of the load
    assert 1 <= _dispatch.default_threads() <= _dispatch.CORES


def test_more_threads_than_cores_warns_once(monkeypatch):
    from cpufuse import _dispatch
    monkeypatch.setattr(_dispatch, "_warned", [])
    n = _dispatch.CORES + 1
    with pytest.warns(RuntimeWarning, match=f"n_threads={n} is more threads than the {_dispatch.CORES} cores"):
        assert _dispatch._check_threads(n, "n_threads") == n
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _dispatch._check_threads(n, "n_threads")   # once per process


def _busy(stop):
    while not stop.is_set():
        pass


def test_oversubscribed_team_is_bounded(tmp_path):
    """Issue 42 item 5: a team of 8 threads on 2 cores beside a busy process decodes in bounded time
    (the workers stop spinning once the team outnumbers the cores; before, each plan step waited for
    every spinner's time slice) and gives the same logits as one thread."""
    import multiprocessing as mp
    import os
    import time
    import warnings
    from _tiny_gguf import write_tiny_gguf
    from cpufuse.llama.model import Model
    if cpufuse.available_isas()[0] == "numba":
        pytest.skip("native extension not built: the pool is the native one")
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity on this platform")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_0")
    toks = [5, 9, 13, 200, 7, 3, 11, 40, 2, 99, 17, 60]
    m1 = Model.load(path, n_ctx=64, n_threads=1)
    expect = np.stack([m1.eval([t]).copy() for t in toks])
    old = os.sched_getaffinity(0)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    comp = ctx.Process(target=_busy, args=(stop,))
    os.sched_setaffinity(0, cpus)
    try:
        comp.start()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            m8 = Model.load(path, n_ctx=64, n_threads=8)
        t0 = time.perf_counter()
        got = np.stack([m8.eval([t]).copy() for t in toks])
        took = time.perf_counter() - t0
    finally:
        stop.set()
        comp.join(10)
        os.sched_setaffinity(0, old)
    assert_bit_identical(expect, got, "8 threads on 2 cores beside a busy process")
    assert took < 2.0, f"{len(toks)} tokens took {took:.2f} s (about 0.1 s here, 4.4 s before the fix)"


def _cg(root, rel, **files):
    d = root.joinpath(*[x for x in rel.split("/") if x])
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1) if name.startswith("cpu_") else d / name).write_text(text)


def test_cgroup_cpu_limit_reads_quotas(tmp_path):
    """A container's CPU limit (docker --cpus, a Kubernetes limit) is a cgroup quota: the affinity mask still
    shows the host's cores. The limit is quota / period rounded down (at least 1), the smallest along the
    cgroup's path."""
    from cpufuse._dispatch import cgroup_cpu_limit

    def lim(name, self_cgroup, build):
        root = tmp_path / name
        root.mkdir()
        build(root)
        (root / "self").write_text(self_cgroup)
        return cgroup_cpu_limit(str(root), str(root / "self"))
    # cgroup v2, a quota on a parent of the process's cgroup (none on its own)
    assert lim("v2", "0::/user.slice/app\n", lambda r: (_cg(r, "user.slice/app", cpu_max="max 100000\n"),
                                                        _cg(r, "user.slice", cpu_max="250000 100000\n"))) == 2
    # a container sees its own cgroup at the mount point
    assert lim("v2c", "0::/\n", lambda r: _cg(r, "", cpu_max="200000 100000\n")) == 2
    assert lim("v2half", "0::/\n", lambda r: _cg(r, "", cpu_max="50000 100000\n")) == 1   # half a CPU: 1
    assert lim("v2none", "0::/\n", lambda r: _cg(r, "", cpu_max="max 100000\n")) is None
    assert lim("v2bad", "0::/\n", lambda r: _cg(r, "", cpu_max="lots\n")) is None
    # cgroup v1: the cpu controller's own hierarchy; the process's path is the host's, absent in the container
    v1 = lambda r: _cg(r, "cpu,cpuacct", **{"cpu.cfs_quota_us": "350000\n", "cpu.cfs_period_us": "100000\n"})  # noqa: E731
    assert lim("v1", "12:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n", v1) == 3
    v1none = lambda r: _cg(r, "cpu", **{"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})  # noqa: E731
    assert lim("v1none", "1:cpu:/\n2:cpuacct:/\n0::/\n", v1none) is None
    assert lim("nothing", "", lambda r: None) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent"), str(tmp_path / "absent-self")) is None


def test_default_threads_takes_the_quota(monkeypatch):
    from cpufuse import _dispatch
    monkeypatch.setattr(_dispatch, "_affinity_cores", lambda: 16)
    monkeypatch.setattr(_dispatch, "cgroup_cpu_limit", lambda: 4)
    assert _dispatch.default_threads(load=0.0, machine=16) == 4
    assert _dispatch.default_threads(load=8.0, machine=16) == 2    # its share of the load, as for an affinity mask
    monkeypatch.setattr(_dispatch, "cgroup_cpu_limit", lambda: None)
    assert _dispatch.default_threads(load=0.0, machine=16) == 16


def test_pool_cpu_limit_keeps_results():
    """cf_pool_cpu_limit (set at import from the cgroup quota): a team larger than it does not spin; the same
    bits at any count, and the limit restored after"""
    from cpufuse import _backend, _dispatch
    if _backend.lib is None:
        pytest.skip("native extension not built: the pool is the native one")
    x = np.random.default_rng(3).standard_normal((64, 1000)).astype(np.float32)
    expect = cpufuse.softmax(x, n_threads=1)
    try:
        _backend.lib.cf_pool_cpu_limit(1)
        assert_bit_identical(expect, cpufuse.softmax(x, n_threads=2), "2 threads over a 1-CPU limit")
    finally:
        _backend.lib.cf_pool_cpu_limit(_dispatch.CPU_LIMIT or 0)
    assert_bit_identical(expect, cpufuse.softmax(x, n_threads=2), "2 threads, the limit restored")


@pytest.mark.parametrize("us", ["0", "1000"])
def test_pool_idle_spin_knob(us):
    """CPUFUSE_POOL_IDLE_US (pool.c, read once per process): a worker's spin between jobs outside a team, an A/B
    knob of timing only; this file's thread-count checks and the compiled plan's, run again in a process with it
    set (0: the workers sleep at once between calls)"""
    import subprocess
    import sys
    from _util import clean_env
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "any_thread_count", __file__],
                       env=clean_env(CPUFUSE_POOL_IDLE_US=us), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]
