"""Saved state: a sequence's KV cells and tokens as bytes or a file (docs/state.md).

    data = dump(model)                   # slot 0: its tokens and their K/V cells
    restore(model, data)                 # the same model (checked): continues bit for bit
    model.save_kv("s.cfkv"); model.load_kv("s.cfkv")
    st = llm.save_state(); ...; llm.load_state(st)      # llama-cpp-python's LlamaState

Format (little-endian): b"CFKV", u32 version (1), u64 header length, the header (UTF-8 JSON:
the model's identity and cache layout, n_tokens, kv_bytes), n_tokens int32 token ids, then the
cells as cpufuse.llama.kv.KVCache.read_slot writes them (layer by layer, K then V, in position
order; a sliding-window ring's last ring_cells positions).

A state file is untrusted input, read as the GGUF reader reads a model: every length is checked
against the bytes present before anything is allocated; the header must be a JSON object with
exactly the expected keys and types; the identity (a hash of the hyperparameters, the activation
mode, the RoPE mode and the token-embedding bytes), the cache layout (layers, heads, head size,
cell types, rings) and the vocabulary must be the loading model's; n_tokens fits its n_ctx; the
cells' size is what the layout needs; the token ids are in the vocabulary. Each violation is a
ValueError naming the field, what was expected and what was found.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct

import numpy as np

__all__ = ["dump", "restore", "identity", "LlamaState", "MAGIC", "VERSION"]

MAGIC = b"CFKV"
VERSION = 1
MAX_HEADER = 1 << 16
_HEAD = struct.Struct("<4sIQ")
_FIELDS = {"identity": str, "arch": str, "n_layer": int, "n_head_kv": int, "head_dim": int, "n_vocab": int,
           "type_k": str, "type_v": str, "ring_cells": int, "window": int, "n_tokens": int, "kv_bytes": int}


def identity(model):
    """a hex digest of what a sequence's cells depend on: the hyperparameters, the activation and
    RoPE modes, and the token-embedding table's first MiB (a different file of the same shape)"""
    h = getattr(model, "_state_identity", None)
    if h is None:
        d = hashlib.sha256()
        hp = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(model.hparams).items()}
        d.update(json.dumps([hp, model.act or "q8", bool(model.rope_ggml_compat)], sort_keys=True,
                            default=str).encode())
        te = np.ascontiguousarray(model.tok_embd.raw).reshape(-1).view(np.uint8)
        d.update(te[:1 << 20].tobytes())
        d.update(np.ascontiguousarray(model.output_norm, np.float32).tobytes())
        h = model._state_identity = d.hexdigest()
    return h


def _layout(model):
    kv = model.kv
    return {"identity": identity(model), "arch": model.hparams.arch, "n_layer": kv.n_layer,
            "n_head_kv": kv.n_head_kv, "head_dim": kv.head_dim, "n_vocab": model.n_vocab, "type_k": kv.type_k,
            "type_v": kv.type_v, "ring_cells": kv.ring_cells, "window": kv.window}


def dump(model, slot=0, tokens=None):
    """a slot's state as bytes (the format above): slot 0 of the Model's own API (its cached
    tokens), or `slot` holding exactly the evaluated `tokens`. Call under model._lock or on the
    thread that owns the slot."""
    if tokens is None:
        tokens = model._cached[:model._n_past]
    n = len(tokens)
    toks = np.asarray(tokens, "<i4")
    cells = model.kv.read_slot(slot, n)
    head = dict(_layout(model), n_tokens=n, kv_bytes=len(cells))
    hb = json.dumps(head, sort_keys=True).encode()
    return b"".join((_HEAD.pack(MAGIC, VERSION, len(hb)), hb, toks.tobytes(), cells))


