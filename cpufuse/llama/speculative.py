"""Speculative decoding that changes no token (docs/speculative.md).

A draft proposes the next k tokens; the target model evaluates the last sampled token and the k
drafts as ONE batch (all k + 1 rows' logits) and samples its own token from each row in order,
keeping drafts while they equal what it sampled:

    t1 = sample(row 0); if t1 == d1: t2 = sample(row 1); if t2 == d2: ... (k + 1 tokens at most)

cpufuse's decoder computes every row of a batch alone (cpufuse.llama.decoder), and `verify` makes
each drafted token its own attention group, so its attention is the decode step's own call (one
query row; split-KV from 128 cells on). Every row thus gets exactly the logits a single decode step
gives, and each token is sampled from the very logits plain decoding would have used, with the sampler's state (penalty
history, RNG) advanced by the same calls. The output is therefore identical token for token to
plain decoding, greedy or sampled with a seed. For a draft that proposes one token (a point mass q =
[d]), this is the standard speculative rejection rule: accept d with probability min(1, p(d)/q(d)) =
p(d), else draw from the residual (p - q)+ normalized = p without d, and "draw t ~ p; accept iff
t == d; else emit t" has exactly those probabilities (tests/test_speculative.py checks them).

Rejected drafts leave K/V cells beyond the accepted position: `rewind` sets the sequence's length
back (n_past and the cached ids), and the next batch overwrites those cells. With sliding-window
rings (gemma), the cells a rejected draft overwrote belong to positions at least window + n_batch -
k back, outside every later query's window.

Drafts:
    LlamaPromptLookupDecoding(num_pred_tokens=10)  lookup in the context
                                                                     (llama-cpp-python's class)
    DraftModel(path_or_model, num_pred_tokens=8, p_min=0.75)         a smaller model with the
                                                                     same vocabulary, greedy
A draft is any callable(input_ids: np.ndarray of int) -> sequence of ids (llama-cpp-python's
LlamaDraftModel interface).
"""
from __future__ import annotations

import numbers
import os

import numpy as np

from .decoder import Batch
from .kv import int_arg as _pos_int

__all__ = ["LlamaDraftModel", "LlamaPromptLookupDecoding", "DraftModel", "speculate", "verify", "draft_ids", "rewind", "written",
           "check_draft", "next_cap", "longest_match"]

VOCAB_MAX_DIFF = 128       # llama.cpp's allowed vocabulary size difference of draft and target


class LlamaDraftModel:
    """llama-cpp-python's draft interface: called with the context's token ids (the last one is
    the token just sampled), returns the ids it predicts next."""

    def __call__(self, input_ids, /, **kwargs):
        raise NotImplementedError

    def bind(self, target):
        """called once with the target Model before drafting for it (a check; nothing by default)"""


class LlamaPromptLookupDecoding(LlamaDraftModel):
    """Prompt lookup (llama-cpp-python's class and arguments; no second model): find where the
    context's last tokens occurred before, and propose what followed. cpufuse chooses the match
    and the draft's length by how far back the match goes (docs/speculative.md):

    - the occurrence whose preceding tokens match the context's furthest back (up to MATCH_MAX
      tokens: L), the most recent among equals: when the answer copies a passage, that is the
      place it copies from, step after step;
    - up to 2 ** (L - 1) - 1 tokens (1, 3, 7, 15, ... rows beside the last token: whole matmul
      row tiles), at most num_pred_tokens; none when only the last token matches (L = 1), where
      a draft is accepted too rarely to pay for its verification.

    max_ngram_size given (an int): llama-cpp-python's rule instead, the most recent occurrence of
    the longest of the context's last 1..max_ngram_size tokens, and num_pred_tokens after it."""

    MATCH_MAX = 64

    def __init__(self, max_ngram_size=None, num_pred_tokens=10):
        self.max_ngram_size = None if max_ngram_size is None else _pos_int(max_ngram_size, "max_ngram_size", 1, 64)
        self.num_pred_tokens = _pos_int(num_pred_tokens, "num_pred_tokens", 1, 1024)

    def __call__(self, input_ids, /, **kwargs):
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        if self.max_ngram_size is not None:          # llama-cpp-python's n-gram rule
            j, L = longest_match(ids, self.max_ngram_size)
            return ids[j:j + self.num_pred_tokens] if L else ids[:0]
        j, L = longest_match(ids, self.MATCH_MAX)
        if L < 2:
            return ids[:0]
        return ids[j:j + min(self.num_pred_tokens, (1 << min(L - 1, 20)) - 1)]

    def __repr__(self):
        return (f"LlamaPromptLookupDecoding(max_ngram_size={self.max_ngram_size}, "
                f"num_pred_tokens={self.num_pred_tokens})")


