"""Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) for cpufuse.llama.tokenizer: the GPT-2
byte-to-unicode map, the pre-tokenizer families (docs/semantics.md §10) and the Hugging Face
``tokenizers`` BPE model built from a GGUF's ``tokens`` / ``merges``."""
from __future__ import annotations

import warnings

__all__ = ["bytes_to_unicode", "decode_bpe_text", "build_hf", "PRE_FAMILIES", "FAMILY_FLAGS",
           "PRE_FLAG_OVERRIDES", "GPT2_REGEX", "LLAMA3_REGEX", "QWEN2_REGEX", "O200K_REGEX", "DEFAULT_REGEXES"]

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
# o200k (gpt-4o, gpt-oss; llama.cpp's pre-tokenizer "gpt-4o"): a word is an optional non-letter,
# upper-case-ish letters then lower-case-ish ones (or the reverse), with a contraction in any case;
# digits in runs of up to 3; punctuation runs may take trailing newlines and slashes
_O200K_CONTR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
O200K_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _O200K_CONTR + "|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _O200K_CONTR + "|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_REGEXES = (
    r"[\p{P}\$\+<=>\^~\|]+",
    GPT2_REGEX,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

# pre value -> (family, flags) as in llama.cpp's llama_vocab::impl::load (BPE branch).
# Flags: add_bos, add_eos, ignore_merges, clean_spaces. GGUF add_bos/add_eos keys override.
FAMILY_FLAGS = {
    "llama-bpe": dict(add_bos=True, add_eos=False, ignore_merges=True, clean_spaces=True),
    "qwen2": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=False),
    "smollm": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=False),
    "gpt-2": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=True),
    "gpt-4o": dict(add_bos=False, add_eos=False, ignore_merges=False, clean_spaces=False),
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
    # the o200k regex (gpt-oss)
    "gpt-4o": "gpt-4o",
    # default (also used when `pre` is missing)
    "default": "default",
}
# `megrez` uses the qwen2 regex but keeps clean_spaces = true in llama.cpp.
PRE_FAMILIES["megrez"] = "qwen2"
PRE_FLAG_OVERRIDES = {"megrez": dict(clean_spaces=True)}


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


def decode_bpe_text(text: str) -> bytes:
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



def build_hf(vocab: dict, merges: list, family: str, ignore_merges: bool):
    """the HF ``tokenizers`` BPE model of a vocab (text -> id), its merges and pre-tokenizer family"""
    try:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers
    except ImportError as e:  # pragma: no cover
        raise ImportError("cpufuse.llama.tokenizer needs the 'tokenizers' package "
                          "(pip install tokenizers)") from e

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
    bpe = models.BPE(vocab=dict(vocab), merges=pairs, ignore_merges=ignore_merges,
                     byte_fallback=False)
    hf = HFTokenizer(bpe)

    def split(rx):
        return pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)

    byte_level_noregex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    fam = family
    if fam == "smollm":
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif fam == "llama-bpe":
        pre = pre_tokenizers.Sequence([split(LLAMA3_REGEX), byte_level_noregex])
    elif fam == "qwen2":
        pre = pre_tokenizers.Sequence([split(QWEN2_REGEX), byte_level_noregex])
    elif fam == "gpt-4o":
        pre = pre_tokenizers.Sequence([split(O200K_REGEX), byte_level_noregex])
    elif fam == "gpt-2":
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif fam == "default":
        pre = pre_tokenizers.Sequence([split(r) for r in DEFAULT_REGEXES] + [byte_level_noregex])
    else:  # pragma: no cover
        raise NotImplementedError(fam)
    hf.pre_tokenizer = pre
    return hf
