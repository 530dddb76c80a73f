"""The benchmark cases as a pytest-benchmark suite (not part of `pytest tests`).

    taskset -c 0 python -m pytest bench/test_bench.py --benchmark-only [-k rms_norm] [--benchmark-columns=median]

Parametrized over the ops cases of bench/run.py x the variants available on this machine, and
the attention cases (decode T <= 4096, prefill) x the attention variants; each test checks its
variant's output against the float64 reference before timing it (1 thread). Set
CPUFUSE_BENCH_PEERS=1 to add the torch / onnxruntime / ggml columns (skipped when unavailable).
The test_harness_* tests check the harness itself (no timing).
"""
import os
import re

import numpy as np
import pytest

from bench import attn, graphbench, run, threads
from cpufuse import reference as ref

PEERS = os.environ.get("CPUFUSE_BENCH_PEERS", "") not in ("", "0")
VARIANTS = run.variants(peers=PEERS)
# the FMA peak probe is a baseline timed beside the prefill case by bench.run, not an attention kernel
ATTN_VARIANTS = [v for v in run.AttnSection(PEERS, False).vlist if v.kind != "baseline"]
ATTN_CASES = [c for c in attn.CASES if c.T <= 4096]


def _id(s):
    return re.sub(r"[^0-9A-Za-z]+", "_", s.replace("×", "x")).strip("_")


@pytest.fixture(scope="module")
def case_data():
    cache = {}

    def get(case, inputs=run.make_inputs, reference=run.reference):
        if case.name not in cache:
            inp = inputs(case)
            cache.clear()  # keep one case's arrays alive at a time
            cache[case.name] = (inp, reference(case, inp))
        return cache[case.name]
    return get


@pytest.mark.parametrize("variant", VARIANTS, ids=[_id(v.name) for v in VARIANTS])
@pytest.mark.parametrize("case", run.CASES, ids=[_id(c.name) for c in run.CASES])
def test_bench(benchmark, case, variant, case_data):
    inp, want = case_data(case)
    try:
        fn, get = run.builder(variant)(case, inp)
    except run.Unavailable as e:
        pytest.skip(str(e))
    ok, err = run.check(case, variant, get(), want)
    assert ok, f"{variant.name} on {case.name}: NMSE {err:.3g} > {variant.tol:g}"
    benchmark.group = case.name
    benchmark.extra_info.update(bytes=run.min_bytes(case, inp), nmse=err)
    benchmark(fn)


@pytest.mark.parametrize("variant", ATTN_VARIANTS, ids=[_id(v.name) for v in ATTN_VARIANTS])
@pytest.mark.parametrize("case", ATTN_CASES, ids=[_id(c.name) for c in ATTN_CASES])
def test_bench_attention(benchmark, case, variant, case_data):
    if variant.max_call_s and (case.T > 512 or case.N > 1):
        pytest.skip("numba / scalar attention: only the T=512 decode case here")
    inp, want = case_data(case, attn.make_inputs, attn.reference)
    sec = run.AttnSection(PEERS, False)
    try:
        fn, get = sec.build(case, variant, inp)
    except run.Unavailable as e:
        pytest.skip(str(e))
    tol, _ = sec.tol(case, variant)
    ok, err = run.check(case, variant, get(), want, tol)
    assert ok, f"{variant.name} on {case.name}: NMSE {err:.3g} > {tol:g}"
    benchmark.group = case.name
    benchmark.extra_info.update(kv_bytes=attn.work(case, inp)["bytes"], nmse=err)
    benchmark(fn)


# ------------------------------------------------------------------------------------------------
# the harness itself

def test_harness_numpy_attention_matches_reference():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 5, 16), dtype=np.float32)
    k = rng.standard_normal((1, 2, 7, 16), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((1, 2, 7, 16), dtype=np.float32).astype(np.float16)
    mask = np.where(np.arange(7)[None, :] > np.arange(5)[:, None] + 2, -np.inf, 0).astype(np.float16)[None, None]
    want = ref.flash_attn(q, k, v, mask, scale=0.25)
    assert ref.nmse(want, attn.np_attention(q, k, v, mask, 0.25)) < 1e-12
    assert ref.nmse(ref.flash_attn(q, k, v, None, scale=0.25), attn.np_attention(q, k, v, None, 0.25)) < 1e-12


def test_harness_flop_count():
    c = attn.AttnCase("x", 4, 4, causal=True)
    assert attn.visible_pairs(c) == 10
    assert attn.visible_pairs(attn.AttnCase("y", 1, 9)) == 9


def test_harness_dispatch_cases_check():
    for case in graphbench.DISPATCH_CASES:
        d = graphbench.dispatch_inputs(case)
        want = graphbench.dispatch_reference(case, d)
        for v in run.DispatchSection(False, False).vlist:
            fn, get = graphbench.dispatch_build(case, v, d, 1)
            assert ref.nmse(want, get()) < 1e-10, (case.name, v.name)


def test_harness_threads_modes():
    threads.enter(1)
    if threads.ALL_CORES:
        assert os.sched_getaffinity(0) == {threads.pin_core()}
    threads.enter(threads.ALL)
    if threads.ALL_CORES:
        assert sorted(os.sched_getaffinity(0)) == threads.ALL_CORES
    threads.enter(1)


def test_harness_scaling_thread_counts():
    from bench import scaling
    counts, skipped = scaling.thread_counts()
    assert counts[0] == 1 and counts[-1] == threads.n_all
    assert all(n > threads.n_all for n in skipped)


def test_harness_fma_probe_and_adjacent_peak():
    import cpufuse
    isa = cpufuse.available_isas()[0]
    fn, flops = threads.fma_probe(isa, seconds=0.001)
    if fn is None:
        pytest.skip(f"no cf_fma_peak for {isa} (native extension not loaded)")
    assert flops > 0 and fn() == flops  # the same work every call
    # % adjacent peak = the kernel's GFLOP/s over the probe's, both from the case's own medians
    case = next(c for c in attn.CASES if c.kind == "prefill")
    res = {"FMA peak probe": {"kind": "baseline", "status": "ok", "median_ns": 1e6, "gflops": 100.0},
           "k": {"kind": "cpufuse", "status": "ok", "median_ns": 2e6, "gbps": 1.0, "gflops": 40.0, "n_threads": 1}}
    env = {"copy_bw": {"dram": {"gbps": 10.0}}, "fma_peak": {"gflops_1": 80.0}}
    d = run.derived_attn(case, res, env)
    assert d["pct_probe_peak"] == pytest.approx(40.0) and d["pct_fma_peak"] == pytest.approx(50.0)
