"""The NEON kernels, cross-compiled for aarch64 and run under qemu-user.

native/tests/run_neon_qemu.sh builds native/tests/neon_test.c with native/src/isa_neon.c and
isa_scalar.c (aarch64-linux-gnu-gcc, static) and runs it with qemu-aarch64. It exits 77 when the
cross compiler or qemu is missing; that is a visible skip here, with the script's reason.
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "native", "tests", "run_neon_qemu.sh")


def test_neon_kernels_under_qemu():
    if shutil.which("bash") is None:
        pytest.skip("bash not found (needed for native/tests/run_neon_qemu.sh)")
    try:
        r = subprocess.run(["bash", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        pytest.fail(f"{SCRIPT} timed out after 900 s; output so far:\n{out[-6000:]}")
    out = (r.stdout + r.stderr).strip()
    if r.returncode == 77:
        pytest.skip(f"neon under qemu: {out.splitlines()[-1] if out else 'tools missing'}")
    assert r.returncode == 0, f"{SCRIPT} exited {r.returncode}:\n{out[-12000:]}"
    last = out.splitlines()[-1]
    assert last.startswith("neon: ") and last.endswith(" 0 failed"), out[-12000:]
