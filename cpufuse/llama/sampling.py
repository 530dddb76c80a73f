"""Token sampling: llama.cpp's `common` sampler chain with its defaults (docs/semantics.md §10).

Chain (disabled stages are no-ops):
    penalties (repeat over the last penalty_last_n tokens, prompt included, as llama-completion)
    -> top-k -> top-p -> min-p -> temperature -> dist (seeded numpy Generator)
The filters act on unscaled logits; temperature comes last. temperature 0 is greedy: the first
maximal logit after the penalties (what llama.cpp's temp-0 stage keeps). Out-of-range values
(temperature < 0, top_p outside (0, 1], min_p outside [0, 1], top_k < 0, repeat_penalty <= 0,
NaN) raise ValueError naming the argument.

The random stream is a numpy Generator (PCG64), not std::mt19937, so a seeded draw is reproducible
here but is not the same token stream as llama.cpp's for the same seed.

Frequency and presence penalties (l <- l - c*frequency - presence for a token seen c > 0 times) count
over one of two scopes, `penalty_scope`:
  "window"    (llama.cpp) the last penalty_last_n tokens, prompt included, as the repeat penalty;
  "generated" (OpenAI) every token this sampler has sampled, the prompt excluded (the repeat
              penalty keeps its window). cpufuse.serve uses it for the API's penalties.
"""
from __future__ import annotations

import collections
import math
from typing import Iterable

import numpy as np

__all__ = ["Sampler", "DEFAULTS", "apply_penalties", "top_ids", "top_k", "top_p", "min_p"]

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, penalty_last_n=64,
                frequency_penalty=0.0, presence_penalty=0.0)


def apply_penalties(logits, history, repeat=1.0, freq=0.0, present=0.0):
    """llama.cpp penalties on a float32 copy: for each token seen c > 0 times in `history`:
    l <- l*r if l <= 0 else l/r; then l <- l - c*freq - present. Returns (maybe a new) array."""
    if not history or (repeat == 1.0 and freq == 0.0 and present == 0.0):
        return logits
    return _penalize_counts(logits, collections.Counter(history), repeat, freq, present)


def _penalize_counts(logits, cnt, repeat, freq, present):
    """apply_penalties with the counts given ({token: count > 0})"""
    ids = np.fromiter(cnt.keys(), np.int64, len(cnt))
    c = np.fromiter(cnt.values(), np.float32, len(cnt))
    ids_ok = ids < logits.shape[0]
    ids, c = ids[ids_ok], c[ids_ok]
    out = logits.astype(np.float32, copy=True)
    lv = out[ids]
    r = np.float32(repeat)
    lv = np.where(lv <= 0, lv * r, lv / r).astype(np.float32)
    lv = lv - c * np.float32(freq) - np.float32(present)
    out[ids] = lv
    return out


