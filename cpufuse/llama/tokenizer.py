"""GGUF tokenizer with llama.cpp semantics (docs/semantics.md §10).

Supported: byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) whose pre-tokenizer
(``tokenizer.ggml.pre``) is one of the families in ``PRE_FAMILIES``: ``smollm``, ``llama-bpe``
(llama3 and aliases), ``qwen2`` (and aliases), ``gpt-2`` (and aliases), ``default`` (also a
missing ``pre``); and SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) through a
pure-Python port of llama.cpp's score-heap SPM session (space prefix, ``▁`` escaping,
``<0xXX>`` byte fallback). Other models / pre-tokenizers raise ``NotImplementedError``.

How it is built (docs/semantics.md §10):

* The special-token partition is done here in Python, exactly as llama.cpp's
  ``tokenizer_st_partition``: every CONTROL / USER_DEFINED / UNKNOWN token, longest text first
  (ties: lower id first), is split out of every remaining raw fragment, left to right. With
  ``special=False`` CONTROL and UNKNOWN tokens are skipped, USER_DEFINED are still split out.
* Each remaining raw fragment is encoded by a Hugging Face ``tokenizers`` BPE model built from the
  GGUF ``tokens`` / ``merges`` arrays, with the pre-tokenizer pipeline of the file's ``pre``
  (regex split, then the GPT-2 byte-to-unicode map). No added tokens are registered with HF, so
  the HF added-token matcher never runs (so its differences from llama.cpp's matcher do not arise).
* BOS/EOS are added by this class from the GGUF flags (llama.cpp's defaults, overridden by
  ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``).

Detokenization follows ``llama_token_to_piece``: NORMAL tokens are mapped back through the
inverse byte map, USER_DEFINED tokens are copied raw, BYTE tokens (``<0xXX>``) give their byte,
CONTROL / UNKNOWN tokens give ``b""`` unless ``special=True`` (then their text), and UNUSED /
undefined tokens give ``b""``. ``detokenize`` concatenates the pieces (this is what
llama-cpp-python's ``Llama.detokenize`` does, minus its "drop one leading space after BOS" quirk)
and decodes them as UTF-8 with ``errors="replace"``; ``clean_spaces=True`` additionally applies
llama.cpp's ``llama_detokenize`` space clean-up passes (the flag ``self.clean_spaces`` says
whether llama.cpp's C API would apply them for this vocab).
"""
from __future__ import annotations

import codecs
import numbers
import os
import warnings
from typing import Any, Iterable, Iterator, Mapping, Optional, Union

__all__ = [
    "Tokenizer",
    "StreamDecoder",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
    "PRE_FAMILIES",
    "bytes_to_unicode",
]

# GGUF tokenizer.ggml.token_type values
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# llama.cpp token attribute bits (llama_token_attr)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_NORMALIZED = 1 << 6
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
    TOKEN_TYPE_UNDEFINED: ATTR_UNDEFINED,
}

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes (docs/semantics.md §10)
# ---------------------------------------------------------------------------------------------
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# pre value -> (family, flags) as in llama.cpp's llama_vocab::impl::load (BPE branch).
# Flags: add_bos, add_eos, ignore_merges, clean_spaces. GGUF add_bos/add_eos keys override.
_FAMILY_FLAGS = {
    "llama-bpe": dict(add_bos=True, add_eos=False, ignore_merges=True, clean_spaces=True),
    "qwen2": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=False),
    "smollm": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=False),
    "gpt-2": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=True),
    "default": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=True),
}
PRE_FAMILIES = {
    # llama3 regex, ignore_merges, add_bos
    "llama-bpe": "llama-bpe", "llama3": "llama-bpe", "llama-v3": "llama-bpe",
    "falcon3": "llama-bpe", "falcon-h1": "llama-bpe", "pixtral": "llama-bpe",
    "midm-2.0": "llama-bpe", "lfm2": "llama-bpe",
    # qwen2 regex
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "kormo": "qwen2", "f2llmv2": "qwen2",
    # smollm: digits isolated, then GPT-2 regex
    "smollm": "smollm",
    # GPT-2 regex only
    "gpt-2": "gpt-2", "phi-2": "gpt-2", "gigachat": "gpt-2", "a.x-4.0": "gpt-2",
    "mellum": "gpt-2", "exaone4": "gpt-2",
    # default (also used when `pre` is missing)
    "default": "default",
}
# `megrez` uses the qwen2 regex but keeps clean_spaces = true in llama.cpp.
PRE_FAMILIES["megrez"] = "qwen2"
_PRE_FLAG_OVERRIDES = {"megrez": dict(clean_spaces=True)}

