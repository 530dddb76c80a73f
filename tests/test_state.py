"""Saved state (cpufuse.llama.state): a restored sequence gives logits bit-identical to the
uninterrupted one (every cache layout: full, rings, f32 cells); the file is checked as untrusted
input; Llama.save_state / load_state with eval, sample and n_tokens."""
import json
import struct

import numpy as np
import pytest

pytest.importorskip("gguf")

from cpufuse.llama import Llama, Model  # noqa: E402
from cpufuse.llama.state import LlamaState, dump, restore  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402

A = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11, 200, 90, 31, 8, 9, 10]
B = [44, 45, 46, 47, 48, 49, 50]


@pytest.mark.parametrize("arch,kv", [("llama", "f16"), ("qwen3", "f32"), ("gemma3", "f16"), ("gemma2", "f32")])
def test_restored_sequence_is_bit_identical(tmp_path, arch, kv):
    p = write_tiny_gguf(tmp_path / f"{arch}.gguf", qtype="Q8_0", arch=arch)
    kw = dict(n_ctx=64, n_batch=8, kv_dtype=kv, n_threads=1)     # gemma: rings of window + 8 cells
    m = Model.load(p, **kw)
    m.eval(A)
    path = tmp_path / "s.cfkv"
    size = m.save_kv(path)
    assert size == path.stat().st_size
    whole = m.eval(B, logits_all=True)
    steps = [m.eval([t]) for t in (1, 2, 3)]
    m2 = Model.load(p, **kw)
    m2.eval([9, 9, 9])                       # something else in its cache first
    assert m2.load_kv(path) == len(A) and m2.n_past == len(A)
    assert np.array_equal(m2.eval(B, logits_all=True), whole)
    assert all(np.array_equal(m2.eval([t]), s) for t, s in zip((1, 2, 3), steps))
    # generate continues from the restored cache (prefix reuse)
    m3 = Model.load(p, **kw)
    m3.load_kv(path)
    r = m3.generate(A + B, max_tokens=6, temperature=0)
    assert r.prompt_eval_tokens == len(B) or m3.kv.ring_cells
    assert r.tokens == Model.load(p, **kw).generate(A + B, max_tokens=6, temperature=0).tokens


def test_bad_state_files(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    m = Model.load(p, n_ctx=64)
    m.eval(A)
    good = dump(m)
    hlen = struct.unpack_from("<Q", good, 8)[0]
    head = json.loads(good[16:16 + hlen])

    def with_head(**kw):
        hb = json.dumps(dict(head, **kw)).encode()
        return good[:8] + struct.pack("<Q", len(hb)) + hb + good[16 + hlen:]

    cases = [(good[:10], "truncated: the header needs 16"), (b"XXXX" + good[4:], "not a cpufuse KV state"),
             (good[:4] + struct.pack("<I", 9) + good[8:], "version 9"),
             (good[:8] + struct.pack("<Q", 1 << 40) + good[16:], "a header of"),
             (good[:-1], "truncated or too long"), (good + b"x", "truncated or too long"),
             (with_head(n_tokens=65), "n_tokens = 65"), (with_head(n_tokens=3), "kv_bytes"),
             (with_head(identity="0" * 64), "another model"), (with_head(type_k="f32"), "type_k"),
             (with_head(extra=1), "expected the keys"), (with_head(n_layer="2"), "n_layer must be of type int"),
             (good[:16] + b"\xff" + good[17:], "not UTF-8 JSON")]
    toks = bytearray(good)
    struct.pack_into("<i", toks, 16 + hlen, 10 ** 6)
    cases.append((bytes(toks), "token id 1000000 out of range"))
    for data, msg in cases:
        with pytest.raises(ValueError, match=msg):
            restore(m, data)
    # another model of the same shape (other weights), other cell types, another n_ctx
    other = Model.load(write_tiny_gguf(tmp_path / "o.gguf", qtype="Q8_0", seed=5), n_ctx=64)
    with pytest.raises(ValueError, match="another model"):
        restore(other, good)
    with pytest.raises(ValueError, match="type_k"):
        restore(Model.load(p, n_ctx=64, kv_dtype="f32"), good)
    with pytest.raises(ValueError, match="n_tokens = 17, expected 0..n_ctx = 16"):
        restore(Model.load(p, n_ctx=16), good)
    with pytest.raises(FileNotFoundError):
        m.load_kv(tmp_path / "none.cfkv")
    with pytest.raises(ValueError, match="not a regular file"):
        m.load_kv(tmp_path)
    assert m.n_past == len(A)           # a refused state changes nothing
    restore(m, good)
    assert m.n_past == len(A)


def test_llama_save_state_eval_sample(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    llm = Llama(p, n_ctx=64, verbose=False, seed=3)
    llm.eval(A)
    assert llm.n_tokens == len(A) and list(llm.input_ids) == A
    st = llm.save_state()
    assert isinstance(st, LlamaState) and st.n_tokens == len(A) and st.llama_state_size == len(st.llama_state)
    assert st.scores.shape == (1, llm.n_vocab())

    def run():
        out = []
        for _ in range(8):
            t = llm.sample(temp=0.9, top_k=0, top_p=1.0, min_p=0.0)
            out.append(t)
            llm.eval([t])
        return out
    first = run()
    llm.reset()
    llm.eval([1, 2, 3])
    llm.load_state(st)
    assert llm.n_tokens == len(A) and list(llm.input_ids) == A
    assert run() == first                        # the same logits and the same seed
    greedy = llm.sample(temp=0)
    assert greedy == int(np.argmax(llm.model.logits(A + first)[-1]))
    with pytest.raises(TypeError, match="LlamaState"):
        llm.load_state(b"x")
    with pytest.raises(NotImplementedError, match="grammar"):
        llm.sample(grammar="root ::= x")
    with pytest.raises(NotImplementedError, match="mirostat"):
        llm.sample(mirostat_mode=2)
    bad = LlamaState(np.array([1, 2]), st.scores, 2, st.llama_state, st.llama_state_size, 3)
    with pytest.raises(ValueError, match="input_ids"):
        llm.load_state(bad)


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_resume(tmp_path, monkeypatch, capsys):
    import io
    import json as _json

    from cpufuse.llama import cli
    p = write_tiny_gguf(tmp_path / "chat.gguf", qtype="Q8_0", chat_template=TEMPLATE)
    f = str(tmp_path / "conv")
    args = [p, "--temp", "0", "-n", "8", "--ctx", "256", "-t", "1"]

    def chat(lines, extra):
        monkeypatch.setattr("sys.stdin", io.StringIO(lines))
        assert cli.chat_main(args + extra) == 0
        return capsys.readouterr()
    whole = chat("hello\nhow are you\n", []).out
    first = chat("hello\n", ["--resume", f])
    msgs = _json.load(open(f + ".json"))
    assert len(msgs) == 2 and first.out == msgs[1]["content"] + "\n"
    second = chat("how are you\n", ["--resume", f])
    assert "(resumed 2 messages" in second.err and first.out + second.out == whole
    open(f + ".json", "w").write('{"not": "a list"}')
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli.chat_main(args + ["--resume", f]) == 2
    assert "expected a list" in capsys.readouterr().err
