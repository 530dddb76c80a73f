"""cpufuse/_pages.py: the repacked panels' memory on transparent huge pages (CPUFUSE_HUGEPAGES): aligned,
disjoint, writable buffers; the madvise each mode asks for (the VMA's flags in /proc/self/smaps); huge
pages taken where the kernel allows; the mapping freed with its last array; results bit-identical with
the knob on and off; `cpufuse info` reports it."""
import contextlib
import gc
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

import cpufuse
from cpufuse import _pages
from cpufuse.llama import Model

from _tiny_gguf import kquant_dims, write_tiny_gguf
from _util import assert_bit_identical, clean_env

SMAPS = "/proc/self/smaps"
CAN_ADVISE = (os.path.exists(SMAPS) and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap.mmap, "madvise")
              and os.path.isdir(_pages.THP_DIR))
needs_advice = pytest.mark.skipif(not CAN_ADVISE, reason="no /proc/self/smaps, mmap.madvise or THP on this system")


def vma(addr):
    """(VmFlags words, AnonHugePages kB) of the mapping that holds addr (None when none does)"""
    cur = None
    with open(SMAPS) as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                cur = {"in": lo <= addr < hi}
            elif cur and cur["in"]:
                if head == "AnonHugePages:":
                    cur["huge"] = int(line.split()[1])
                elif head == "VmFlags:":
                    return line.split()[1:], cur.get("huge", 0)
    return None


def vmstat():
    """the kernel's counters of huge pages it could not give: fault fallbacks and failed collapses"""
    try:
        with open("/proc/vmstat") as f:
            v = dict(line.split() for line in f)
    except OSError:
        return 0
    return sum(int(v.get(k, 0)) for k in ("thp_fault_fallback", "thp_collapse_alloc_failed"))


def no_huge_page_at_hand(before, what):
    """skip (rather than fail) where the kernel said it had no free 2 MiB block: a busy machine's state"""
    if vmstat() > before:
        pytest.skip(f"{what}: the kernel had no free 2 MiB block (thp_fault_fallback or "
                    "thp_collapse_alloc_failed rose); the advice is checked by the other tests")


def thp_faults_possible():
    t = _pages.thp()
    return t["enabled"] in ("always", "madvise") and t["defrag"] in ("always", "madvise", "defer+madvise")


@pytest.fixture
def mode(monkeypatch):
    def set_mode(v):
        if v is None:
            monkeypatch.delenv(_pages.ENV, raising=False)
        else:
            monkeypatch.setenv(_pages.ENV, v)
    return set_mode


@pytest.mark.parametrize("in_arena", [False, True])
def test_buffers_aligned_disjoint_writable(in_arena):
    sizes = [0, 1, 63, 100, 4096, _pages.HUGE - 1, _pages.HUGE, 3 * _pages.HUGE + 5, 17]
    with _pages.arena() if in_arena else contextlib.nullcontext():
        bufs = [_pages.empty(n) for n in sizes]
    spans = []
    for n, a in zip(sizes, bufs):
        assert a.dtype == np.uint8 and a.shape == (n,) and a.flags.writeable and a.flags.c_contiguous
        assert n == 0 or a.ctypes.data % _pages.ALIGN == 0, (n, a.ctypes.data)
        a[:] = n % 251
        if n:
            spans.append((a.ctypes.data, a.ctypes.data + n))
    spans.sort()
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), "buffers overlap"
    for n, a in zip(sizes, bufs):
        assert (a == n % 251).all()


def test_bad_setting_names_the_variable(mode):
    mode("yes")
    with pytest.raises(ValueError, match="CPUFUSE_HUGEPAGES.*'yes'"):
        _pages.wanted()
    with pytest.raises(ValueError, match="CPUFUSE_HUGEPAGES"):
        with _pages.arena():
            _pages.empty(10)
    assert _pages.thp()["used"] is False
    with pytest.raises(ValueError, match="nbytes"):
        _pages.empty(-1)


@needs_advice
@pytest.mark.parametrize("setting, flag", [(None, "hg"), ("1", "hg"), ("0", "nh")])
def test_the_advice_each_setting_asks_for(mode, setting, flag):
    mode(setting)
    with _pages.arena():
        a = _pages.empty(5 << 20)
        b = _pages.empty(1000)                        # packed into the same chunk
    big = _pages.empty(3 * _pages.HUGE + 4096)        # its own mapping outside an arena
    for x in (a, b, big):
        flags, _ = vma(x.ctypes.data)
        assert flag in flags, (setting, flags)
    # outside an arena only whole 2 MiB extents are advised: the buffer's tail is not
    flags, _ = vma(big.ctypes.data + big.nbytes - 1)
    assert "hg" not in flags


