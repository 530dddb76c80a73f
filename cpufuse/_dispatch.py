"""ISA selection: per-call `isa=` > `use_isa()` context > CPUFUSE_ISA > best available.

Strict everywhere: an unknown or unavailable name raises ValueError listing what is available;
there is no quiet downgrade.
"""
import contextlib
import contextvars
import importlib.util
import numbers
import os
import warnings

from . import _backend
from ._isa import ALL_ISAS

HAVE_NUMBA = importlib.util.find_spec("numba") is not None

_cpu = set(_backend.cpu_isas())
AVAILABLE = tuple(i for i in ALL_ISAS if (i in _backend.COMPILED and i in _cpu) or (i == "numba" and HAVE_NUMBA))
_AVAILABLE_SET = frozenset(AVAILABLE)


def _why_unavailable(name):
    if name not in ALL_ISAS:
        return f"unknown ISA {name!r}; valid names are {', '.join(ALL_ISAS)}"
    if name == "numba":
        why = "numba is not installed"
    elif name not in _backend.COMPILED:
        why = ("the native extension is not built" if _backend.lib is None
               else f"it was not compiled into this build (compiled: {', '.join(_backend.COMPILED) or 'none'})")
    else:
        why = f"this CPU lacks it (CPU features: {', '.join(_backend.cpu_features()) or 'none'})"
    return f"ISA {name!r} is not available: {why}"


def check_isa(name, source="isa"):
    if name not in _AVAILABLE_SET:
        raise ValueError(f"{source}: {_why_unavailable(name)}; available here: {', '.join(AVAILABLE)}")
    return name


def _initial_default():
    env = os.environ.get("CPUFUSE_ISA", "").strip().lower()
    if env:
        return check_isa(env, "CPUFUSE_ISA"), "CPUFUSE_ISA"
    if not AVAILABLE:
        raise ImportError("cpufuse: no usable path: the native extension is missing and numba is not installed")
    return AVAILABLE[0], None


DEFAULT, ENV_OVERRIDE = _initial_default()
_ctx = contextvars.ContextVar("cpufuse_isa", default=None)


def current():
    """The ISA a call without `isa=` will use now."""
    return _ctx.get() or DEFAULT


def override():
    """Where the ISA in force comes from: 'use_isa', 'CPUFUSE_ISA' or None (auto)."""
    if _ctx.get() is not None:
        return "use_isa"
    return ENV_OVERRIDE


@contextlib.contextmanager
def use_isa(name):
    """Run the block's cpufuse calls on `name` (scalar, avx2, avx512, neon or numba)."""
    token = _ctx.set(check_isa(str(name).lower(), "use_isa"))
    try:
        yield name
    finally:
        _ctx.reset(token)


def resolve(isa):
    """Hot path: the per-call keyword, else the context, else the default."""
    if isa is None:
        return _ctx.get() or DEFAULT
    if isa in _AVAILABLE_SET:
        return isa
    return check_isa(isa)


# ------------------------------------------------------------------------------------------------
# threads: per-call n_threads= > set_num_threads() > CPUFUSE_NUM_THREADS > the cores this process
# may run on (its CPU affinity, not the machine's core count, and at most its cgroup's CPU quota) less
# the load other processes put on them (docs/notes.md "Threads on a busy machine")

