"""The benchmark cases as a pytest-benchmark suite (not part of `pytest tests`).

    taskset -c 0 python -m pytest bench/test_bench.py --benchmark-only [-k rms_norm] [--benchmark-columns=median]

Parametrized over the cases of bench/run.py x the variants available on this machine; each test
checks its variant's output against the float64 reference before timing it. Set
CPUFUSE_BENCH_PEERS=1 to add the torch / onnxruntime / ggml columns (skipped when unavailable).
"""
import os
import re

import pytest

from bench import run

PEERS = os.environ.get("CPUFUSE_BENCH_PEERS", "") not in ("", "0")
VARIANTS = run.variants(peers=PEERS)


def _id(s):
    return re.sub(r"[^0-9A-Za-z]+", "_", s.replace("×", "x")).strip("_")


@pytest.fixture(scope="module")
def case_data():
    cache = {}

    def get(case):
        if case.name not in cache:
            inp = run.make_inputs(case)
            cache.clear()  # keep one case's arrays alive at a time
            cache[case.name] = (inp, run.reference(case, inp))
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