@needs_advice
def test_huge_pages_are_taken(mode):
    t = _pages.thp()
    if not thp_faults_possible():
        pytest.skip(f"THP enabled {t['enabled']}, defrag {t['defrag']}: a fault need not get a huge page")
    for setting, want in (("1", True), ("0", False)):
        mode(setting)
        before = vmstat()
        with _pages.arena():
            a = _pages.empty(8 << 20)
            a[:] = 1
        _, huge = vma(a.ctypes.data)
        if want and huge < 2048:
            no_huge_page_at_hand(before, "8 MiB madvised MADV_HUGEPAGE")
        assert (huge >= 2048) == want, (setting, huge)


def _kernel_at_least(major, minor):
    try:
        return tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (major, minor)
    except ValueError:
        return False


@needs_advice
def test_collapse_moves_4k_faults_onto_huge_pages(mode, monkeypatch):
    """a chunk whose faults got 4 KiB pages (here: no MADV_HUGEPAGE before them) is collapsed onto huge
    pages when the arena closes, its bytes unchanged"""
    t = _pages.thp()
    if t["enabled"] != "madvise" or not _kernel_at_least(6, 1):
        pytest.skip(f"THP {t['enabled']}, kernel {os.uname().release}: needs `madvise` and MADV_COLLAPSE (6.1)")
    mode("1")
    monkeypatch.setattr(_pages, "_advice", lambda huge: None)
    before = vmstat()
    with _pages.arena():
        a = _pages.empty(6 << 20)
        a[:] = np.arange(a.size, dtype=np.uint64).astype(np.uint8)
        assert vma(a.ctypes.data)[1] == 0
    if vma(a.ctypes.data)[1] < 2048:
        no_huge_page_at_hand(before, "MADV_COLLAPSE")
    assert vma(a.ctypes.data)[1] >= 2048
    assert np.array_equal(a, np.arange(a.size, dtype=np.uint64).astype(np.uint8))


@needs_advice
def test_the_mapping_goes_with_its_last_array():
    with _pages.arena():
        a = _pages.empty(3 << 20)
        b = _pages.empty(64)
    addr = a.ctypes.data
    a[:] = 7
    del a
    gc.collect()
    assert vma(addr) is not None                  # b still holds the chunk
    del b
    gc.collect()
    assert vma(addr) is None


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K"])
def test_results_bit_identical_with_and_without(tmp_path, mode, qtype):
    path = write_tiny_gguf(tmp_path / f"{qtype}.gguf", qtype=qtype, dims=kquant_dims() if "K" in qtype else None)
    toks = [1, 5, 9, 30, 2, 7]
    out = {}
    for setting in ("0", "1"):
        mode(setting)
        m = Model.load(path, n_ctx=32)
        ws = [w for L in m.layers for w in vars(L).values() if getattr(w, "layout", None) == "p16"]
        assert ws and all(w.raw.ctypes.data % 64 == 0 and not w.raw.flags.writeable for w in ws)
        if CAN_ADVISE:
            assert ("hg" if setting == "1" else "nh") in vma(ws[0].raw.ctypes.data)[0]
        out[setting] = (m.eval(toks).copy(), m.eval([3]).copy(), [w.raw.copy() for w in ws])
    for a, b in zip(out["0"][:2], out["1"][:2]):
        assert_bit_identical(a, b, qtype)
    for a, b in zip(out["0"][2], out["1"][2]):
        assert np.array_equal(a, b)


def test_info_reports_huge_pages():
    h = cpufuse.info()["huge_pages"]
    assert set(h) == {"enabled", "defrag", "madvise", "env", "used"}
    assert h["enabled"] in (None, "always", "madvise", "never")
    on = "on" if h["enabled"] in ("always", "madvise") and h["madvise"] else "off"
    for setting, word in (("0", "off"), ("1", on)):
        r = subprocess.run([sys.executable, "-m", "cpufuse", "info"], capture_output=True, text=True, timeout=120,
                           env=clean_env(CPUFUSE_HUGEPAGES=setting), cwd=os.path.dirname(__file__))
        assert r.returncode == 0, r.stderr
        assert f"huge pages       : {word} for the repacked weights" in r.stdout, r.stdout
        assert f"CPUFUSE_HUGEPAGES = {setting})" in r.stdout


@needs_advice
def test_coverage_counts_the_arrays_huge_bytes(mode):
    mode("0")
    with _pages.arena():
        small = _pages.empty(5 << 20)
    small[:] = 1
    assert _pages.coverage([small]) == (0, small.nbytes)
    assert _pages.coverage([]) == (0, 0)
    if not thp_faults_possible():
        return
    mode("1")
    before = vmstat()
    with _pages.arena():
        a, b = _pages.empty(6 << 20), _pages.empty(100)
        a[:] = 1
    huge, total = _pages.coverage([a, b])
    assert total == a.nbytes + 100 and huge <= total
    if huge < _pages.HUGE:
        no_huge_page_at_hand(before, "6 MiB madvised MADV_HUGEPAGE")
    assert huge >= _pages.HUGE