def _affinity_cores():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def cgroup_cpu_limit(root="/sys/fs/cgroup", self_cgroup="/proc/self/cgroup"):
    """The CPUs a cgroup CPU quota lets this process use: quota / period rounded down (at least 1: a team
    of threads that wait on each other runs slower past the quota than below it), the smallest over its
    cgroup and the cgroups above it. cgroup v2 `cpu.max` ("max 100000": none, "200000
    100000": 2 CPUs), v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` (-1: none). None where no quota is
    set or nothing can be read. A container's `--cpus=2` (a Kubernetes CPU limit) is such a quota: the
    affinity mask still shows every core of the host, and a team of that many threads runs in turns."""
    lines = (_read(self_cgroup) or "").splitlines()
    v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
    v1 = [ln.split(":", 2)[2] for ln in lines if ln.count(":") >= 2 and "cpu" in ln.split(":", 2)[1].split(",")]
    dirs = []   # (directory, v2?) from the process's cgroup up to the mount point, which a container sees as its own

    def walk(base, path, two):
        parts = [x for x in (path or "/").split("/") if x]
        for i in range(len(parts), -1, -1):
            dirs.append((os.path.join(base, *parts[:i]), two))
    if v2 or not v1:
        walk(root, v2[0] if v2 else "/", True)
    for sub in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        if os.path.isdir(os.path.join(root, sub)):
            walk(os.path.join(root, sub), v1[0] if v1 else "/", False)
            break
    best = None
    for d, two in dirs:
        try:
            if two:
                f = (_read(os.path.join(d, "cpu.max")) or "").split()
                if len(f) != 2 or f[0] == "max":
                    continue
                quota, period = int(f[0]), int(f[1])
            else:
                q, p = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
                if q is None or p is None:
                    continue
                quota, period = int(q), int(p)
        except ValueError:
            continue
        if quota > 0 and period > 0:
            n = max(1, quota // period)
            best = n if best is None else min(best, n)
    return best


def _usable_cores(limit):
    """the affinity mask's cores, at most `limit` (a cgroup quota's CPUs; None: no quota)"""
    return min(_affinity_cores(), limit) if limit else _affinity_cores()


def _others_load():
    """Runnable tasks of other processes, system-wide: the smaller of the 1-minute load average and
    the runnable count now less this process (so a load that just ended, or one that just began,
    does not count alone). 0 where /proc is missing."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        load1, running = float(fields[0]), int(fields[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, min(load1, running - 1))


def default_threads(cores=None, load=None, machine=None):
    """The default thread count: the cores this process may run on (its affinity mask, at most its cgroup
    CPU quota), less their share of the other processes' load (the load is system-wide: it is scaled by
    cores / the machine's CPUs), at least 1. A busy core runs a second thread at half speed and stalls a
    team of threads that waits on it, so a thread per busy core costs more than it brings."""
    cores = _usable_cores(cgroup_cpu_limit()) if cores is None else cores
    load = _others_load() if load is None else load
    machine = max(cores, os.cpu_count() or cores) if machine is None else machine
    return max(1, cores - int(load * cores / machine + 0.5))


# More threads than this is a mistake (a unit error, a negative number wrapped around), not a
# machine: the native pool runs at most CF_MAX_THREADS = 256 workers, and a count past 2^31 would
# not even fit the C int it is passed as.
MAX_THREADS = 1024
CPU_LIMIT = cgroup_cpu_limit()     # None, or the CPUs of a cgroup quota
CORES = _usable_cores(CPU_LIMIT)
if CPU_LIMIT and _backend.lib is not None:
    _backend.lib.cf_pool_cpu_limit(CPU_LIMIT)   # a team larger than the quota does not spin (native/src/pool.c)
_warned = []


def _check_threads(n, source):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"{source} must be an integer >= 1 and <= {MAX_THREADS}, got {n!r}")
    if n > CORES and not _warned:
        _warned.append(n)
        quota = f" (its cgroup's CPU quota)" if CPU_LIMIT and CPU_LIMIT < _affinity_cores() else ""
        warnings.warn(f"cpufuse: {source}={int(n)} is more threads than the {CORES} cores this process may run "
                      f"on{quota}; the extra threads only take turns on those cores (this warning is shown once)",
                      RuntimeWarning, stacklevel=3)
    return int(n)


def _initial_threads():
    env = os.environ.get("CPUFUSE_NUM_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = None
        if n is None or not 1 <= n <= MAX_THREADS:
            raise ValueError(f"CPUFUSE_NUM_THREADS must be an integer >= 1 and <= {MAX_THREADS}, got {env!r}")
        return _check_threads(n, "CPUFUSE_NUM_THREADS")
    return default_threads()


_threads = [_initial_threads()]


def set_num_threads(n):
    """Default thread count for every op (per call: n_threads=)."""
    _threads[0] = _check_threads(n, "n_threads")


def get_num_threads():
    return _threads[0]


def threads(n):
    """Hot path: the per-call keyword or the default."""
    if n is None:
        return _threads[0]
    if type(n) is int and 1 <= n <= CORES:
        return n
    return _check_threads(n, "n_threads")
