"""The benchmark's machine probes (native/kernels/probe.inc): the int8 dot peak returns the
multiply-adds it did and runs at a plausible rate; the read-bandwidth sum is exact and the same for
every thread count."""
import time

import numpy as np
import pytest

from cpufuse import _backend, _registry
from _util import NATIVE_ISAS, require_isa

# int8 multiply-adds per round of the probe on each build (chains x the dot's MACs; the plain loop:
# 64): avx512 is built with VNNI (vpdpbusd zmm), neon depends on the compiler's dotprod
MACS_PER_ROUND = {"avx512": {64 * 12}, "avx2": {32 * 8}, "neon": {16 * 12, 64}, "scalar": {64}}
MACS_PER_ROUND["amx"] = MACS_PER_ROUND["avx512"]      # the amx build probes with the avx512 loop


def _probe(op, isa):
    require_isa(isa)
    return _registry.kernel(op, isa)


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_int8_peak_counts_and_rate(isa):
    fn = _probe("int8_peak", isa)
    sink = _backend.ffi.new("int32_t *")
    assert fn(0, sink) == 0.0
    it = 20_000
    t0 = time.perf_counter()
    macs = fn(it, sink)
    dt = time.perf_counter() - t0
    assert macs / it in MACS_PER_ROUND[isa] and macs > 0
    rate = macs / dt / 1e9            # G multiply-adds / s
    # plausible: above a slow interpreter-speed loop, below any CPU core (~0.5 TMAC/s with AMX off)
    assert 0.01 < rate < 5000, rate


@pytest.mark.parametrize("isa", NATIVE_ISAS)
def test_read_sum_exact_for_every_thread_count(isa):
    fn = _probe("read_sum", isa)
    n = 3 * (1 << 18) + 37           # 3 whole 1 MiB chunks and a ragged tail
    x = np.ones(n, np.float32)
    x[::7] = 2.0
    ptr = _backend.ffi.cast("const float *", x.ctypes.data)
    want = float(x.astype(np.float64).sum())
    for nth in (1, 2, 3, 8):
        assert fn(ptr, n, nth) == want
    assert fn(ptr, 0, 2) == 0.0
    assert fn(ptr, 5, 1) == float(x[:5].astype(np.float64).sum())
