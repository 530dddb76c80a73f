"""Constrained decoding with llguidance: JSON schema, json_object, regex, Lark and GBNF grammars.

    from cpufuse.llama.constrain import Constraint, GuidedSampler
    c = Constraint.from_options(tokenizer, response_format={"type": "json_object"})
    sampler = GuidedSampler(Sampler(...), c)               # its own matcher: one per sequence
    tok = sampler.sample(logits)                           # masked, sampled, consumed

The llguidance tokenizer is built once per `Tokenizer` (cached on it) from the GGUF vocabulary as
raw token bytes: a token's bytes are its piece (`token_to_piece(id, special=True)`); CONTROL and
UNKNOWN tokens (and tokens with no piece) are special: their text prefixed with 0xFF, as
llguidance expects. The end-of-generation ids are llguidance's EOS tokens: the mask allows them
only where the grammar accepts, and once the grammar is complete they are the only tokens allowed.

A grammar is compiled when a `Constraint` is made (about 0.5 ms; a schema or grammar llguidance
rejects raises ValueError with its message; the tokenizer keeps the last 32 compiled, so a
repeated schema costs nothing) and each sequence's matcher is a copy of the compiled one: a
sequence's mask depends only on the grammar and that sequence's own tokens, so batching does not
change it. The mask is applied to the logits (disallowed entries set to -inf) before the sampler
chain; -inf entries have zero weight through penalties, top-k/top-p/min-p and temperature. Greedy
decoding skips the mask where the top token is allowed (the same token: see GuidedSampler).

Closed objects: as llama.cpp's json-schema-to-grammar, an object schema that lists `properties`
and says nothing of `additionalProperties` takes only those properties (`close_schema`);
`additionalProperties: true` or a schema allows more. This holds for response_format, json_schema
and tool parameters.

JSON whitespace: JSON schema grammars allow llama.cpp's JSON whitespace (nothing, one space, or
one or two newlines and up to 20 spaces or tabs) between tokens, so a model may indent but not
emit unbounded whitespace. A schema may set its own with llguidance's "x-guidance" key
(e.g. {"whitespace_flexible": false} for compact JSON).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["Constraint", "GuidedSampler", "llg_tokenizer", "grammar_from_options", "JSON_WHITESPACE",
           "parse_logit_bias", "close_schema"]

JSON_WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"
_JSON_DEFAULTS = {"whitespace_pattern": JSON_WHITESPACE}
_LOCK = threading.Lock()


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover
        raise ImportError("structured output needs the 'llguidance' package "
                          "(pip install cpufuse[llama] or pip install llguidance)") from e
    return llguidance


class _VocabForLLG:
    """the object llguidance.TokenizerWrapper reads: raw token bytes, EOS/BOS, special ids, encode"""

    def __init__(self, tok):
        self._tok = tok
        toks, special = [], []
        for i in range(tok.n_vocab):
            piece = tok.token_to_piece(i, special=True)
            if tok.is_hidden(i) or not piece:
                toks.append(b"\xff" + tok.tokens[i].encode("utf-8"))
                special.append(i)
            else:
                toks.append(piece)
        self.tokens = toks
        self.special_token_ids = special
        eog = sorted(tok.eog_ids)
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else (eog[0] if eog else 0)
        self.bos_token_id = tok.bos_id

    def __call__(self, data: bytes):
        """token ids of a text fragment: no BOS, no space prefix, special token texts not parsed"""
        return self._tok.encode_fragment(bytes(data).decode("utf-8", errors="replace"))


def llg_tokenizer(tok):
    """The llguidance LLTokenizer of a cpufuse Tokenizer: built on first use, then cached on it."""
    lt = getattr(tok, "_llg_tokenizer", None)
    if lt is not None:
        return lt
    with _LOCK:
        lt = getattr(tok, "_llg_tokenizer", None)
        if lt is None:
            llg = _llg()
            eog = sorted(tok.eog_ids)
            v = _VocabForLLG(tok)
            lt = llg.LLTokenizer(llg.TokenizerWrapper(v), eos_token=eog or None)
            tok._llg_tokenizer = lt
    return lt


_SUB = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")


def close_schema(schema):
    """`schema` with every object schema that lists `properties` and says nothing about
    `additionalProperties` closed to those properties (llama.cpp's json-schema-to-grammar
    default); a copy, the argument is not changed"""
    if isinstance(schema, list):
        return [close_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(v, dict):
            out[k] = {n: close_schema(s) for n, s in v.items()}
        elif k in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(v, list):
            out[k] = [close_schema(s) for s in v]
        elif k in _SUB or k == "additionalProperties":
            out[k] = close_schema(v)
        else:
            out[k] = v
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _schema_grammar(schema, param: str) -> str:
    llg = _llg()
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError(f"{param}: a JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        return llg.LLMatcher.grammar_from_json_schema(close_schema(schema), defaults=_JSON_DEFAULTS)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{param}: invalid JSON schema: {e}") from None


def grammar_from_options(response_format: Optional[dict] = None, grammar: Optional[str] = None,
                         json_schema: Any = None, regex: Optional[str] = None,
                         lark: Optional[str] = None) -> Optional[tuple]:
    """(llguidance grammar, param) for the request's constraint options, or None (no constraint).

    response_format: OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema":
    {"name", "schema", "strict"}}; json_object may carry a "schema" (llama-server / Anyscale).
    grammar: llama.cpp GBNF (a Lark grammar is also accepted). json_schema: llama.cpp's field.
    regex / lark: a regular expression / a Lark grammar for the whole output. At most one of them
    may constrain: ValueError otherwise, naming the fields. llguidance is imported only when a
    constraint is given."""
    given = [(k, v) for k, v in (("grammar", grammar), ("json_schema", json_schema), ("regex", regex),
                                  ("lark", lark)) if v is not None]
    rf_grammar = None
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
        kind = response_format.get("type", "text")
        if kind == "text":
            pass
        elif kind == "json_object":
            schema = response_format.get("schema")
            rf_grammar = _schema_grammar(schema if schema is not None else {"type": "object"},
                                         "response_format.schema")
        elif kind == "json_schema":
            js = response_format.get("json_schema")
            if not isinstance(js, dict):
                raise ValueError("response_format.json_schema must be an object with a 'schema' "
                                 f"(and 'name', 'strict'), got {type(js).__name__}")
            schema = js.get("schema", js.get("schema_"))
            if schema is None:
                raise ValueError("response_format.json_schema.schema is missing")
            rf_grammar = _schema_grammar(schema, "response_format.json_schema.schema")
        else:
            raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                             f"got {kind!r}")
    if rf_grammar is not None:
        given.insert(0, ("response_format", rf_grammar))
    if len(given) > 1:
        names = ", ".join(f'"{k}"' for k, _ in given)
        raise ValueError(f"only one constraint may be given: got {names}")
    if not given:
        return None
    k, v = given[0]
    if k == "response_format":
        return v, k
    llg = _llg()
    if not isinstance(v, (str, dict)) or (k != "json_schema" and not isinstance(v, str)):
        raise ValueError(f"{k} must be a {'JSON schema object' if k == 'json_schema' else 'string'}, "
                         f"got {type(v).__name__}")
    if k == "json_schema":
        return _schema_grammar(v, k), k
    if k == "regex":
        return llg.LLMatcher.grammar_from_regex(v), k
    if k == "lark":
        return llg.LLMatcher.grammar_from_lark(v), k
    # grammar: GBNF (llama.cpp) or Lark
    try:
        return llg.grammar_from("gbnf", v), k
    except ValueError as e:
        raise ValueError(f"grammar: {e}") from None


_COMPILED_MAX = 32      # compiled grammars kept per tokenizer (most recently used)


def _compiled(tok, grammar: str):
    """a matcher at the start of `grammar` for `tok`, never advanced: per-sequence matchers are
    its deep copies (about 1 us, against about 0.4 ms to compile). Kept per tokenizer for the
    _COMPILED_MAX grammars used last, so a repeated schema is compiled once."""
    with _LOCK:
        cache = tok.__dict__.setdefault("_llg_compiled", {})
        m = cache.pop(grammar, None)
        if m is not None:
            cache[grammar] = m              # most recently used last
            return m
    m = _llg().LLMatcher(llg_tokenizer(tok), grammar, log_level=0)
    if not m.is_error():
        with _LOCK:
            cache[grammar] = m
            while len(cache) > _COMPILED_MAX:
                del cache[next(iter(cache))]
    return m


class Constraint:
    """A compiled grammar for one model's vocabulary; `matcher()` makes a fresh per-sequence matcher.
    Construction checks the grammar (ValueError naming `param` with llguidance's message)."""

    def __init__(self, tokenizer, grammar: str, param: str = "grammar", parse=None):
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.param = param
        self.parse = parse              # an optional output parser (tools: cpufuse.llama.tools)
        self.lltok = llg_tokenizer(tokenizer)
        m = _compiled(tokenizer, grammar)
        if m.is_error():
            raise ValueError(f"{param}: {m.get_error()}")
        self._start = m                 # shared, never advanced

    def matcher(self):
        """a matcher at the start of the grammar (a copy of the compiled one)"""
        return self._start.deep_copy()

    @classmethod
    def from_options(cls, tokenizer, **options) -> Optional["Constraint"]:
        """`grammar_from_options(**options)` compiled for `tokenizer`, or None without a constraint."""
        g = grammar_from_options(**options)
        return None if g is None else cls(tokenizer, g[0], g[1])

    def __repr__(self):
        return f"Constraint(param={self.param!r}, grammar={self.grammar[:60]!r}...)"


def parse_logit_bias(bias, n_vocab: int, param: str = "logit_bias") -> tuple:
    """OpenAI's logit_bias ({"token id": bias in [-100, 100]}; also [[id, bias], ...] as llama.cpp)
    -> ((ids int64 array, biases float32 array)) or () when empty. ValueError naming `param`."""
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, dict) else bias
    ids, vals = [], []
    try:
        items = list(items)
    except TypeError:
        raise ValueError(f"{param} must be an object of token id -> bias, got {type(bias).__name__}") from None
    for it in items:
        if not (isinstance(it, (tuple, list)) and len(it) == 2):
            raise ValueError(f"{param}: expected token id -> bias pairs, got {it!r}")
        k, v = it
        if isinstance(k, bool):
            t = None
        elif isinstance(k, int):
            t = k
        elif isinstance(k, float) and k.is_integer():
            t = int(k)
        elif isinstance(k, str) and k.strip().lstrip("-").isdigit():
            t = int(k)
        else:
            t = None
        if t is None:
            raise ValueError(f"{param}: keys must be token ids (integers), got {k!r}")
        if not 0 <= t < n_vocab:
            raise ValueError(f"{param}: token id {t} is outside the vocabulary [0, {n_vocab})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= float(v) <= 100:
            raise ValueError(f"{param}: the bias of token {t} must be a number in [-100, 100], got {v!r}")
        ids.append(t)
        vals.append(float(v))
    if not ids:
        return ()
    return (np.asarray(ids, np.int64), np.asarray(vals, np.float32))


# the additive mask rows of the 256 bytes of a packed bitmask (bit j of byte b: token 8*b + j):
# 0 where the bit is set (allowed), -inf elsewhere; a mask row is one np.take over the mask's bytes
_BYTE_ROWS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") != 0,
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)