def longest_match(ids, max_len):
    """(j, L): ids[j - L:j] == ids[n - L:] (n = len(ids), j < n) with the largest L <= max_len,
    the largest j among equals; (0, 0) when the last id does not occur before"""
    n = ids.shape[0]
    c = np.flatnonzero(ids[:n - 1] == ids[n - 1]) + 1 if n > 1 else ids[:0]
    if c.size == 0:
        return 0, 0
    L = 1
    while L < max_len:
        c2 = c[c > L]                              # ids[j - 1 - L] exists
        c2 = c2[ids[c2 - 1 - L] == ids[n - 1 - L]]
        if c2.size == 0:
            break
        c, L = c2, L + 1
    return int(c[-1]), L


class DraftModel(LlamaDraftModel):
    """A smaller model with the target's vocabulary proposes up to num_pred_tokens tokens, greedily,
    stopping early when its top token's probability is below p_min (llama-server's --draft-p-min).
    `model`: a cpufuse.llama.Model, or a GGUF path, loaded when the draft is bound to its target
    (Model.load(path, **load_kw); n_ctx and n_threads default to the target's). It keeps its own
    KV cache and reuses the prefix it shares with each new context."""

    def __init__(self, model, num_pred_tokens=8, p_min=0.75, **load_kw):
        self.num_pred_tokens = _pos_int(num_pred_tokens, "num_pred_tokens", 1, 1024)
        if isinstance(p_min, bool) or not isinstance(p_min, numbers.Real) or not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min must be a number in [0, 1], got {p_min!r}")
        self.p_min = float(p_min)
        self.model = self.path = None
        if isinstance(model, (str, os.PathLike)):
            self.path, self.load_kw = os.fspath(model), load_kw
        elif not hasattr(model, "_eval") or not hasattr(model, "tokenizer"):
            raise TypeError(f"model must be a cpufuse.llama.Model or a GGUF path, got {type(model).__name__}")
        elif load_kw:
            raise TypeError(f"load keywords {sorted(load_kw)} given with an already loaded Model")
        else:
            self.model = model

    def bind(self, target):
        """Load the draft (a path) and check that its vocabulary is the target's (llama.cpp's rule:
        the same token texts, sizes within 128 of each other): ValueError naming the difference"""
        if self.model is None:
            kw = dict(dict(n_ctx=target.n_ctx, n_threads=target.n_threads), **self.load_kw)
            self.model = type(target).load(self.path, **kw)
        if target is self.model:
            raise ValueError("draft_model: the draft must be a different Model object from the target")
        a, b = target.tokenizer.tokens, self.model.tokenizer.tokens
        n = min(len(a), len(b))
        if abs(len(a) - len(b)) > VOCAB_MAX_DIFF or a[:n] != b[:n]:
            bad = next((i for i in range(n) if a[i] != b[i]), n)
            raise ValueError(f"draft_model: its vocabulary differs from the target's (sizes {len(b)} and "
                             f"{len(a)}, first difference at id {bad}); a draft model must share the tokenizer")

    def __call__(self, input_ids, /, **kwargs):
        m = self.model
        ids = [int(t) for t in np.asarray(input_ids).reshape(-1)]
        k = min(self.num_pred_tokens, m.n_ctx - len(ids))
        if k <= 0 or not ids:
            return []
        with m._lock:
            m._epoch += 1
            c = m._cached
            keep, lim = 0, min(len(c), len(ids) - 1)
            while keep < lim and c[keep] == ids[keep]:
                keep += 1
            rewind(m, m.kv.reusable(keep, written(m)))
            logits = m._eval(ids[m.n_past:])
            out = []
            while True:
                lg = np.asarray(logits, np.float64)
                t = int(np.argmax(lg))
                if self.p_min > 0.0:
                    e = np.exp(lg - lg[t])
                    if 1.0 / e.sum() < self.p_min:
                        break
                out.append(t)
                if len(out) == k:
                    break
                logits = m._eval([t])
            return out

    def __repr__(self):
        return f"DraftModel({self.model or self.path!r}, num_pred_tokens={self.num_pred_tokens}, p_min={self.p_min})"


