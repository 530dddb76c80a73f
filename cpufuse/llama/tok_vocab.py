"""The vocabulary facts shared by the BPE and SPM tokenizers of cpufuse.llama.tokenizer: token types
and llama.cpp's attribute bits, the GGUF metadata access, the special ids (read, defaulted and
detected by text as llama.cpp does), the special-token partition and the detokenizer. ``Vocab`` is
the base of ``Tokenizer``; tok_bpe.py and tok_spm.py hold the two encoders."""
from __future__ import annotations

import numbers
from typing import Any, Iterable, Mapping, Optional

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


_C_ISSPACE = " \t\n\v\f\r"


# ---------------------------------------------------------------------------------------------
# Metadata access
# ---------------------------------------------------------------------------------------------
PREFIX = "tokenizer.ggml."


def _wanted_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key in ("general.name", "general.architecture")


def metadata_from_kv(kv: Mapping[str, Any]) -> dict:
    """the tokenizer's keys of a parsed GGUF (cpufuse.llama.gguf_file.GGUFFile.kv)"""
    return {k: v for k, v in kv.items() if _wanted_key(k)}


def metadata_from_reader(reader) -> dict:
    """the tokenizer's keys of a gguf-py ``GGUFReader`` (its ``fields``)"""
    out = {}
    for key, field in reader.fields.items():
        if _wanted_key(key):
            try:
                out[key] = field.contents()
            except Exception:  # pragma: no cover - malformed field
                continue
    return out


def normalize_metadata(meta: Mapping[str, Any]) -> dict:
    """Accept full GGUF keys or short names ("tokens", "chat_template", ...)."""
    out = {}
    for k, v in meta.items():
        if k.startswith("tokenizer.") or k.startswith("general."):
            out[k] = v
        elif k == "chat_template":
            out["tokenizer.chat_template"] = v
        else:
            out[PREFIX + k] = v
    return out


def to_list(v) -> list:
    if v is None:
        return None
    if hasattr(v, "tolist"):
        return v.tolist()
    return list(v)



# ---------------------------------------------------------------------------------------------
# Vocab: the loaded vocabulary, special ids, partition and detokenization
# ---------------------------------------------------------------------------------------------
class Vocab:
    """The vocabulary half of a Tokenizer: what _load_common reads from the GGUF metadata, and what
    needs no encoder (the special-token partition, pieces, detokenization, special ids)."""

    def _load_common(self, meta: dict, g, flags: dict, default_ids: dict, decode_normal) -> None:
        """the shared fields from meta (g(key) reads tokenizer.ggml.<key>): flags are the defaults
        of the vocab kind, decode_normal(text) the bytes of a NORMAL token"""
        self.ignore_merges = flags["ignore_merges"]
        self.clean_spaces = flags["clean_spaces"]
        self.add_space_prefix = flags["add_space_prefix"]
        if g("add_space_prefix") is not None:
            self.add_space_prefix = bool(g("add_space_prefix"))

        tokens = to_list(g("tokens"))
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
        types = to_list(g("token_type"))
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
            ids[name] = special_token_id(PREFIX + key, v, n)
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
                pieces.append(decode_normal(t))
            elif a & ATTR_BYTE:
                pieces.append(bytes([_strtol_hex(t[3:5])]))
            else:
                pieces.append(b"")
        self._pieces = pieces
        self.max_piece_bytes = max(map(len, pieces))   # the most bytes one token stands for
        self._hidden = [bool(a & (ATTR_UNKNOWN | ATTR_CONTROL)) for a in attrs]

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

    def is_hidden(self, token_id: int) -> bool:
        """a CONTROL or UNKNOWN token: its piece is empty unless special=True (BOS, EOS, <|im_end|>, ...)"""
        return self._hidden[token_id]


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