# Token texts llama.cpp uses to auto-detect special ids (llama-vocab.cpp load(), as vendored by
# llama-cpp-python 0.3.36).
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_RENDER = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss hack


def _strtol_hex(s: str) -> int:
    """C ``strtol(s, NULL, 16)`` truncated to a byte: leading hex digits, 0 if none."""
    v = 0
    for ch in s:
        d = int(ch, 16) if ch in "0123456789abcdefABCDEF" else None
        if d is None:
            break
        v = v * 16 + d
    return v & 0xFF


_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # llama.cpp unicode_len_utf8
_C_ISSPACE = " \t\n\v\f\r"


def bytes_to_unicode() -> dict:
    """GPT-2 byte -> unicode character map (docs/semantics.md §10)."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_ENCODER = bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


# _BYTE_DECODER as a str.translate table onto latin-1 characters; the latin-1 code points that are
# not byte-mapped characters go to U+FFFF, so that any text with an unmapped character fails the
# latin-1 encode and takes the character-by-character path (with llama.cpp's marker)
_BPE_TABLE = {ord(c): chr(b) for c, b in _BYTE_DECODER.items()}
_BPE_TABLE.update({cp: "\uffff" for cp in range(256) if chr(cp) not in _BYTE_DECODER})


def _decode_bpe_text(text: str) -> bytes:
    """llama.cpp ``llama_decode_text``: token text (byte-mapped) -> raw bytes."""
    try:
        return text.translate(_BPE_TABLE).encode("latin-1")
    except UnicodeEncodeError:
        return _decode_bpe_text_slow(text)


def _decode_bpe_text_slow(text: str) -> bytes:
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is not None:
            out.append(b)
        else:  # llama.cpp emits this marker (with the whole token text) for unmapped code points
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Metadata access
# ---------------------------------------------------------------------------------------------
_PREFIX = "tokenizer.ggml."


def _wanted_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key in ("general.name", "general.architecture")


def _metadata_from_kv(kv: Mapping[str, Any]) -> dict:
    """the tokenizer's keys of a parsed GGUF (cpufuse.llama.gguf_file.GGUFFile.kv)"""
    return {k: v for k, v in kv.items() if _wanted_key(k)}


def _metadata_from_reader(reader) -> dict:
    """the tokenizer's keys of a gguf-py ``GGUFReader`` (its ``fields``)"""
    out = {}
    for key, field in reader.fields.items():
        if _wanted_key(key):
            try:
                out[key] = field.contents()
            except Exception:  # pragma: no cover - malformed field
                continue
    return out


def _normalize_metadata(meta: Mapping[str, Any]) -> dict:
    """Accept full GGUF keys or short names ("tokens", "chat_template", ...)."""
    out = {}
    for k, v in meta.items():
        if k.startswith("tokenizer.") or k.startswith("general."):
            out[k] = v
        elif k == "chat_template":
            out["tokenizer.chat_template"] = v
        else:
            out[_PREFIX + k] = v
    return out


def _to_list(v) -> list:
    if v is None:
        return None
    if hasattr(v, "tolist"):
        return v.tolist()
    return list(v)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