def parse(model, data):
    """(token ids, cell bytes) of a state for `model`, every field checked (see the module
    docstring); nothing of the model changes"""
    buf = memoryview(data).cast("B")
    size = buf.nbytes
    if size < _HEAD.size:
        raise ValueError(f"KV state truncated: the header needs {_HEAD.size} bytes, the data has {size}")
    magic, version, hlen = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError(f"not a cpufuse KV state: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"KV state version {version} is not supported (expected {VERSION})")
    if hlen > min(MAX_HEADER, size - _HEAD.size):
        raise ValueError(f"KV state truncated or corrupt: a header of {hlen} bytes at offset {_HEAD.size}, but "
                         f"{size - _HEAD.size} bytes follow (at most {MAX_HEADER})")
    try:
        head = json.loads(bytes(buf[_HEAD.size:_HEAD.size + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"KV state header is not UTF-8 JSON: {e}") from None
    if not isinstance(head, dict) or set(head) != set(_FIELDS):
        got = sorted(head) if isinstance(head, dict) else type(head).__name__
        raise ValueError(f"KV state header: expected the keys {sorted(_FIELDS)}, got {got}")
    for k, t in _FIELDS.items():
        if not isinstance(head[k], t) or isinstance(head[k], bool):
            raise ValueError(f"KV state header: {k} must be of type {t.__name__}, got {head[k]!r}")
    own = _layout(model)
    if head["identity"] != own["identity"]:
        raise ValueError(f"KV state was saved from another model (or another act / rope mode): identity "
                         f"{head['identity'][:16]}..., this model's is {own['identity'][:16]}...")
    for k, v in own.items():
        if head[k] != v:
            raise ValueError(f"KV state header: {k} = {head[k]!r}, this model's is {v!r}")
    n = head["n_tokens"]
    if not 0 <= n <= model.n_ctx:
        raise ValueError(f"KV state header: n_tokens = {n}, expected 0..n_ctx = {model.n_ctx}")
    need = model.kv.slot_nbytes(n)
    if head["kv_bytes"] != need:
        raise ValueError(f"KV state header: kv_bytes = {head['kv_bytes']}, {n} tokens need {need}")
    off = _HEAD.size + hlen
    if size != off + 4 * n + need:
        raise ValueError(f"KV state truncated or too long: {size} bytes, expected {off + 4 * n + need} "
                         f"({n} token ids and {need} bytes of cells after the header)")
    toks = np.frombuffer(buf, "<i4", n, off).astype(np.int64)
    if n and not (toks.min() >= 0 and toks.max() < model.n_vocab):
        bad = int(toks[(toks < 0) | (toks >= model.n_vocab)][0])
        raise ValueError(f"KV state: token id {bad} out of range [0, {model.n_vocab})")
    return toks.tolist(), buf[off + 4 * n:]


def restore(model, data, slot=None):
    """Put a state made by dump() (checked by parse) into slot 0 of the Model's own API (slot
    None: the model then holds its tokens and continues from them bit for bit; call under
    model._lock), or into KV slot `slot` (its owner keeps the tokens). Returns the token ids."""
    toks, cells = parse(model, data)
    if slot is not None:
        model.kv.write_slot(slot, len(toks), cells)
        return toks
    model.reset()
    model.kv.write_slot(0, len(toks), cells)
    model._n_past, model._cached[:] = len(toks), toks
    return toks


def save_file(model, path, data=None):
    """write dump(model) (or data) to path, through a temporary file; returns the bytes written"""
    data = dump(model) if data is None else data
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def load_file(model, path, slot=None):
    """restore() from a file (read up to the largest valid size for this model + 1 byte, so an
    overlong file is refused without reading it all); returns the token ids restored"""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"KV state file not found: {path}")
    if not os.path.isfile(path):
        raise ValueError(f"KV state {path}: not a regular file")
    with open(path, "rb") as f:
        data = f.read(_HEAD.size + MAX_HEADER + 4 * model.n_ctx + model.kv.slot_nbytes(model.n_ctx) + 1)
    return restore(model, data, slot)


class LlamaState:
    """llama-cpp-python's LlamaState: input_ids (int array), scores (the last token's logits as a
    (1, n_vocab) float32 array, or (0, n_vocab) before any), n_tokens, llama_state (bytes: the
    format above), llama_state_size, seed"""

    def __init__(self, input_ids, scores, n_tokens, llama_state, llama_state_size, seed):
        self.input_ids, self.scores, self.n_tokens = input_ids, scores, n_tokens
        self.llama_state, self.llama_state_size, self.seed = llama_state, llama_state_size, seed

    def __repr__(self):
        return f"LlamaState(n_tokens={self.n_tokens}, llama_state_size={self.llama_state_size})"


def llama_sample(llm, last_logits, temp, top_k, top_p, min_p, repeat_penalty, frequency_penalty,
                 presence_penalty, seed):
    """Llama.sample's work: a token from the last eval's logits with cpufuse's sampler chain, the
    penalties over the last 64 input ids"""
    from .sampling import Sampler
    if last_logits is None:
        raise RuntimeError("sample: nothing evaluated yet (call eval(tokens) first)")
    s = Sampler(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, penalty_last_n=64, seed=seed)
    s.accept_prompt(llm.model._cached[-64:])
    return s.sample(last_logits)


def llama_save(llm, last_logits, seed):
    m = llm.model
    with m._lock:
        data = dump(m)
        ids = np.array(m._cached, np.intc)
    scores = (np.zeros((0, m.n_vocab), np.float32) if last_logits is None
              else np.asarray(last_logits, np.float32).reshape(1, -1).copy())
    return LlamaState(ids, scores, len(ids), data, len(data), seed)


def llama_load(llm, state):
    """(the restored last logits or None, the seed) of a LlamaState"""
    if not isinstance(state, LlamaState):
        raise TypeError(f"state must be a LlamaState (from save_state), got {type(state).__name__}")
    m = llm.model
    with m._lock:
        m._epoch += 1
        restore(m, state.llama_state)
        if list(np.asarray(state.input_ids).reshape(-1)) != m._cached or state.n_tokens != len(m._cached):
            m.reset()
            raise ValueError("state: input_ids / n_tokens do not match the state's own tokens")
    sc = np.asarray(state.scores, np.float32)
    return (sc[-1].copy() if sc.ndim == 2 and sc.shape[0] and sc.shape[1] == m.n_vocab else None), state.seed
