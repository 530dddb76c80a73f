"""Embeddings: the final hidden states (after output_norm) of a decoder model, pooled
(docs/embeddings.md).

    from cpufuse.llama.embedding import embed_ids
    v = embed_ids(model, ids, pooling="mean", normalize=2)    # (n_embd,) float32
    h = embed_ids(model, ids, pooling="none")                 # (len(ids), n_embd): one per token

The hidden states come from the decoder graph built with hidden=True (cpufuse.llama.decoder.build:
the rows' output_norm output instead of their logits), in micro-batches of n_batch tokens on slot 0
of a fresh cache. Pooling, as llama.cpp's LLAMA_POOLING_TYPE_*:
    none (0)  every token's vector          mean (1)  their mean
    cls  (2)  the first token's             last (3)  the last token's
    rank (4)  a reranker's score: needs a classification head, which no supported architecture
              loads (NotImplementedError)
A model's default is its GGUF `<arch>.pooling_type`, and "none" without one (llama.cpp's rule).
Normalization, as llama.cpp's common_embd_normalize: -1 none, 0 max-abs scaled to int16 range,
1 taxicab, 2 euclidean (L2), p > 2 the p-norm. llama-server's /v1/embeddings uses 2;
llama-cpp-python's embed() and create_embedding() use none unless normalize=True (L2).
"""
from __future__ import annotations

import numbers

import numpy as np

from .decoder import Batch

__all__ = ["POOLING", "pooling_name", "embed_ids", "normalize", "pooled", "slot_hidden", "llama_embed"]

POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
_NAMES = {v: k for k, v in POOLING.items()}


def pooling_name(pooling, model):
    """the pooling a `pooling` argument means: None or -1 (llama.cpp's UNSPECIFIED) -> the model's
    pooling_type ("none" when the file has none); a name or a LLAMA_POOLING_TYPE_* integer"""
    if pooling is None or (isinstance(pooling, numbers.Integral) and not isinstance(pooling, bool) and pooling == -1):
        pooling = model.hparams.pooling_type
        if pooling == -1:
            return "none"
    if isinstance(pooling, numbers.Integral) and not isinstance(pooling, bool) and int(pooling) in _NAMES:
        pooling = _NAMES[int(pooling)]
    if pooling not in POOLING:
        raise ValueError(f"pooling must be one of {', '.join(POOLING)} (or -1..4, llama.cpp's "
                         f"LLAMA_POOLING_TYPE_*), got {pooling!r}")
    if pooling == "rank":
        raise NotImplementedError("rank pooling (reranking) needs a classification head (cls.weight / "
                                  "cls.output.weight); cpufuse runs decoder models without one")
    return pooling


def normalize(v, norm=2):
    """llama.cpp's common_embd_normalize of the rows of `v` (float32 in and out; float64 sums):
    -1 none, 0 max-abs scaled to 32760, 1 taxicab, 2 euclidean, p > 2 the p-norm. A zero
    vector stays zero."""
    if isinstance(norm, bool) or not isinstance(norm, numbers.Integral) or norm < -1:
        raise ValueError(f"normalize must be an integer >= -1 (-1 none, 0 max-abs, 1 taxicab, 2 euclidean, "
                         f"p > 2 p-norm), got {norm!r}")
    if norm == -1:
        return v
    x = np.asarray(v, np.float64)
    if norm == 0:
        s = np.max(np.abs(x), axis=-1, keepdims=True) / 32760.0
    elif norm == 2:
        s = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    else:
        s = np.sum(np.abs(x) ** norm, axis=-1, keepdims=True) ** (1.0 / norm)
    s = np.where(s > 0, s, 1.0)
    return (x / s).astype(np.float32)


def slot_hidden(model, slot, ids, rows):
    """(len(rows), n_embd) float32: the hidden states after output_norm of positions `rows`
    (ascending) of the sequence `ids`, evaluated from position 0 in KV slot `slot` in micro-batches
    of n_batch. Only the slot's cells change (the caller owns them, and the model's bookkeeping)."""
    B = model.n_batch
    out = np.empty((len(rows), model.hparams.n_embd), np.float32)
    rows = np.asarray(rows, np.int64)
    k = 0
    for s in range(0, len(ids), B):
        chunk = ids[s:s + B]
        want = rows[(rows >= s) & (rows < s + len(chunk))]
        b = Batch(model)
        b.add(slot, chunk, s, logits=False)
        b.idx = [int(r - s) for r in want] or [len(chunk) - 1]
        h = b.run(model.decoder, (B, B, 1), n_threads=model.n_threads, hidden=True)
        out[k:k + len(want)] = h[:len(want)]
        k += len(want)
    return out


def pooled(model, slot, ids, pooling, norm):
    """the embedding of `ids` (checked, non-empty, <= n_ctx) evaluated in slot `slot`: pooling is a
    name of POOLING (not rank); see embed_ids"""
    rows = {"none": range(len(ids)), "mean": range(len(ids)), "cls": [0], "last": [len(ids) - 1]}[pooling]
    h = slot_hidden(model, slot, ids, list(rows))
    if pooling == "mean":
        h = h.astype(np.float64).mean(axis=0).astype(np.float32)
    elif pooling != "none":
        h = h[0]
    return normalize(h, norm)


def embed_ids(model, ids, pooling=None, norm=-1):
    """The embedding of the token ids `ids` (checked here), evaluated on slot 0 of a fresh cache
    (which then holds ids): (n_embd,) float32 pooled, or (len(ids), n_embd) with pooling "none";
    normalized with `norm` (see normalize)."""
    ids = model.token_ids(ids, "ids")
    if not ids:
        raise ValueError("embedding: no tokens to embed")
    if len(ids) > model.n_ctx:
        raise ValueError(f"context overflow: {len(ids)} tokens > n_ctx = {model.n_ctx}")
    pooling = pooling_name(pooling, model)
    normalize(np.zeros(1), norm)            # checks norm before anything runs
    with model._lock:
        model._epoch += 1
        model.reset()
        v = pooled(model, 0, ids, pooling, norm)
        model._n_past, model._cached[:] = len(ids), ids
    return v


def llama_embed(model, pooling, inputs, norm, truncate, tokenize):
    """Llama.embed's work: (a list with one embedding per input, as lists of floats, the token
    count). `inputs`: a str or a list of str; each is tokenized with tokenize(bytes) and, with
    truncate, cut to n_batch tokens (llama-cpp-python's rule); longer inputs are refused."""
    one = isinstance(inputs, str)
    texts = [inputs] if one else inputs
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"input must be a str or a non-empty list of str, got {type(inputs).__name__}")
    out, total = [], 0
    for text in texts:
        ids = tokenize(text.encode("utf-8"))
        if truncate:
            ids = ids[:model.n_batch]
        elif len(ids) > model.n_batch:
            raise ValueError(f"Requested tokens ({len(ids)}) exceed batch size of {model.n_batch}")
        total += len(ids)
        out.append(embed_ids(model, ids, pooling, norm).tolist())
    model.reset()
    return (out[0] if one else out), total
