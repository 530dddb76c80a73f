"""Shared fixtures for the cpufuse test suite.

* `isa`: every name in cpufuse.ALL_ISAS; names that cannot run here are skipped with the reason
  the dispatcher gives (e.g. "ISA 'avx512' is not available: this CPU lacks it").
* `native_isa`: the C ISAs only (scalar / avx2 / avx512 / neon); neon is exercised under qemu-user
  by tests/test_neon_qemu.py on x86 hosts, and the skip reason says so.
* `rng`: a seeded numpy Generator (the seed is derived from the test id, so every test is
  reproducible on its own and independent of the order tests run in).
* hypothesis profiles for the property tests (tests/test_props_*.py), chosen by the environment
  variable CPUFUSE_HYPOTHESIS (default "default"):
  - "default": 200 examples per test, derandomized (the same examples on every run), no deadline,
    no example database: the normal suite is deterministic;
  - "fuzz": 10**4 examples per test (CPUFUSE_FUZZ_EXAMPLES overrides), random, with the example
    database tests/.fuzz-db, so a failure found once is replayed first on the next run (make fuzz).
"""
import os
import tempfile
import zlib

import numpy as np
import pytest

import cpufuse
from _util import NATIVE_ISAS, require_isa

# The suite never downloads: no model is pip-installed by name (cpufuse.llama.hub refuses and names
# the command), huggingface_hub stays offline, and the assembled-model cache is a fresh directory.
# Set in os.environ, so the suite's subprocesses inherit them; tests that exercise the install and
# download paths inject an installer or serve a local HF_ENDPOINT themselves.
os.environ["CPUFUSE_NO_INSTALL"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["CPUFUSE_MODELS"] = tempfile.mkdtemp(prefix="cpufuse-models-")

try:
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase
except ImportError:  # the property tests skip themselves (pytest.importorskip)
    settings = None

if settings is not None:
    _quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile("default", max_examples=200, derandomize=True, deadline=None, database=None,
                              suppress_health_check=_quiet, print_blob=True)
    settings.register_profile(
        "fuzz", max_examples=int(os.environ.get("CPUFUSE_FUZZ_EXAMPLES", "10000")), deadline=None,
        database=DirectoryBasedExampleDatabase(os.path.join(os.path.dirname(__file__), ".fuzz-db")),
        suppress_health_check=_quiet, print_blob=True)
    settings.load_profile(os.environ.get("CPUFUSE_HYPOTHESIS", "default"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slower tests (still run by default; deselect with -m 'not slow')")


@pytest.fixture(params=cpufuse.ALL_ISAS)
def isa(request):
    return require_isa(request.param)


@pytest.fixture(params=NATIVE_ISAS)
def native_isa(request):
    return require_isa(request.param)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    """Under `make test-asan` (a native build with SANITIZE_ADDRESS in its build info), the NEON test
    is skipped: it cross-compiles its own aarch64 binaries and runs them under qemu, where neither
    the sanitized extension nor the sanitizer runtime is involved; `make test` runs it."""
    from cpufuse import _backend
    if _backend.lib is None or "SANITIZE_ADDRESS" not in _backend.build_info(_backend.COMPILED[0]):
        return
    skip = pytest.mark.skip(reason="make test-asan: the NEON kernels run under qemu from their own cross-built "
                                   "binaries, not the sanitized extension (make test runs them)")
    for item in items:
        if item.nodeid.startswith("tests/test_neon_qemu.py"):
            item.add_marker(skip)
