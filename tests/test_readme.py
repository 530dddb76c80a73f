"""Every ```python block of README.md runs verbatim: each one alone, in a fresh interpreter, in an
empty temporary directory (a block that needs a file writes it itself, as the README shows)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 3


@pytest.mark.parametrize("i", range(len(_blocks())))
def test_readme_block_runs(i, tmp_path):
    code = _blocks()[i]
    if "cpufuse.llama" in code:
        pytest.importorskip("gguf", reason="the block writes a GGUF with the gguf package (cpufuse[llama])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUFUSE_")}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"README python block {i + 1} failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"
