"""The runtime CPU probe (CPUID + XGETBV / HWCAP) against the kernel's view in /proc/cpuinfo."""
import os
import platform

import pytest

import cpufuse
from cpufuse import _backend, _isa

CPUINFO = "/proc/cpuinfo"
MACHINE = platform.machine()
X86 = MACHINE in ("x86_64", "AMD64")
ARM64 = MACHINE in ("aarch64", "arm64")


def proc_flags():
    if not os.path.exists(CPUINFO):
        pytest.skip(f"{CPUINFO} is absent on this system ({platform.system()})")
    with open(CPUINFO) as f:
        for line in f:
            key, _, val = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(val.split())
    pytest.skip(f"{CPUINFO} has no flags/Features line")


@pytest.fixture
def native():
    if _backend.lib is None:
        pytest.skip(f"the native extension is not built: {_backend.LOAD_ERROR}")


X86_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"]
# /proc/cpuinfo spells some flags differently from cpu_features()
PROC_NAME = {"avx512fp16": "avx512_fp16", "avx512vnni": "avx512_vnni"}


@pytest.mark.parametrize("flag", X86_FLAGS + ["avx512fp16"])
def test_x86_flags(native, flag):
    if not X86:
        pytest.skip(f"x86 flag on {MACHINE}")
    flags = proc_flags()
    feats = set(_backend.cpu_features())
    # Linux hides AVX / AVX-512 flags when the OS does not enable their register state, the same
    # condition the probe checks with XGETBV
    pflag = PROC_NAME.get(flag, flag)
    assert (pflag in flags) == (flag in feats), f"{flag}: /proc/cpuinfo {'has' if pflag in flags else 'lacks'} it, " \
                                               f"cpu_features() = {sorted(feats)}"


def test_x86_os_state(native):
    if not X86:
        pytest.skip(f"x86 only, this is {MACHINE}")
    flags, feats = proc_flags(), set(_backend.cpu_features())
    if "avx" in flags:
        assert "os_avx" in feats
    if "avx512f" in flags:
        assert "os_avx512" in feats


def test_arm64_flags(native):
    if not ARM64:
        pytest.skip(f"aarch64 only, this is {MACHINE}")
    flags, feats = proc_flags(), set(_backend.cpu_features())
    assert ("asimd" in flags) == ("neon" in feats)
    assert ("asimdhp" in flags) == ("asimdhp" in feats)


def test_cpu_isas_follow_features(native):
    bits = _backend.CPU_FEATURE_BITS
    feats = set(_backend.cpu_features())
    assert feats == {n for n, b in _isa.CPU_BITS.items() if bits & b}
    isas = set(_backend.cpu_isas())
    for name, (_, _, need) in _isa.NATIVE_ISAS.items():
        if name == "amx" and _backend.amx_emulated():  # a CPUFUSE_AMX_EMULATE build needs no amx bit
            need = tuple(n for n in need if n != "amx")
        assert (name in isas) == all(n in feats for n in need), name
    assert "scalar" in isas
    if X86:
        assert "neon" not in isas
    if ARM64:
        assert not {"avx2", "avx512"} & isas


def test_available_isas_are_compiled_and_supported():
    for name in cpufuse.available_isas():
        if name == "numba":
            continue
        assert name in _backend.COMPILED and name in _backend.cpu_isas()
    for name in _backend.COMPILED:
        if name in _backend.cpu_isas():
            assert name in cpufuse.available_isas()
