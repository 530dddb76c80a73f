"""Memory for the repacked weight panels, on transparent huge pages (THP) where the kernel gives them.

A one-row (decode) matmul streams every panel once per token. On 4 KiB pages that is one TLB miss,
and one page walk (two levels of tables in a virtual machine), per 4 KiB read; on 2 MiB pages one per
2 MiB. Linux gives anonymous memory huge pages only where THP is `always`, or where it is `madvise`
(the usual default) and the range was madvised MADV_HUGEPAGE, and only for 2 MiB-aligned extents.
numpy madvises its own arrays of 4 MiB and more, but not from a 2 MiB boundary and not the smaller
ones (a 1B model's attention weights), so how many of the panels landed on huge pages depended on
the sizes, the alignment and the kernel (docs/benchmarks.md, "Huge pages for the panels").

`arena()` opens a scope (Model.load's repack runs in one) whose `empty` calls carve 64-byte aligned
buffers out of 2 MiB-aligned anonymous mappings (chunks of CHUNK bytes; a larger buffer gets its own),
madvised MADV_HUGEPAGE as a whole: every 2 MiB of panels is one huge page, and a chunk wastes at most
the rest of its last huge page. A fault takes a huge page only if a free 2 MiB block is at hand (on a
busy VM 542 of 663 MiB did once), so at the scope's end MADV_COLLAPSE (Linux 6.1+) asks the kernel to
move what landed on 4 KiB pages onto huge ones. Outside an arena, `empty` maps a buffer of HUGE_MIN bytes or more on
its own, madvising only its whole 2 MiB extents (no page past its end is touched); smaller ones are
numpy arrays as before. A chunk is unmapped when the last array in it is freed.

CPUFUSE_HUGEPAGES: unset or 1 = huge pages (the default); 0 = the same mappings, madvised
MADV_NOHUGEPAGE (4 KiB pages even where THP is `always`: the A/B of bench/e2e/thp.py). Where the
kernel refuses (THP `never`, no mmap.madvise, not Linux) the buffers are ordinary memory, silently.
The bytes and their addresses mod 64 are the same either way, so results are bit-identical."""
import contextlib
import contextvars
import mmap
import os
import threading

import numpy as np

HUGE = 2 << 20          # the x86-64 / arm64 (4 KiB granule) PMD page size
CHUNK = 256 << 20       # an arena's mapping (virtual: only what is written becomes resident)
HUGE_MIN = HUGE         # outside an arena, buffers from this size get their own mapping
ALIGN = 64
ENV = "CPUFUSE_HUGEPAGES"
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)     # Linux 6.1's value (Python 3.13 names it)
THP_DIR = "/sys/kernel/mm/transparent_hugepage"

_arena = contextvars.ContextVar("cpufuse_pages_arena", default=None)


def wanted():
    """True unless CPUFUSE_HUGEPAGES=0 (read at each allocation, so a process can A/B it)"""
    v = os.environ.get(ENV, "").strip()
    if v in ("", "1"):
        return True
    if v == "0":
        return False
    raise ValueError(f"{ENV}: expected 0 or 1 (or unset), got {v!r}")


def _advice(huge):
    return getattr(mmap, "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE", None)


def thp():
    """{"enabled", "defrag"}: the kernel's THP modes (the bracketed word of the sysfs file, None where
    there is none), "madvise": whether this Python can madvise huge pages, "env": CPUFUSE_HUGEPAGES (None
    when unset), "used": whether new panels ask for them now (THP not `never`, madvise possible,
    CPUFUSE_HUGEPAGES not 0)"""
    out = {"env": os.environ.get(ENV)}
    for k in ("enabled", "defrag"):
        try:
            with open(f"{THP_DIR}/{k}") as f:
                s = f.read()
            out[k] = s[s.index("[") + 1:s.index("]")]
        except (OSError, ValueError):
            out[k] = None
    out["madvise"] = _advice(True) is not None and hasattr(mmap.mmap, "madvise")
    try:
        want = wanted()
    except ValueError:
        want = False
    out["used"] = bool(want and out["madvise"] and out["enabled"] in ("always", "madvise"))
    return out