class Tokenizer:
    """llama.cpp-compatible tokenizer built from GGUF tokenizer metadata.

    ``source`` is a path to a ``.gguf`` file (read with ``cpufuse.llama.gguf_file.GGUFFile``), a
    ``GGUFFile``, a gguf-py ``GGUFReader``, or a mapping of the ``tokenizer.ggml.*`` /
    ``tokenizer.chat_template`` fields (full key names, or the short names after
    ``tokenizer.ggml.``). Malformed metadata (a token list that is not strings, a special token
    id outside ``[0, n_vocab)``, ...) raises ValueError naming the key.
    """

    def __init__(self, source: Union[str, os.PathLike, Mapping[str, Any], Any]):
        from .gguf_file import GGUFFile

        if isinstance(source, (str, os.PathLike)):
            meta = _metadata_from_kv(GGUFFile(source).kv)
        elif isinstance(source, GGUFFile):
            meta = _metadata_from_kv(source.kv)
        elif hasattr(source, "fields") and not isinstance(source, Mapping):
            meta = _metadata_from_reader(source)
        else:
            meta = _normalize_metadata(source)
        self._load(meta)

    @classmethod
    def from_gguf(cls, path_or_reader) -> "Tokenizer":
        return cls(path_or_reader)

    # -- loading -----------------------------------------------------------------------------
    def _load(self, meta: dict) -> None:
        g = lambda k, d=None: meta.get(_PREFIX + k, d)  # noqa: E731

        self.model = g("model")
        if self.model is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.model")
        if self.model not in ("gpt2", "llama"):
            raise NotImplementedError(
                f"tokenizer.ggml.model = {self.model!r} is not supported; only byte-level BPE "
                "('gpt2') and SentencePiece BPE ('llama') are")
        self.is_spm = self.model == "llama"
        if self.is_spm:
            self._load_common(meta, g, dict(add_bos=True, add_eos=False, ignore_merges=False,
                                            clean_spaces=False, add_space_prefix=True),
                              default_ids=dict(bos=1, eos=2, unk=0))
            self.pre, self.pre_family = g("pre") or "default", "spm"
            scores = _to_list(g("scores"))
            if scores is None:
                scores = [0.0] * self.n_vocab
            elif len(scores) < self.n_vocab:
                raise ValueError(f"scores has {len(scores)} entries < {self.n_vocab} tokens")
            self._spm_scores = [float(x) for x in scores[:self.n_vocab]]
            self._spm_vocab = {t.encode("utf-8"): i for i, t in enumerate(self.tokens)}
            self._hf = None
            return

        pre = g("pre")
        self.pre = pre if pre else "default"
        if not pre:
            warnings.warn("GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer "
                          "(llama.cpp warns that generation quality will be degraded)")
        family = PRE_FAMILIES.get(self.pre)
        if family is None:
            raise NotImplementedError(
                f"pre-tokenizer tokenizer.ggml.pre = {self.pre!r} is not supported; supported: "
                f"{sorted(PRE_FAMILIES)} (llama.cpp itself would fall back to 'default' with a "
                "warning, which generally tokenizes differently from the original model)")
        self.pre_family = family
        flags = dict(_FAMILY_FLAGS[family], add_space_prefix=False)
        flags.update(_PRE_FLAG_OVERRIDES.get(self.pre, {}))
        self._load_common(meta, g, flags, default_ids=dict(bos=11, eos=11, unk=None))
        merges = _to_list(g("merges"))
        if merges is None:
            raise ValueError("byte-level BPE GGUF has no tokenizer.ggml.merges")
        if not all(type(m) is str for m in merges):
            bad = next(m for m in merges if type(m) is not str)
            raise ValueError(f"tokenizer.ggml.merges must be an array of strings, found an element of type "
                             f"{type(bad).__name__}: {bad!r}")
        self._hf = self._build_hf(self.tokens, merges)

    def _load_common(self, meta: dict, g, flags: dict, default_ids: dict) -> None:
        self.ignore_merges = flags["ignore_merges"]
        self.clean_spaces = flags["clean_spaces"]
        self.add_space_prefix = flags["add_space_prefix"]
        if g("add_space_prefix") is not None:
            self.add_space_prefix = bool(g("add_space_prefix"))

        tokens = _to_list(g("tokens"))
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        if not all(type(t) is str for t in tokens):
            bad = next(t for t in tokens if type(t) is not str)
            raise ValueError(f"tokenizer.ggml.tokens must be an array of strings, found an element of type "
                             f"{type(bad).__name__}: {bad!r}")
        n = len(tokens)
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.tokens: list = tokens
        self.n_vocab = n
        types = _to_list(g("token_type"))
        if types is None:
            types = [TOKEN_TYPE_NORMAL] * n
        elif len(types) < n:
            raise ValueError(f"token_type has {len(types)} entries < {n} tokens")
        self.token_types = [int(t) for t in types[:n]]
        attrs = [_TYPE_TO_ATTR.get(t, ATTR_UNDEFINED) for t in self.token_types]
        self.token_to_id = {t: i for i, t in enumerate(tokens)}
        if len(self.token_to_id) != n:
            raise ValueError("duplicate token texts in tokenizer.ggml.tokens")

        # special ids: BPE defaults bos = eos = 11, SPM bos 1 / eos 2 / unk 0 (llama.cpp)
        ids = dict(eot=None, eom=None, sep=None, pad=None, mask=None,
                   fim_pre=None, fim_suf=None, fim_mid=None, fim_pad=None, fim_rep=None,
                   fim_sep=None, **default_ids)
        keymap = dict(bos="bos_token_id", eos="eos_token_id", eot="eot_token_id",
                      eom="eom_token_id", unk="unknown_token_id", sep="seperator_token_id",
                      pad="padding_token_id", mask="mask_token_id",
                      fim_pre="fim_pre_token_id", fim_suf="fim_suf_token_id",
                      fim_mid="fim_mid_token_id", fim_pad="fim_pad_token_id",
                      fim_rep="fim_rep_token_id", fim_sep="fim_sep_token_id")
        deprecated = dict(fim_pre="prefix_token_id", fim_suf="suffix_token_id",
                          fim_mid="middle_token_id")
        for name, key in list(keymap.items()) + list(deprecated.items()):
            v = g(key)
            if v is None:
                continue
            ids[name] = special_token_id(_PREFIX + key, v, n)
        for name, v in ids.items():   # a default id (BPE: 11) that a small vocab does not have: none
            if v is not None and v >= n:
                ids[name] = None

        add_bos, add_eos = flags["add_bos"], flags["add_eos"]
        if g("add_bos_token") is not None:
            add_bos = bool(g("add_bos_token"))
        if g("add_eos_token") is not None:
            add_eos = bool(g("add_eos_token"))
        self.add_bos = add_bos
        self.add_eos = add_eos

        # auto-detect special tokens by text (ascending id order; llama.cpp iterates an
        # unordered_map, so which of several candidates becomes eot_id is unspecified there)
        detect = [("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS)] + list(_FIM_TEXTS.items())
        tid = self.token_to_id
        for name, texts in detect:      # the lowest id among the texts (the texts are unique tokens)
            found = [tid[t] for t in texts if t in tid]
            if ids[name] is None and found:
                ids[name] = min(found)
                attrs[ids[name]] |= ATTR_CONTROL
        # "unused" control tokens
        for i, t in enumerate(tokens):
            if attrs[i] & ATTR_CONTROL and "unused" in t:
                attrs[i] |= ATTR_UNUSED

        eog = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if ids[name] is not None:
                eog.add(ids[name])
        for t in _EOG_TEXTS:
            i = tid.get(t)
            if i is not None:
                eog.add(i)
                attrs[i] |= ATTR_CONTROL
        for t in _ALWAYS_RENDER:
            i = self.token_to_id.get(t)
            if i is not None:
                attrs[i] = ATTR_USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if ids[name] is not None:
                eog.add(ids[name])
        texts_in_eog = {tokens[i]: i for i in eog}
        if ("<|end|>" in texts_in_eog and (
                ("<|return|>" in texts_in_eog and ("<|call|>" in texts_in_eog
                                                   or "<|calls|>" in texts_in_eog))
                or ("<|flush|>" in texts_in_eog and ("<|call|>" in texts_in_eog
                                                     or "<|calls|>" in texts_in_eog)))):
            end_id = texts_in_eog["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = ATTR_USER_DEFINED
        if "<|tool_response>" in texts_in_eog and "</s>" in texts_in_eog:
            s_id = texts_in_eog["</s>"]
            eog.discard(s_id)
            attrs[s_id] = ATTR_NORMAL

        # lstrip/rstrip attributes are set by model name only; of those, phi-3 is llama-family
        model_name = str(meta.get("general.name") or "").lower()
        if "phi-3" in model_name or "phi3" in model_name:
            for i in range(n):
                if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                    attrs[i] |= ATTR_RSTRIP
            for t, v in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                i = self.token_to_id.get(t)
                if i is not None:
                    attrs[i] = (attrs[i] | ATTR_RSTRIP) if v else (attrs[i] & ~ATTR_RSTRIP)

        self.token_attrs = attrs
        self.bos_id: Optional[int] = ids["bos"]
        self.eos_id: Optional[int] = ids["eos"]
        self.eot_id: Optional[int] = ids["eot"]
        self.eom_id: Optional[int] = ids["eom"]
        self.unk_id: Optional[int] = ids["unk"]
        self.pad_id: Optional[int] = ids["pad"]
        self.sep_id: Optional[int] = ids["sep"]
        self.special_ids = ids
        self.eog_ids = frozenset(eog)
        self.chat_template: Optional[str] = meta.get("tokenizer.chat_template") or None
        if self.chat_template is None and "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
            from .chat import GEMMA_TEMPLATE   # a Gemma file without a template (llama.cpp's fallback too)
            self.chat_template = GEMMA_TEMPLATE

        # special-token cache: CONTROL | USER_DEFINED | UNKNOWN, longest (UTF-8 bytes) first
        cache = [i for i in range(n) if attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)]
        cache.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._special_cache = [(tokens[i], i, bool(attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)),
                                bool(attrs[i] & ATTR_LSTRIP), bool(attrs[i] & ATTR_RSTRIP))
                               for i in cache]

        # token -> piece cache (special = true), as llama.cpp's cache_token_to_piece
        pieces = []
        for i, t in enumerate(tokens):
            a = attrs[i]
            if a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
                pieces.append(t.encode("utf-8"))
            elif a & ATTR_NORMAL:
                pieces.append(t.replace("\u2581", " ").encode("utf-8") if self.is_spm
                              else _decode_bpe_text(t))
            elif a & ATTR_BYTE:
                pieces.append(bytes([_strtol_hex(t[3:5])]))
            else:
                pieces.append(b"")
        self._pieces = pieces
        self.max_piece_bytes = max(map(len, pieces))   # the most bytes one token stands for
        self._hidden = [bool(a & (ATTR_UNKNOWN | ATTR_CONTROL)) for a in attrs]

    def _build_hf(self, tokens: list, merges: list):
        try:
            from tokenizers import Regex
            from tokenizers import Tokenizer as HFTokenizer
            from tokenizers import models, pre_tokenizers
        except ImportError as e:  # pragma: no cover
            raise ImportError("cpufuse.llama.tokenizer needs the 'tokenizers' package "
                              "(pip install tokenizers)") from e

        vocab = self.token_to_id
        pairs = []
        dropped = 0
        for m in merges:
            j = m.find(" ", 1)
            if j < 0:
                dropped += 1
                continue
            a, b = m[:j], m[j + 1:]
            if a in vocab and b in vocab and (a + b) in vocab:
                pairs.append((a, b))
            else:
                dropped += 1
        if dropped:
            warnings.warn(f"{dropped} BPE merges skipped (malformed, or a part/result is not in "
                          "the vocab)")
        bpe = models.BPE(vocab=dict(vocab), merges=pairs, ignore_merges=self.ignore_merges,
                         byte_fallback=False)
        hf = HFTokenizer(bpe)

        def split(rx):
            return pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)

        byte_level_noregex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        fam = self.pre_family
        if fam == "smollm":
            pre = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ])
        elif fam == "llama-bpe":
            pre = pre_tokenizers.Sequence([split(LLAMA3_REGEX), byte_level_noregex])
        elif fam == "qwen2":
            pre = pre_tokenizers.Sequence([split(QWEN2_REGEX), byte_level_noregex])
        elif fam == "gpt-2":
            pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif fam == "default":
            pre = pre_tokenizers.Sequence([split(r) for r in DEFAULT_REGEXES] + [byte_level_noregex])
        else:  # pragma: no cover
            raise NotImplementedError(fam)
        hf.pre_tokenizer = pre
        return hf

    # -- tokenize ----------------------------------------------------------------------------
    def _partition(self, text: str, special: bool) -> list:
        """llama.cpp tokenizer_st_partition: list of str (raw fragment) or int (token id)."""
        frags: list = [text]
        for tok_text, tid, is_ctrl_or_unk, lstrip, rstrip in self._special_cache:
            if is_ctrl_or_unk and not special:
                continue
            if tok_text not in text:
                continue
            out = []
            for f in frags:
                if isinstance(f, int) or tok_text not in f:
                    out.append(f)
                    continue
                start = 0
                L = len(tok_text)
                while True:
                    k = f.find(tok_text, start)
                    if k < 0:
                        if start < len(f):
                            out.append(f[start:])
                        break
                    if k > start:
                        left = f[start:k]
                        if lstrip:
                            left = left.rstrip(_C_ISSPACE)
                        if left:
                            out.append(left)
                    out.append(tid)
                    start = k + L
                    if rstrip:
                        while start < len(f) and f[start] in _C_ISSPACE:
                            start += 1
            frags = out
        return frags

    def tokenize(self, text: Union[str, bytes], add_bos: Optional[bool] = None,
                 special: bool = False, add_eos: Optional[bool] = None) -> list:
        """Token ids of ``text``, as llama.cpp ``llama_tokenize``.

        ``add_bos``: None = the file's default (``self.add_bos``), True/False force it.
        ``add_eos``: None = the file's default (``self.add_eos``) *when BOS handling is the file
        default*; with an explicit ``add_bos`` it defaults to False unless ``add_bos`` is None.
        (llama.cpp's ``add_special=True`` equals ``add_bos=None, add_eos=None``; its
        ``add_special=False`` equals ``add_bos=False``.)
        ``special``: parse CONTROL/UNKNOWN token texts as special tokens (llama.cpp
        ``parse_special``). USER_DEFINED tokens are always split out.
        """
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        else:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates: join pairs, the rest -> U+FFFD
                text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if add_eos is None:
            add_eos = self.add_eos if add_bos is None else False
        if add_bos is None:
            add_bos = self.add_bos
        out: list = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos requested but the vocab has no BOS token")
            out.append(self.bos_id)
        if text and self.is_spm:
            prev_special = True  # prefix the first fragment with a space too
            for f in self._partition(text, special):
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                else:
                    if self.add_space_prefix and prev_special:
                        f = " " + f
                    self._spm_tokenize(f.replace(" ", "\u2581").encode("utf-8"), out)
                    prev_special = False
        elif text:
            frags = self._partition(text, special)
            raw = [f for f in frags if isinstance(f, str)]
            if raw:
                encs = self._hf.encode_batch(raw, add_special_tokens=False)
                it = iter(encs)
                for f in frags:
                    if isinstance(f, int):
                        out.append(f)
                    else:
                        out.extend(next(it).ids)
            else:
                out.extend(frags)
        if add_eos:
            if self.eos_id is None:
                raise ValueError("add_eos requested but the vocab has no EOS token")
            out.append(self.eos_id)
        return out

    encode = tokenize

    def _spm_byte_token(self, b: int) -> int:
        tid = self.token_to_id.get("<0x%02X>" % b)
        if tid is None and b < 0x80:
            tid = self.token_to_id.get(chr(b))
        if tid is None:
            raise ValueError(f"SPM vocab has no byte token for 0x{b:02X}")
        return tid

    def _spm_tokenize(self, data: bytes, out: list) -> None:
        """llama.cpp llm_tokenizer_spm_session::tokenize (score-heap BPE, byte fallback)."""
        import heapq

        vocab, scores = self._spm_vocab, self._spm_scores
        start, size = [], []
        offs, L = 0, len(data)
        while offs < L:
            k = min(_UTF8_LEN[data[offs] >> 4], L - offs)
            start.append(offs)
            size.append(k)
            offs += k
        N = len(start)
        if N == 0:
            return
        prev = list(range(-1, N - 1))
        nxt = list(range(1, N + 1))
        nxt[-1] = -1
        heap: list = []
        rev: dict = {}

        def try_add(left, right):
            if left == -1 or right == -1:
                return
            txt = data[start[left]:start[left] + size[left] + size[right]]
            tid = vocab.get(txt)
            if tid is None:
                return
            heapq.heappush(heap, (-scores[tid], left, right, len(txt)))
            rev[txt] = (left, right)

        for i in range(1, N):
            try_add(i - 1, i)
        while heap:
            _, left, right, sz = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != sz:
                continue
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])

        def resegment(i, depth=0):
            txt = data[start[i]:start[i] + size[i]]
            tid = vocab.get(txt)
            if tid is not None:
                out.append(tid)
                return
            p = rev.get(txt)
            if p is None or depth > 64:
                out.extend(self._spm_byte_token(b) for b in txt)
                return
            resegment(p[0], depth + 1)
            resegment(p[1], depth + 1)

        i = 0
        while i != -1:
            resegment(i)
            i = nxt[i]

    # -- detokenize --------------------------------------------------------------------------
    def token_to_piece(self, token_id: int, special: bool = False) -> bytes:
        """llama.cpp ``llama_token_to_piece(vocab, id, buf, n, lstrip=0, special)``."""
        if not 0 <= token_id < self.n_vocab:
            raise IndexError(f"token id {token_id} out of range [0, {self.n_vocab})")
        if not special and self._hidden[token_id]:
            return b""
        return self._pieces[token_id]

    def detokenize_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        return b"".join(self.token_to_piece(int(i), special) for i in ids)

    def detokenize(self, ids: Iterable[int], special: bool = False,
                   clean_spaces: bool = False,
                   remove_leading_space: Optional[bool] = None) -> str:
        """Concatenated pieces decoded as UTF-8 (``errors="replace"``).

        ``special=False`` (the default, as llama-cpp-python): CONTROL/UNKNOWN tokens (BOS, EOS,
        ``<|im_end|>`` ...) render as nothing; ``special=True`` renders their text.
        ``clean_spaces=True`` applies llama.cpp ``llama_detokenize``'s clean-up passes.
        ``remove_leading_space`` (None = ``self.add_space_prefix``, i.e. True for SentencePiece
        vocabs): the first non-empty piece loses one leading space, so that
        ``detokenize(tokenize(s)) == s`` for SPM. (llama.cpp strips it from the first token
        only, even when that is an empty BOS; llama-cpp-python strips it after a BOS.)
        """
        if remove_leading_space is None:
            remove_leading_space = self.add_space_prefix
        pieces = [self.token_to_piece(int(i), special) for i in ids]
        if remove_leading_space:
            for k, pc in enumerate(pieces):
                if pc:
                    if pc[:1] == b" ":
                        pieces[k] = pc[1:]
                    break
        data = b"".join(pieces)
        if clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", errors="replace")

    decode = detokenize

    # -- misc --------------------------------------------------------------------------------
    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_text(self, token_id: int) -> str:
        return self.tokens[token_id]

    @property
    def bos_text(self) -> str:
        return self.tokens[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_text(self) -> str:
        return self.tokens[self.eos_id] if self.eos_id is not None else ""

    def __len__(self) -> int:
        return self.n_vocab

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos_id}, eos={self.eos_id}, eog={sorted(self.eog_ids)}, "
                f"add_bos={self.add_bos}, add_eos={self.add_eos})")


