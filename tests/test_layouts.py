"""One declaration per fact: every table that both Python and C read is declared once, and this file
fails when the other side drifts from it.

- the kernel registry (cpufuse/_registry.py) against native/cdef.h, the extension's prototypes;
"""
import os
import re

import pytest

from cpufuse import _backend, _dispatch, _registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "native")


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


# ------------------------------------------------------------------------------------------------
# the kernel registry

def test_registry_matches_cdef():
    """every per-ISA prototype of native/cdef.h is a registry op, and every op's C symbol is declared"""
    declared = set(re.findall(r"\b(cf_\w+)__@ISA@\(", read("native", "cdef.h")))
    registered = {sym for sym, _ in _registry.KERNELS.values() if sym}
    assert declared == registered, (f"in cdef.h only: {sorted(declared - registered)}; "
                                    f"in the registry only: {sorted(registered - declared)}")


@pytest.mark.skipif(_backend.lib is None, reason="native extension not built")
def test_registry_native_tables():
    """the table of every op with a C symbol holds exactly the native ISAs usable here"""
    native = {i for i in _dispatch.AVAILABLE if i != "numba"}
    for op, (sym, _) in _registry.KERNELS.items():
        t = {i for i in _registry.table(op) if i != "numba"}
        assert t == (native if sym else set()), op


def test_registry_numba_entries():
    """every op with a Numba entry names a function that exists; ops without one refuse numba"""
    if "numba" not in _dispatch.AVAILABLE:
        pytest.skip("numba is not installed")
    for op, (_, nbk) in _registry.KERNELS.items():
        if nbk is None:
            with pytest.raises(ValueError, match="no Numba implementation"):
                _registry.kernel(op, "numba")
        else:
            assert callable(_registry.kernel(op, "numba")), op
