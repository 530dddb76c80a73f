"""docs/semantics.md §6: kernels never read or write past the end of a row. Every operand is placed so that it
ends exactly at a page boundary followed by an inaccessible (PROT_NONE) page; any access past the
end faults. Runs in a subprocess so a fault is reported as a test failure, not a crashed run."""
import os
import subprocess
import sys
import textwrap

import pytest

from cpufuse import _backend
from _util import clean_env

# `make test-asan` runs this file against an AddressSanitizer build: ASan's SEGV handler then turns the
# guard-page fault into a report and exit status 1 instead of a raw SIGSEGV.
ASAN = _backend.lib is not None and "SANITIZE_ADDRESS" in _backend.build_info(_backend.COMPILED[0])

SCRIPT = textwrap.dedent(r"""
    import ctypes, mmap, sys
    import numpy as np
    import cpufuse
    from cpufuse import _backend, _registry

    PAGE = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    KEEP = []

    def at_page_end(shape, dtype, fill=None):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        nbytes = count * dtype.itemsize
        npages = (nbytes + PAGE - 1) // PAGE + 1
        mm = mmap.mmap(-1, npages * PAGE)
        raw = (ctypes.c_char * (npages * PAGE)).from_buffer(mm)
        base = ctypes.addressof(raw)
        if libc.mprotect(base + (npages - 1) * PAGE, PAGE, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
        a = np.frombuffer(mm, dtype=dtype, count=count, offset=(npages - 1) * PAGE - nbytes).reshape(shape)
        KEEP.append((mm, raw))
        if fill is not None:
            a[...] = fill
        return a

    isa = sys.argv[1]
    if isa == "control":  # read one float past the end: must fault
        a = at_page_end((5,), np.float32, 1.0)
        print(ctypes.c_float.from_address(a.ctypes.data + 5 * 4).value)
        sys.exit(0)
    rng = np.random.default_rng(0)
    sizes = list(range(1, 70)) + [127, 129, 255, 257, 1023, 1025]
    for C in sizes:
        for R in (1, 3):
            src = rng.standard_normal((R, C)).astype(np.float32)
            x = at_page_end((R, C), np.float32, src)
            for mdt in (np.float32, np.float16):
                m = at_page_end((R, C), mdt, rng.uniform(-1, 1, (R, C)).astype(mdt))
                sinks = at_page_end((1,), np.float32, 0.5)
                for fused in (True, False):
                    y = at_page_end((R, C), np.float32)
                    cpufuse.softmax(x, m, scale=0.5, max_bias=8.0, sinks=sinks, out=y, isa=isa, fused=fused)
                    assert np.array_equal(y, cpufuse.softmax(src, m.copy(), scale=0.5, max_bias=8.0,
                                                             sinks=np.array([0.5], np.float32), isa=isa, fused=fused))
            xi = at_page_end((R, C), np.float32, src)
            cpufuse.softmax(xi, out=xi, isa=isa)
            w = at_page_end((C,), np.float32, rng.standard_normal(C).astype(np.float32))
            b = at_page_end((C,), np.float32, rng.standard_normal(C).astype(np.float32))
            r = at_page_end((R, C), np.float32, rng.standard_normal((R, C)).astype(np.float32))
            for fused in (True, False):
                y = at_page_end((R, C), np.float32)
                cpufuse.rms_norm(x, w, eps=1e-6, out=y, isa=isa, fused=fused)          # a plan when fused
                y = at_page_end((R, C), np.float32)
                cpufuse.rms_norm(x, w, eps=1e-6, bias=b, out=y, isa=isa, fused=fused)
                y = at_page_end((R, C), np.float32)
                cpufuse.rms_norm(x, eps=1e-6, out=y, isa=isa, fused=fused)
                h = at_page_end((R, C), np.float32)
                y = at_page_end((R, C), np.float32)
                cpufuse.add_rms_norm(x, r, w, eps=1e-6, bias=b, out=(h, y), isa=isa, fused=fused)
                assert np.array_equal(h, src + r)
            xi = at_page_end((R, C), np.float32, src)
            cpufuse.rms_norm(xi, eps=1e-6, out=xi, isa=isa)
        xe = at_page_end((C,), np.float32, rng.uniform(-50, 50, C).astype(np.float32))
        ye = at_page_end((C,), np.float32)
        ffi = _backend.ffi
        _registry.kernel("exp", isa)(C, ffi.cast("float *", xe.ctypes.data), ffi.cast("float *", ye.ctypes.data))
    print("OK", isa)
""")


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs Linux mmap/mprotect")
def test_no_access_past_row_end(native_isa):
    r = subprocess.run([sys.executable, "-c", SCRIPT, native_isa], capture_output=True, text=True, timeout=300,
                       env=clean_env(), cwd=os.path.dirname(__file__))
    if r.returncode < 0:
        pytest.fail(f"{native_isa}: killed by signal {-r.returncode} (a kernel touched the guard page past an "
                    f"operand's end)\n{r.stderr[-2000:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"OK {native_isa}" in r.stdout


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs Linux mmap/mprotect")
def test_guard_page_control():
    """the harness itself: touching one element past an operand does fault"""
    env = clean_env()
    if ASAN:  # this report is expected: to stderr, not to the log directory make test-asan checks
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":log_path=stderr"
    r = subprocess.run([sys.executable, "-c", SCRIPT, "control"], capture_output=True, text=True, timeout=120,
                       env=env, cwd=os.path.dirname(__file__))
    if ASAN:
        assert r.returncode != 0 and "ERROR: AddressSanitizer: SEGV" in r.stderr and "READ memory access" in r.stderr, \
            f"reading past the end did not fault under ASan: rc={r.returncode} {r.stdout} {r.stderr[-2000:]}"
    else:
        assert r.returncode < 0, f"reading past the end did not fault: rc={r.returncode} {r.stdout}"
