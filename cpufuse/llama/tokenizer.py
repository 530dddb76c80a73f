"""GGUF tokenizer with llama.cpp semantics (docs/semantics.md §10).

This module is the ``Tokenizer`` (loading, tokenize) and ``StreamDecoder``; the rooms it is made of:
tok_vocab.py (token types, GGUF metadata, special ids, partition, detokenize: ``Vocab``, the base
class), tok_bpe.py (byte-level BPE) and tok_spm.py (SentencePiece).

Supported: byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) whose pre-tokenizer
(``tokenizer.ggml.pre``) is one of the families in ``PRE_FAMILIES``: ``smollm``, ``llama-bpe``
(llama3 and aliases), ``qwen2`` (and aliases), ``gpt-2`` (and aliases), ``gpt-4o`` (the o200k
regex: gpt-oss), ``default`` (also a missing ``pre``); and SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) through a
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
import os
import warnings
from typing import Any, Iterable, Iterator, Mapping, Optional, Union

from .tok_bpe import (DEFAULT_REGEXES, FAMILY_FLAGS, GPT2_REGEX, LLAMA3_REGEX, PRE_FAMILIES,  # noqa: F401
                      PRE_FLAG_OVERRIDES, QWEN2_REGEX, build_hf, bytes_to_unicode, decode_bpe_text)
from .tok_spm import spm_tokenize
from .tok_vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_LSTRIP, ATTR_NORMAL, ATTR_NORMALIZED,  # noqa: F401
                        ATTR_RSTRIP, ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED, ATTR_USER_DEFINED,
                        TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNDEFINED,
                        TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_UNUSED, TOKEN_TYPE_USER_DEFINED, Vocab,
                        PREFIX, metadata_from_kv, metadata_from_reader, normalize_metadata, special_token_id,
                        to_list)

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
    "special_token_id",
]


class Tokenizer(Vocab):
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
            meta = metadata_from_kv(GGUFFile(source).kv)
        elif isinstance(source, GGUFFile):
            meta = metadata_from_kv(source.kv)
        elif hasattr(source, "fields") and not isinstance(source, Mapping):
            meta = metadata_from_reader(source)
        else:
            meta = normalize_metadata(source)
        self._load(meta)

    @classmethod
    def from_gguf(cls, path_or_reader) -> "Tokenizer":
        return cls(path_or_reader)

    # -- loading -----------------------------------------------------------------------------
    def _load(self, meta: dict) -> None:
        g = lambda k, d=None: meta.get(PREFIX + k, d)  # noqa: E731

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
                              default_ids=dict(bos=1, eos=2, unk=0),
                              decode_normal=lambda t: t.replace("\u2581", " ").encode("utf-8"))
            self.pre, self.pre_family = g("pre") or "default", "spm"
            scores = to_list(g("scores"))
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
        flags = dict(FAMILY_FLAGS[family], add_space_prefix=False)
        flags.update(PRE_FLAG_OVERRIDES.get(self.pre, {}))
        self._load_common(meta, g, flags, default_ids=dict(bos=11, eos=11, unk=None),
                          decode_normal=decode_bpe_text)
        merges = to_list(g("merges"))
        if merges is None:
            raise ValueError("byte-level BPE GGUF has no tokenizer.ggml.merges")
        if not all(type(m) is str for m in merges):
            bad = next(m for m in merges if type(m) is not str)
            raise ValueError(f"tokenizer.ggml.merges must be an array of strings, found an element of type "
                             f"{type(bad).__name__}: {bad!r}")
        self._hf = build_hf(self.token_to_id, merges, family, self.ignore_merges)

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
                    self._spm_encode(f.replace(" ", "\u2581").encode("utf-8"), out)
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

    def encode_fragment(self, text: str) -> list:
        """Token ids of a text fragment inside a longer text: no BOS / EOS, no space prefix, special
        token texts not parsed (the pieces a grammar-constrained sampler matches)."""
        if not text:
            return []
        if self.is_spm:
            out: list = []
            self._spm_encode(text.replace(" ", "\u2581").encode("utf-8"), out)
            return out
        return self.tokenize(text, add_bos=False, special=False, add_eos=False)

    def _spm_encode(self, data: bytes, out: list) -> None:
        spm_tokenize(data, self._spm_vocab, self._spm_scores, self.token_to_id, out)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos_id}, eos={self.eos_id}, eog={sorted(self.eog_ids)}, "
                f"add_bos={self.add_bos}, add_eos={self.add_eos})")


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
