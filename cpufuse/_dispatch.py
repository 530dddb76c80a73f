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
# may run on (its CPU affinity, not the machine's core count) less the load other processes put on
# them (docs/notes.md "Threads on a busy machine")

def _affinity_cores():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


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
    """The default thread count: the cores this process may run on, less their share of the other
    processes' load (the load is system-wide: it is scaled by cores / the machine's CPUs), at least 1.
    A busy core runs a second thread at half speed and stalls a team of threads that waits on it, so
    a thread per busy core costs more than it brings."""
    cores = _affinity_cores() if cores is None else cores
    load = _others_load() if load is None else load
    machine = max(cores, os.cpu_count() or cores) if machine is None else machine
    return max(1, cores - int(load * cores / machine + 0.5))


# More threads than this is a mistake (a unit error, a negative number wrapped around), not a
# machine: the native pool runs at most CF_MAX_THREADS = 256 workers, and a count past 2^31 would
# not even fit the C int it is passed as.
MAX_THREADS = 1024
CORES = _affinity_cores()
_warned = []


def _check_threads(n, source):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"{source} must be an integer >= 1 and <= {MAX_THREADS}, got {n!r}")
    if n > CORES and not _warned:
        _warned.append(n)
        warnings.warn(f"cpufuse: {source}={int(n)} is more threads than the {CORES} cores this process may run "
                      f"on; the extra threads only take turns on those cores (this warning is shown once)",
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