def check_draft(draft, target):
    """a draft argument: None, an int N (prompt lookup of N tokens), or a LlamaDraftModel /
    callable; bound to the target (DraftModel checks the vocabulary). Returns the draft or None."""
    if draft is None:
        return None
    if isinstance(draft, numbers.Integral) and not isinstance(draft, bool):
        return LlamaPromptLookupDecoding(num_pred_tokens=_pos_int(draft, "draft (num_pred_tokens)", 1, 1024))
    if not callable(draft):
        raise TypeError(f"draft_model must be a LlamaDraftModel (e.g. LlamaPromptLookupDecoding(num_pred_tokens=N)) "
                        f"or a callable(input_ids) -> ids, got {type(draft).__name__}")
    if hasattr(draft, "bind"):
        draft.bind(target)
    return draft


def rewind(model, n):
    """Forget slot 0's tokens from position n on (n <= n_past): the cells stay and are overwritten
    by the next evaluation. The positions written stay counted (written()). Call under model._lock."""
    if not 0 <= n <= model._n_past:
        raise ValueError(f"rewind: n must be in [0, {model._n_past}], got {n}")
    model._spec_written = max(getattr(model, "_spec_written", 0), model._n_past)
    model._n_past = n
    del model._cached[n:]


def verify(model, toks):
    """Evaluate `toks` at slot 0's next positions in one decoder call and return every row's logits
    (the plan's buffer, valid until the next call). Each token is its own attention group, so its
    attention is the very call a decode step makes (one query row over its own cells: split-KV
    from 128 cells on, like the step), not the multi-row path a prompt chunk takes, which rounds
    differently; every other op computes each row alone. Call under model._lock."""
    base, B = model._n_past, model.n_batch
    b = Batch(model)
    for i, t in enumerate(toks):
        b.add(0, [t], base + i, logits=True)
    rows = b.run(model.decoder, (B, B, B), n_threads=model.n_threads)
    model._n_past = base + len(toks)
    model._cached.extend(int(t) for t in toks)
    return rows


def next_cap(cap, drafted, accepted):
    """the most ids to draft at the next step, after a step that drafted `drafted` ids and kept
    `accepted` of them: one more than were kept after a rejection; after none, 2 * drafted + 1
    (1, 3, 7, 15: the verification's rows then fill the matmul's row tiles); unchanged when
    nothing was drafted"""
    if not drafted:
        return cap
    return 2 * drafted + 1 if accepted == drafted else accepted + 1


def draft_ids(draft, context, k, n_vocab):
    """at most k ids the draft proposes after `context` (the ids so far, the last one just
    sampled), as ints; a draft is untrusted: its ids end at the first one outside [0, n_vocab)"""
    if k <= 0:
        return []
    d = [int(t) for t in np.asarray(draft(np.asarray(context, dtype=np.int64)), dtype=np.int64).reshape(-1)[:k]]
    for i, t in enumerate(d):
        if not 0 <= t < n_vocab:
            return d[:i]
    return d


def written(model):
    """how many positions of slot 0 may have been written: the cached ones, or more after a rewind
    (rejected drafts). Sliding-window rings reuse a cached prefix only if no later position
    overwrote its window (KVCache.reusable), so they are asked with this count (an upper bound)."""
    return max(len(model._cached), getattr(model, "_spec_written", 0))


def speculate(model, tok, sampler, draft, context, limit):
    """One speculative step under model._lock: `tok` (sampled, not yet evaluated) is the last id of
    `context` (the prompt and every generated id). Drafts up to `limit` tokens, evaluates tok and
    the drafts as one batch, samples from each row in order while the drafts match. Returns
    (the sampled ids: 1 .. k + 1 of them, the drafted count k, the accepted count)."""
    d = draft_ids(draft, context, min(limit, model.n_ctx - model._n_past - 1, model.n_batch - 1), model.n_vocab)
    if not d:
        return [sampler.sample(model._eval([tok]))], 0, 0
    base = model._n_past
    rows = verify(model, [tok] + d)
    out = []
    for i in range(len(d) + 1):
        t = sampler.sample(rows[i])
        out.append(t)
        if i == len(d) or t != d[i]:
            break
    rewind(model, base + len(out))     # tok and the accepted drafts stay; the rest is forgotten
    return out, len(d), len(out) - 1