def special_token_id(key: str, v: Any, n_vocab: int) -> int:
    """A special token id from the GGUF key ``key``: an integer in [0, n_vocab), else ValueError
    (llama.cpp warns and falls back to a default; an id such as -1 would be emitted as a token)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{key} = {v!r}: a special token id must be an integer, found {type(v).__name__}")
    v = int(v)
    if not 0 <= v < n_vocab:
        raise ValueError(f"{key} = {v}: a special token id must be in [0, n_vocab) = [0, {n_vocab}) "
                         "or absent")
    return v


def _clean_spaces(text: bytes) -> bytes:
    """The three clean-up passes of llama.cpp ``llama_detokenize`` (clean_spaces)."""
    t = bytearray(text)
    # pass 1: remove space before ? ! . ,
    if t:
        o = bytearray(t[:1])
        for i in range(1, len(t)):
            x = t[i]
            if t[i - 1] == 0x20 and x in b"?!.,":
                o.pop()
            o.append(x)
        t = o
    # pass 2: " ' " -> "'"
    if t:
        o = bytearray(t[:1])
        i = 1
        n = len(t)
        while i < n:
            x = t[i]
            if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
                o.pop()
                o.append(x)
                i += 2  # skip the next space
                continue
            o.append(x)
            i += 1
        t = o
    # pass 3: remove space before 's 'm 're 've
    if t:
        o = bytearray(t[:1])
        n = len(t)
        for i in range(1, n):
            x = t[i]
            if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
                x1 = t[i + 1]
                if x1 in b"sm":
                    o.pop()
                elif i + 2 < n and ((x1 == ord("r") and t[i + 2] == ord("e"))
                                    or (x1 == ord("v") and t[i + 2] == ord("e"))):
                    o.pop()
            o.append(x)
        t = o
    return bytes(t)


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------
class StreamDecoder:
    """Incremental detokenizer: feed ids one at a time, get complete UTF-8 text.

    Bytes of an incomplete multi-byte UTF-8 sequence at the end are held back until the next
    piece completes them; invalid bytes become U+FFFD. ``flush()`` returns whatever is held back
    (incomplete tail -> U+FFFD). ``special`` has the meaning of ``Tokenizer.token_to_piece``.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self.tokenizer.token_to_piece(int(token_id), self.special))

    def feed(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield the non-empty text pieces produced by ``ids`` (does not flush)."""
        for i in ids:
            s = self.push(i)
            if s:
                yield s

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)

    def reset(self) -> None:
        self._dec.reset()

    @property
    def pending(self) -> bytes:
        """Bytes held back (an incomplete UTF-8 sequence)."""
        return self._dec.getstate()[0]
