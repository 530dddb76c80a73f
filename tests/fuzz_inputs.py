"""Coverage-guided fuzzing (atheris, libFuzzer's engine) of the untrusted inputs: GGUF files
(`GGUFFile` and `Model.load`), the tokenizer (text, invalid UTF-8, token ids) and the chat-template
renderer (malicious templates, huge messages). `make fuzz-gguf` runs all three.

    python tests/fuzz_inputs.py gguf|tokenizer|template [libFuzzer flags: -runs=N -timeout=2 ...]
    python tests/fuzz_inputs.py gguf|tokenizer|template --mutate [-runs=N -timeout=S -max_total_time=S]

--mutate mutates the corpus and seeds without coverage feedback (make fuzz-asan, where libFuzzer
gets no coverage: mutate_loop).

The gguf and tokenizer targets accept only the documented refusals: ValueError (GGUF errors, bad
arguments; UnicodeError is one), TypeError and NotImplementedError (a type or architecture cpufuse
does not run), and the tokenizer's IndexError for a token id outside the vocabulary; anything else is a crash, which libFuzzer saves as crash-<sha1> and then stops. A
template may fail with any exception but MemoryError (the server answers those 400), within its
time limit (1 s here) and a memory bound. A run over `-timeout` seconds is a hang. The gguf target also
bounds memory: the peak RSS while one file loads (VmHWM, reset per input through
/proc/self/clear_refs) must stay under 4 x the file size + 128 MiB.

The corpus starts from tiny valid files (cpufuse/llama/tiny.py): every architecture, F16, Q8_0,
Q4_0, Q4_K and Q6_K weights, written into build/fuzz/<target>/seeds (made once); libFuzzer adds
what it finds to build/fuzz/<target>/corpus. A crash found here becomes a regression test in
tests/test_fuzz_regressions.py.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

MUTATE = "--mutate" in sys.argv   # no coverage: no atheris, no instrumentation (mutate_loop)
if MUTATE:
    import contextlib
    atheris = None
    instrumented = contextlib.nullcontext()
else:
    import atheris  # noqa: E402
    instrumented = atheris.instrument_imports(include=[
        "cpufuse.llama.gguf_file", "cpufuse.llama.hparams", "cpufuse.llama.loader", "cpufuse.llama.tokenizer",
        "cpufuse.llama.chat", "cpufuse.llama.model", "jinja2"])
with instrumented:
    import jinja2.sandbox  # noqa: E402,F401 -- imported here to be instrumented (the renderer imports it lazily)
    from cpufuse.llama import Model  # noqa: E402
    from cpufuse.llama.chat import TemplateError, render_chat  # noqa: E402
    from cpufuse.llama.gguf_file import GGUFFile  # noqa: E402
    from cpufuse.llama.tokenizer import Tokenizer  # noqa: E402
from cpufuse.llama.tiny import ARCHS, kquant_dims, model_dims, write_tiny_gguf  # noqa: E402

EXPECTED = (ValueError, TypeError, NotImplementedError, TemplateError)
TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")
MEM_SLACK = 128 << 20
SCRATCH = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"cpufuse-fuzz-{os.getpid()}.gguf")
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------ gguf
def gguf_seeds(d):
    for arch in ARCHS:
        for qt in TYPES:
            dims = kquant_dims() if qt in ("Q4_K", "Q6_K") else None
            if dims:                           # the architecture's own sizes, K-quant ready
                d0 = model_dims(arch, None)
                dims.update({k: 256 for k in ("n_ff_exp", "n_ff_shexp") if d0.get(k)})
                dims["n_layer"] = max(dims["n_layer"], d0["n_layer"])
            write_tiny_gguf(os.path.join(d, f"{arch}-{qt}.gguf"), qtype=qt, arch=arch, seed=1, dims=dims,
                            chat_template=TEMPLATE if qt == "F16" else None)


def gguf_one(data: bytes):
    with open(SCRATCH, "wb") as f:
        f.write(data)
    peak_ok = _reset_peak()
    base = _status_kib("VmRSS:")
    try:
        f = GGUFFile(SCRATCH)
        for k in list(f.kv):
            f.value_type(k)
        for t in f.tensors.values():
            t.data[:16].tobytes()
        del f
        m = Model.load(SCRATCH, n_ctx=16, n_batch=8, n_threads=1)
        m.logits([0, 1, 2])
        try:
            tok = m.tokenizer
        except RuntimeError as e:            # documented: a model whose tokenizer metadata is unusable
            if "no usable tokenizer" not in str(e):
                raise
        else:
            tok.detokenize(tok.tokenize("Hello, world! \u00e9\u4e2d", add_bos=False))
        del m
    except EXPECTED:
        pass
    if peak_ok:
        grew = (_status_kib("VmHWM:") - base) << 10
        if grew > 4 * len(data) + MEM_SLACK:
            raise MemoryError(f"loading a {len(data)}-byte file raised the peak RSS by {grew >> 20} MiB")


# ------------------------------------------------------------------------------------ tokenizer
_TOK = {}


def _tokenizer():
    if "t" not in _TOK:
        import tempfile
        p = write_tiny_gguf(os.path.join(tempfile.mkdtemp(prefix="cpufuse-fuzz-"), "tok.gguf"), chat_template=TEMPLATE)
        _TOK["t"] = Tokenizer.from_gguf(p)
    return _TOK["t"]


def tokenizer_seeds(d):
    """an input: 1 byte (the mode, mod 4: bytes, text with specials, text with lone surrogates,
    token ids), then the text or the ids (2 bytes each, less 100)"""
    for i, s in enumerate([b"Hello, world!", "\u00e9\u4e2d\U0001f600 <|im_start|>user\n".encode(), b"\xff\xfe\xc3(",
                           b"a" * 2000, b"   \t\n\n  ", "<|endoftext|><|im_end|>".encode(), bytes(range(256))]):
        for mode in range(4):
            with open(os.path.join(d, f"seed{i}-{mode}"), "wb") as f:
                f.write(bytes([mode]) + s)


def tokenizer_one(data: bytes):
    tok = _tokenizer()
    mode = data[0] % 4 if data else 0
    rest = data[1:]
    try:
        if mode == 0:                          # invalid UTF-8 as bytes
            ids = tok.tokenize(rest, add_bos=False, special=False)
        elif mode == 1:                        # text, specials parsed
            ids = tok.tokenize(rest.decode("utf-8", "replace"), add_bos=True, special=True)
        elif mode == 2:                        # lone surrogates and the like
            ids = tok.tokenize(rest.decode("utf-8", "surrogateescape"), add_bos=None, special=False)
        else:                                  # arbitrary ids, in range or not
            ids = [int.from_bytes(rest[i:i + 2], "little") - 100 for i in range(0, len(rest) - 1, 2)]
        tok.detokenize(ids, special=bool(mode & 1))
        for t in ids[:8]:
            tok.token_to_piece(t, special=True)
    except EXPECTED:
        pass
    except IndexError as e:                    # the tokenizer's refusal of an id outside the vocabulary
        if mode != 3 or "out of range" not in str(e):
            raise


# ------------------------------------------------------------------------------------ template
TEMPLATE_SEEDS = [
    TEMPLATE,
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{{ 'a' * 1000000000 }}",
    "{{ messages[0]['content'] * 100000 }}{{ raise_exception('no') }}",
    "{% set ns = namespace(x='') %}{% for m in messages %}{% set ns.x = ns.x ~ m.content ~ ns.x %}{% endfor %}{{ ns.x }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages|tojson(indent=1000000) }}{{ 'x'|center(1000000000) }}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ strftime_now('%Y-%m-%d') }}{% generation %}{{ bos_token }}{% endgeneration %}",
    "{{ (messages|map(attribute='content')|join('')|length) }}{{ range(10)|list }}{{ lipsum(1000) }}",
]


def template_seeds(d):
    """an input: 1 byte (the number of messages, mod 4), 3 bytes (each message's size, mod 2^20),
    then the template (UTF-8; invalid bytes become lone surrogates)"""
    for i, s in enumerate(TEMPLATE_SEEDS):
        for n, size in ((1, 16), (3, 1 << 16)):
            with open(os.path.join(d, f"seed{i}-{n}"), "wb") as f:
                f.write(bytes([n]) + size.to_bytes(3, "little") + s.encode())


def template_one(data: bytes):
    n = data[0] % 4 if data else 0
    size = int.from_bytes(data[1:4], "little") % (1 << 20)
    tpl = data[4:].decode("utf-8", "surrogateescape")
    msgs = [{"role": ("system", "user", "assistant", "tool")[i % 4], "content": ("x\u00e9{{" * (size // 4))[:size]}
            for i in range(n)]
    peak_ok = _reset_peak()
    base = _status_kib("VmRSS:")
    try:
        render_chat(tpl, msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>", time_limit=1.0)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 -- a template that fails on these messages: the server's 400
        pass
    if peak_ok:
        grew = (_status_kib("VmHWM:") - base) << 10
        if grew > 8 * (len(data) + n * size) + 2 * MEM_SLACK:
            raise MemoryError(f"rendering a {len(tpl)}-character template raised the peak RSS by {grew >> 20} MiB")


# ------------------------------------------------------------------------------------ --mutate
INTERESTING = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 63 - 1,
               2 ** 64 - 1, 0x7FC00000, 0x7F800000, 0xFF800000)


def mutate(rng, data: bytes) -> bytes:
    """1-6 random edits, placed within the first 64 B-64 KiB (headers, metadata, tensor infos)
    most of the time: bit flips, interesting bytes and 2/4/8-byte integers, deletions,
    insertions, copies, truncation"""
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        if not b:
            b += rng.randbytes(rng.randint(1, 64))
            continue
        n = len(b)
        i = rng.randrange(n if rng.random() < 0.25 else min(n, 1 << rng.randint(6, 16)))
        op = rng.randrange(8)
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
        elif op == 2:
            w = rng.choice((2, 4, 8))
            v = rng.choice(INTERESTING + (rng.getrandbits(8 * w),)) % (1 << 8 * w)
            b[i:i + w] = v.to_bytes(w, "little")[:len(b[i:i + w])]
        elif op == 3:
            del b[i:i + rng.randint(1, 256)]
        elif op == 4:
            b[i:i] = rng.randbytes(rng.randint(1, 64))
        elif op == 5:
            j = rng.randrange(n)
            b[i:i] = b[j:j + rng.randint(1, 256)]
        elif op == 6:
            del b[i:]
        else:
            w = rng.choice((4, 8))     # add or subtract a little from an integer
            v = (int.from_bytes(b[i:i + w].ljust(w, b"\0"), "little") + rng.randint(-16, 16)) % (1 << 8 * w)
            b[i:i + w] = v.to_bytes(w, "little")[:len(b[i:i + w])]
    return bytes(b)


def mutate_loop(name, one, base, dirs, flags):
    """--mutate: mutation without coverage feedback, for runs where libFuzzer gets none (make
    fuzz-asan: the preloaded libasan takes atheris's coverage callbacks, and libFuzzer would then
    drop every seed). Each input is a mutation of a file of `dirs` (the corpus fuzz-gguf grew and
    the seeds), written to <base>/current-input before it runs, so a sanitizer abort or a hang
    leaves it there. Flags: -runs=N, -timeout=S (a hang: the traceback, exit 1), -max_total_time=S,
    -seed=N. A crash is saved as <base>/crash-<sha1> and ends the run (exit 1)."""
    import faulthandler
    import hashlib
    import random
    import time
    opt = {k: float(v) for k, v in (a.lstrip("-").split("=", 1) for a in flags if "=" in a)}
    runs, timeout = int(opt.get("runs", 100000)), opt.get("timeout", 2.0)
    max_time, seed = opt.get("max_total_time", 0.0), int(opt.get("seed", time.time_ns() % (1 << 32)))
    files = sorted(os.path.join(d, f) for d in dirs for f in os.listdir(d))
    pool = []
    for f in files:
        with open(f, "rb") as fh:
            pool.append(fh.read())
    rng = random.Random(seed)
    current = os.path.join(base, "current-input")
    print(f"{name} --mutate: {len(pool)} files, seed {seed}, {runs} runs, timeout {timeout:g} s", flush=True)
    t0 = time.time()
    done = 0
    try:
        for done in range(1, runs + 1):
            data = mutate(rng, rng.choice(pool))
            with open(current, "wb") as fh:
                fh.write(data)
            faulthandler.dump_traceback_later(timeout, exit=True)
            try:
                one(data)
            except BaseException:
                crash = os.path.join(base, "crash-" + hashlib.sha1(data).hexdigest())
                with open(crash, "wb") as fh:
                    fh.write(data)
                print(f"crash after {done} runs; the input is {crash}", flush=True)
                raise
            finally:
                faulthandler.cancel_dump_traceback_later()
            if done % 1000 == 0:
                el = time.time() - t0
                print(f"#{done} {done / el:.1f} runs/s", flush=True)
            if max_time and time.time() - t0 > max_time:
                break
    finally:
        if os.path.exists(SCRATCH):
            os.unlink(SCRATCH)
    el = time.time() - t0
    print(f"Done {done} runs in {el:.0f} s ({done / max(el, 1e-9):.1f} runs/s): no crash, no hang", flush=True)
    return 0


TARGETS = {"gguf": (gguf_one, gguf_seeds), "tokenizer": (tokenizer_one, tokenizer_seeds),
           "template": (template_one, template_seeds)}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        print(__doc__)
        return 2
    name = sys.argv[1]
    one, seeds = TARGETS[name]
    base = os.path.join(os.environ.get("CPUFUSE_FUZZ_DIR") or os.path.join(ROOT, "build", "fuzz"), name)
    seed_dir, corpus = os.path.join(base, "seeds"), os.path.join(base, "corpus")
    os.makedirs(corpus, exist_ok=True)
    if not os.path.isdir(seed_dir):
        os.makedirs(seed_dir + ".tmp", exist_ok=True)
        seeds(seed_dir + ".tmp")
        os.rename(seed_dir + ".tmp", seed_dir)
    flags = [a for a in sys.argv[2:]]
    if "--mutate" in flags:
        return mutate_loop(name, one, base, [corpus, seed_dir], [a for a in flags if a != "--mutate"])
    if not any(a.startswith("-artifact_prefix=") for a in flags):
        flags.append(f"-artifact_prefix={base}/")
    try:
        atheris.Setup([sys.argv[0]] + flags + [corpus, seed_dir], one)
        atheris.Fuzz()
    finally:
        if os.path.exists(SCRATCH):
            os.unlink(SCRATCH)


if __name__ == "__main__":
    sys.exit(main())