def _map(nbytes, huge_from, huge_len):
    """(the mapping, the offset of its first 2 MiB boundary): an anonymous mapping of nbytes + HUGE
    bytes, [off + huge_from, + huge_len) madvised by CPUFUSE_HUGEPAGES; None where mmap fails"""
    if not hasattr(mmap, "MAP_PRIVATE"):    # Windows: numpy's memory
        return None
    try:
        mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    except (OSError, ValueError):
        return None
    addr = np.frombuffer(mm, np.uint8, 1).ctypes.data
    off = (-addr) % HUGE
    adv = _advice(wanted())
    if adv is not None and huge_len > 0 and hasattr(mm, "madvise"):
        try:
            mm.madvise(adv, off + huge_from, huge_len)
        except OSError:     # THP compiled out, or a kernel that does not know the advice
            pass
    return mm, off


class _Arena:
    def __init__(self):
        self.lock = threading.Lock()
        self.mm, self.pos, self.end = None, 0, 0
        self.chunks = []    # [mapping, offset of its first 2 MiB boundary, end of what was handed out]

    def empty(self, nbytes):
        with self.lock:
            if self.mm is None or self.pos + nbytes > self.end:
                size = max(CHUNK, -(-nbytes // HUGE) * HUGE)
                m = _map(size, 0, size)
                if m is None:
                    return None
                self.mm, self.pos = m
                self.end = self.pos + size
                self.chunks.append([self.mm, self.pos, self.pos])
            a = np.frombuffer(self.mm, np.uint8, nbytes, self.pos)
            self.pos = -(-(self.pos + nbytes) // ALIGN) * ALIGN
            self.chunks[-1][2] = self.pos
            return a

    def collapse(self):
        """MADV_COLLAPSE what was handed out (written by now): where a fault got 4 KiB pages, because no
        free 2 MiB block was at hand then, the kernel copies them into huge pages now (Linux 6.1+;
        elsewhere, or when it cannot, nothing happens)"""
        if not wanted() or thp()["enabled"] not in ("always", "madvise"):
            return
        for mm, off, end in self.chunks:
            try:
                mm.madvise(MADV_COLLAPSE, off, -(-(end - off) // HUGE) * HUGE)
            except (OSError, ValueError):
                pass


@contextlib.contextmanager
def arena():
    """A scope in which `empty` packs buffers into shared 2 MiB-aligned huge-page chunks."""
    a = _Arena()
    tok = _arena.set(a)
    try:
        yield
    finally:
        _arena.reset(tok)
    a.collapse()


def empty(nbytes):
    """A writable uint8 array of nbytes whose data is 64-byte aligned, on huge pages as above."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"empty: nbytes must be >= 0, got {nbytes}")
    a = None
    ar = _arena.get()
    if nbytes and ar is not None:
        a = ar.empty(nbytes)
    elif nbytes >= HUGE_MIN:
        m = _map(nbytes, 0, nbytes // HUGE * HUGE)
        if m is not None:
            a = np.frombuffer(m[0], np.uint8, nbytes, m[1])
    if a is None:
        base = np.empty(nbytes + ALIGN, np.uint8)
        off = (-base.ctypes.data) % ALIGN
        a = base[off:off + nbytes]
    return a


def coverage(arrays):
    """(bytes of the arrays' mappings on huge pages, bytes of the arrays) from /proc/self/smaps: each
    mapping that holds an array counts min(its AnonHugePages, the arrays' bytes in it); (0, n) where
    smaps cannot be read. For the benchmarks: how many of the panels a load got on huge pages."""
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.nbytes)
    total = sum(hi - lo for lo, hi in spans)
    vmas, cur = [], None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    cur = [int(x, 16) for x in head.split("-")] + [0]
                    vmas.append(cur)
                elif head == "AnonHugePages:" and cur is not None:
                    cur[2] = int(line.split()[1]) << 10
    except OSError:
        return 0, total
    huge, i = 0, 0
    for lo, hi, h in vmas:      # both sorted by address
        while i < len(spans) and spans[i][1] <= lo:
            i += 1
        inside, j = 0, i
        while j < len(spans) and spans[j][0] < hi:
            inside += min(hi, spans[j][1]) - max(lo, spans[j][0])
            j += 1
        huge += min(h, inside)
    return huge, total
