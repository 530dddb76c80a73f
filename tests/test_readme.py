"""Every ```python block of README.md runs verbatim: each one alone, in a fresh interpreter, in an
empty temporary directory (a block that needs a file writes it itself, as the README shows).

A block that names a model that ships (`"qwen2.5-coder-1.5b"`, ...: a real model, whose output the
README shows in comments) runs with that name swapped for the path of a tiny random GGUF written
here: the suite never downloads a model, and the block's calls, arguments and return shapes are
still exercised."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = re.compile(r'"(qwen2\.5-coder-1\.5b|gemma3-270m|smollm2-135m)"')
TEMPLATE = ("{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _blocks():
    """the python blocks of README.md, then of docs/kernels.md (the kernel API the README points to)"""
    out = []
    for name in ("README.md", os.path.join("docs", "kernels.md")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            out += re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    return out


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 3


@pytest.mark.parametrize("i", range(len(_blocks())))
def test_readme_block_runs(i, tmp_path):
    code = _blocks()[i]
    if "cpufuse.llama" in code:
        pytest.importorskip("gguf", reason="the block writes a GGUF with the gguf package (cpufuse[llama])")
    if SHIPPED.search(code):
        from cpufuse.llama.tiny import write_tiny_gguf
        tiny = write_tiny_gguf(str(tmp_path / "tiny-model.gguf"), chat_template=TEMPLATE, n_ctx_train=4096)
        code = SHIPPED.sub(lambda _: repr(tiny), code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPUFUSE_")}
    env["CPUFUSE_NO_INSTALL"] = "1"          # a block never installs a model
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"README python block {i + 1} failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"


def _repo_texts():
    for top in ("cpufuse", "native", "tests", "bench", "docs"):
        for root, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".py", ".h", ".c", ".inc", ".md", ".sh")):
                    p = os.path.join(root, f)
                    with open(p, encoding="utf-8", errors="replace") as fh:
                        yield os.path.relpath(p, ROOT), fh.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        yield "README.md", fh.read()


def test_doc_references_resolve():
    """the docs stand alone: no reference points outside the repository, every docs/*.md named
    exists, and every `docs/semantics.md §N` names a section of it"""
    with open(os.path.join(ROOT, "docs", "semantics.md"), encoding="utf-8") as f:
        sections = set(re.findall(r"^## (\d+)\.", f.read(), re.M))
    bad = []
    for path, text in _repo_texts():
        if "shared" + "/spec" in text:
            bad.append(f"{path}: cites a spec outside the repository")
        for name in set(re.findall(r"docs/([\w-]+\.md)", text)):
            if not os.path.exists(os.path.join(ROOT, "docs", name)):
                bad.append(f"{path}: docs/{name} does not exist")
        for m in re.finditer(r"docs/semantics\.md ((?:§\d+(?:, )?)+)", text):
            bad += [f"{path}: docs/semantics.md §{n} is not a section"
                    for n in re.findall(r"§(\d+)", m.group(1)) if n not in sections]
    assert not bad, "\n".join(bad)


def test_every_environment_variable_is_documented():
    """docs/usage.md's "Environment variables" names every CPUFUSE_* variable that the package, its build
    and its kernels read (the tests' and the bench's own are not the user's)"""
    names = set()
    for top in ("cpufuse", "native", "setup.py"):
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        for p in files:
            if p.endswith((".py", ".inc", ".c", ".h")):
                with open(p, encoding="utf-8", errors="replace") as f:
                    names |= set(re.findall(r"\bCPUFUSE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", f.read()))
    with open(os.path.join(ROOT, "docs", "usage.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    missing = sorted(n for n in names if f"`{n}" not in section)
    assert len(names) > 20 and not missing, missing