class GuidedSampler:
    """A `cpufuse.llama.sampling.Sampler` behind a logit bias and a grammar mask.

    sample(logits): bias added, the disallowed entries set to -inf, the wrapped sampler's chain,
    then the token is consumed by the matcher. compute_mask() may be called beforehand from
    another thread (llguidance releases the GIL): sample() then uses that mask; `mask_ahead`
    says whether sample() will need one. The matcher's state changes only in sample().

    Greedy (a `Sampler` at temperature 0) needs no mask unless the top logit's token is not
    allowed: sample() takes the first maximal logit after the penalties and asks the matcher
    whether it may come next (or looks it up in a mask filled ahead); only if not is the mask
    filled (here, on the caller's thread unless it was ahead) and the argmax taken over the
    allowed tokens. Either way the token is the first maximal logit among the allowed ones, as
    with the mask applied first. Refusals come in runs (where the grammar forces structure, or
    all along when the model ignores the format), so a greedy sampler asks for its mask ahead
    (`mask_ahead`) for its first token and after a refused top token. Sampling at a temperature applies
    the mask to the whole row (the filters and the draw need every allowed logit), so its
    random stream is as without the shortcut. For a `Sampler` the rows are buffers of this
    sampler's own, reused from token to token."""

    def __init__(self, sampler, constraint: Optional[Constraint] = None, logit_bias=()):
        self.sampler = sampler
        self.constraint = constraint
        self.matcher = constraint.matcher() if constraint is not None else None
        self.bias = logit_bias or ()
        self._mask = None                  # the precomputed additive mask row (see compute_mask)
        self._ready = False                # compute_mask() ran since the last sample()
        self._row = None                   # the logits row handed to the sampler (bias / mask applied)
        from .sampling import Sampler
        self._own = isinstance(sampler, Sampler)   # greedy can skip the mask (see _sample_greedy)
        self._refused = True               # greedy: the last top token was refused (or none yet)
        if constraint is not None:
            self._n = int(constraint.lltok.vocab_size)
            self._words = np.zeros((1, (self._n + 31) // 32), np.int32)
            self._add = np.empty(self._words.shape[1] * 32, np.float32)

    def __getattr__(self, name):           # temperature, greedy, rng, ...: the wrapped sampler's
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def accept_prompt(self, ids):
        self.sampler.accept_prompt(ids)

    def accept(self, token):
        self.sampler.accept(token)

    @property
    def done(self) -> bool:
        """the grammar is complete: only an end-of-generation token can follow"""
        return self.matcher is not None and self.matcher.is_stopped()

    def _greedy(self) -> bool:
        return self._own and self.sampler.temperature <= 0.0      # Sampler.greedy

    @property
    def mask_ahead(self) -> bool:
        """the next sample() is likely to need the full mask, so it is worth filling ahead: a
        grammar, and sampling at a temperature, or greedy after a refused top token (or at the start)"""
        return self.matcher is not None and (self._refused or not self._greedy())

    def compute_mask(self):
        """fill the next token's mask (callable from a worker thread): an additive float32 row,
        0 where the grammar allows the token, -inf elsewhere (None: it allows nothing)"""
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self.matcher, self._words, 0)
        if self._words.any():
            np.take(_BYTE_ROWS, self._words.view(np.uint8).reshape(-1), axis=0,
                    out=self._add.reshape(-1, 8), mode="clip")
            self._mask = self._add[:self._n]
        else:
            self._mask = None
        self._ready = True

    def _take_mask(self, n: int):
        """the mask (filled now unless ready) for a row of n logits; RuntimeError if nothing is allowed"""
        if not self._ready:
            self.compute_mask()
        add, self._mask, self._ready = self._mask, None, False
        if add is None:
            raise RuntimeError("the grammar allows no token here"
                               + (f": {self.matcher.get_error()}" if self.matcher.is_error() else ""))
        if add.shape[0] != n:                   # the model's rows are longer (or shorter) than the vocab
            full = np.full(n, -np.inf, np.float32)
            k = min(add.shape[0], n)
            full[:k] = add[:k]
            add = full
        return add

    def _buffer(self, n: int):
        """the row handed to the sampler: reused for a cpufuse Sampler (which keeps no logits),
        a new one for any other sampler"""
        if not self._own:
            return np.empty(n, np.float32)
        if self._row is None or self._row.shape[0] != n:
            self._row = np.empty(n, np.float32)
        return self._row

    def sample(self, logits):
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        if self.bias:
            ids, vals = self.bias
            buf = self._buffer(x.shape[0])
            np.copyto(buf, x)
            x = buf
            x[ids] += vals
        if self.matcher is None:
            return self.sampler.sample(x)
        if self.matcher.is_error():
            raise RuntimeError(f"grammar matcher error: {self.matcher.get_error()}")
        if self._greedy():
            tok = self._sample_greedy(x)
        else:
            tok = self.sampler.sample(np.add(x, self._take_mask(x.shape[0]),   # x + 0 is x; x + -inf is -inf
                                             out=self._buffer(x.shape[0])))
        if not self.matcher.consume_token(tok):
            raise RuntimeError(f"grammar matcher rejected token {tok}: {self.matcher.get_error()}")
        return tok

    def _sample_greedy(self, x):
        """the wrapped greedy Sampler's token under the mask, the mask filled only if the top
        token is not allowed (the penalties leave -inf at -inf, so penalizing then masking is
        masking then penalizing)"""
        s = self.sampler
        lg = s._penalized(x)
        tok = int(np.argmax(lg))                # first index among equal maxima
        if self._ready:                         # filled ahead: look the top token up
            ok = self._mask is not None and tok < self._n and self._mask[tok] == 0
        else:
            ok = tok < self._n and self.matcher.validate_tokens([tok]) == 1
        self._refused = not ok
        if ok:
            self._mask, self._ready = None, False
        else:
            tok = int(np.argmax(np.add(lg, self._take_mask(lg.shape[0]), out=self._buffer(lg.shape[0]))))
        s.record(tok)
        return tok
