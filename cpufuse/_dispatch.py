"""ISA selection: per-call `isa=` > `use_isa()` context > CPUFUSE_ISA > best available.

Strict everywhere: an unknown or unavailable name raises ValueError listing what is available;
there is no quiet downgrade.
"""
import contextlib
import contextvars
import importlib.util
import numbers
import os

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
# may run on (its CPU affinity, not the machine's core count)

def _affinity_cores():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# More threads than this is a mistake (a unit error, a negative number wrapped around), not a
# machine: the native pool runs at most CF_MAX_THREADS = 256 workers, and a count past 2^31 would
# not even fit the C int it is passed as.
MAX_THREADS = 1024


def _check_threads(n, source):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"{source} must be an integer >= 1 and <= {MAX_THREADS}, got {n!r}")
    return int(n)


def _initial_threads():
    env = os.environ.get("CPUFUSE_NUM_THREADS", "").strip()
    if env:
        try:
            return _check_threads(int(env), "CPUFUSE_NUM_THREADS")
        except ValueError:
            raise ValueError(f"CPUFUSE_NUM_THREADS must be an integer >= 1 and <= {MAX_THREADS}, got {env!r}") from None
    return _affinity_cores()


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
    if type(n) is int and 1 <= n <= MAX_THREADS:
        return n
    return _check_threads(n, "n_threads")