def top_ids(x, k):
    """the indices of the k largest values of the 1-D x, largest first: `np.argsort(-x, kind="stable")[:k]`
    (equal values by lower index, NaN below every number), without sorting or partitioning all of x.

    A strided sample of about sqrt(k * n) values gives a bound t that at least k values reach (the
    sample's k-th largest); one pass keeps the values >= t (about sqrt(k * n) of them), and only those
    are ordered. A 152k vocabulary at k = 40 takes about a tenth of `np.argpartition`'s time."""
    n = x.shape[0]
    if k <= 0:
        return np.zeros(0, np.int64)
    if k >= n:
        return np.argsort(-x, kind="stable")
    stride = max(1, n // max(int(math.sqrt(k * n)), k))
    sub = x[::stride]
    if sub.shape[0] >= k:
        t = np.partition(sub, sub.shape[0] - k)[sub.shape[0] - k]
        if not np.isnan(t):
            cand = np.flatnonzero(x >= t)
            if cand.shape[0] >= k:          # fewer only when NaNs in the sample lowered t
                cv = x[cand]
                if cand.shape[0] > k:       # the k largest of the candidates, equal values by index
                    vk = np.partition(cv, cv.shape[0] - k)[cv.shape[0] - k]
                    above = np.flatnonzero(cv > vk)
                    keep = np.concatenate([above, np.flatnonzero(cv == vk)[:k - above.shape[0]]])
                    cand, cv = cand[keep], cv[keep]
                return cand[np.lexsort((cand, -cv))]
    return np.argsort(-x, kind="stable")[:k]


def top_k(logits, k):
    """(values, ids) of the k largest logits, descending, equal values by lower id (k <= 0: all of them)."""
    idx = top_ids(logits, logits.shape[0] if k <= 0 else k)
    return logits[idx], idx


def _softmax_f32(vals):
    e = np.exp((vals - vals[0]).astype(np.float32))
    return e / np.float32(e.sum(dtype=np.float32))


def top_p(vals, idx, p, min_keep=1):
    """keep the shortest descending prefix whose cumulative probability reaches p (>= min_keep)"""
    if p >= 1.0 or vals.shape[0] <= 1:
        return vals, idx
    probs = _softmax_f32(vals)
    cum = np.cumsum(probs, dtype=np.float32)
    hit = np.nonzero(cum >= np.float32(p))[0]
    last = int(hit[0]) + 1 if hit.size else vals.shape[0]
    last = max(last, min_keep)
    return vals[:last], idx[:last]


def min_p(vals, idx, p, min_keep=1):
    """keep logits >= max + log(p) (prob >= p * prob_max)"""
    if p <= 0.0 or vals.shape[0] <= 1:
        return vals, idx
    thr = np.float32(vals[0] + np.float32(math.log(p)))
    keep = vals >= thr
    nk = int(keep.sum())
    if nk < min_keep:
        return vals[:min_keep], idx[:min_keep]
    return vals[keep], idx[keep]          # vals are sorted, so keep is a prefix


def _checked(name, v, lo, hi, lo_open=False):
    """v in [lo, hi] ((lo, hi] with lo_open), finite: else ValueError naming the argument"""
    if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
        raise ValueError(f"{name} must be finite and in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return v


class Sampler:
    """Stateful sampler: seeded RNG and the penalty history.

    sample(logits) -> token id; it records the token in the history (llama.cpp's accept)."""

    def __init__(self, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                 penalty_last_n=64, frequency_penalty=0.0, presence_penalty=0.0, seed=None,
                 min_keep=1, penalty_scope="window"):
        if penalty_scope not in ("window", "generated"):
            raise ValueError(f"penalty_scope must be 'window' or 'generated', got {penalty_scope!r}")
        self.temperature = _checked("temperature", float(temperature), 0.0, math.inf)
        self.top_k = int(top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
        self.top_p = _checked("top_p", float(top_p), 0.0, 1.0, lo_open=True)
        self.min_p = _checked("min_p", float(min_p), 0.0, 1.0)
        self.repeat_penalty = _checked("repeat_penalty", float(repeat_penalty), 0.0, math.inf, lo_open=True)
        self.penalty_last_n = int(penalty_last_n)
        self.frequency_penalty = float(frequency_penalty)
        self.presence_penalty = float(presence_penalty)
        self.min_keep = max(1, int(min_keep))
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.penalty_scope = penalty_scope
        self.generated = collections.Counter()   # tokens sampled so far ("generated" scope)
        self.history = collections.deque(maxlen=max(self.penalty_last_n, 0) or None)
        if self.penalty_last_n == 0:
            self.history = collections.deque(maxlen=1)

    @property
    def greedy(self):
        return self.temperature <= 0.0

    def accept(self, token):
        if self.penalty_last_n != 0:
            self.history.append(int(token))

    def accept_prompt(self, ids: Iterable[int]):
        """feed the prompt into the penalty history (llama-completion does)"""
        for t in ids:
            self.accept(t)

    def _penalized(self, logits):
        if self.penalty_scope == "generated":
            if self.penalty_last_n != 0:
                logits = apply_penalties(logits, list(self.history), self.repeat_penalty)
            if self.generated and (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0):
                logits = _penalize_counts(logits, self.generated, 1.0, self.frequency_penalty,
                                          self.presence_penalty)
            return logits
        if self.penalty_last_n == 0:
            return logits
        return apply_penalties(logits, list(self.history), self.repeat_penalty, self.frequency_penalty,
                               self.presence_penalty)

    def sample(self, logits):
        logits = np.asarray(logits, dtype=np.float32).reshape(-1)
        lg = self._penalized(logits)
        if self.greedy:
            tok = int(np.argmax(lg))            # first index among equal maxima
        else:
            vals, idx = top_k(lg, self.top_k)
            vals, idx = top_p(vals, idx, self.top_p, self.min_keep)
            vals, idx = min_p(vals, idx, self.min_p, self.min_keep)
            vals = (vals / np.float32(self.temperature)).astype(np.float32)
            w = np.exp((vals - vals.max()).astype(np.float32)).astype(np.float64)
            cum = np.cumsum(w)
            u = self.rng.random() * cum[-1]
            i = int(np.searchsorted(cum, u, side="left"))
            tok = int(idx[min(i, idx.shape[0] - 1)])
        self.record(tok)
        return tok

    def record(self, token):
        """a sampled token's bookkeeping (sample() does it): the penalty history and the counts"""
        self.accept(token)
        self.generated[token] += 1

    def __repr__(self):
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, "
                f"min_p={self.min_p}, repeat_penalty={self.repeat_penalty}, "
                f"penalty_last_n={self.penalty_last_n}, seed={self.seed})")
