"""The hyperparameters of a GGUF decoder model: typed, range-checked reads of its metadata keys
(each error names the key, its value and the rule it breaks), then the architecture's own keys and
rules (the hparams hook of its module in cpufuse/llama/arch/, reading through `Keys`), and the
vocabulary size.

    gf = GGUFFile(path)
    hp = read_hparams(gf)            # HParams, or ValueError naming the key
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import arch as _arch

__all__ = ["HParams", "Keys", "SUPPORTED_ARCHS", "read_hparams", "MAX_N_CTX"]

SUPPORTED_ARCHS = _arch.SUPPORTED   # generated from the registry: one module each in cpufuse/llama/arch/

_MISSING = object()
MAX_LAYERS = 4096          # sane bounds on the architecture numbers (far above any released model)
MAX_DIM = 1 << 20
MAX_N_CTX = 1 << 24        # 16M cells: a KV cache beyond this is a mistake, not a model
MAX_EPS = 1.0


def _value(gf, key, default=_MISSING):
    if key in gf.kv:
        return gf.kv[key]
    if default is _MISSING:
        raise ValueError(f"GGUF is missing the required key {key}")
    return default


def _int_key(gf, key, default=_MISSING, lo=1, hi=MAX_DIM, n_layer=None):
    """an integer key in [lo, hi]; with n_layer, also a per-layer array of n_layer equal values"""
    if key not in gf.kv:
        return _value(gf, key, default)
    v = gf.kv[key]
    if n_layer is not None and isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu":
            raise ValueError(f"{key}: expected an integer or a per-layer integer array, found {gf.value_type(key)}")
        if v.shape != (n_layer,):
            raise ValueError(f"{key}: a per-layer array needs one value per layer (block_count = {n_layer}), "
                             f"found {v.size} values")
        vals = set(v.tolist())
        if len(vals) != 1:
            raise ValueError(f"{key}: per-layer values {sorted(vals)} are not supported (only uniform layers)")
        v = vals.pop()
    elif not gf.is_int(key):
        raise ValueError(f"{key} = {_short(v)}: expected an integer, found {gf.value_type(key)}")
    if not lo <= v <= hi:
        raise ValueError(f"{key} = {v}: must be in [{lo}, {hi}]")
    return int(v)


def _float_key(gf, key, default=_MISSING, hi=None, zero_ok=False):
    """a finite number > 0 (and <= hi); zero_ok: 0 is allowed (llama.cpp's 'not set')"""
    if key not in gf.kv:
        return _value(gf, key, default)
    v = gf.kv[key]
    if not gf.is_number(key):
        raise ValueError(f"{key} = {_short(v)}: expected a number, found {gf.value_type(key)}")
    v = float(v)
    shown = str(np.float32(v)) if gf.value_type(key) == "float32" else v   # as written: 1e-05, not 9.99...e-06
    if not (math.isfinite(v) and (v > 0 or zero_ok and v == 0)):
        raise ValueError(f"{key} = {shown}: must be finite and > 0{' (or 0: unset)' if zero_ok else ''}")
    if hi is not None and v > hi:
        raise ValueError(f"{key} = {shown}: must be <= {hi}")
    return v


def _str_key(gf, key, default=_MISSING):
    if key not in gf.kv:
        return _value(gf, key, default)
    v = gf.kv[key]
    if not isinstance(v, str):
        raise ValueError(f"{key} = {_short(v)}: expected a string, found {gf.value_type(key)}")
    return v


def _short(v):
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass
class HParams:
    """The hyperparameters read from the GGUF (docs/semantics.md §10) and decided at load."""
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    eps: float
    freq_base: float
    freq_scale: float = 1.0
    rope_mode: str = "norm"
    rope_scaling: str = "none"
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    n_ctx_orig: int = 0
    kq_scale: float = 0.0
    # values that architectures' keys set (cpufuse/llama/arch/*.py, which also read them in their
    # forwards); the defaults mean unset
    emb_scale: float = 0.0            # x = embedding * emb_scale when > 0 (gemma: sqrt(n_embd); granite)
    residual_scale: float = 0.0       # branch * residual_scale before the residual add when > 0 (granite)
    logit_scale: float = 0.0          # logits / logit_scale when > 0 (granite)
    attn_softcap: float = 0.0         # attention-logit softcap c*tanh(s/c) when > 0 (gemma2)
    final_softcap: float = 0.0        # final-logit softcap when > 0 (gemma2; gemma3 when the key is set)
    swa_window: int = 0               # sliding window of the SWA layers (0: none)
    swa_layers: tuple = ()            # per layer: True = sliding-window layer
    freq_base_swa: float = 10000.0    # RoPE base and scale of the SWA layers
    freq_scale_swa: float = 1.0
    nope_layers: tuple = ()           # per layer: True = no RoPE (smollm3)
    # mixtures of experts (arch/_moe.py reads their keys; 0: a dense model)
    n_expert: int = 0                 # experts per layer
    n_expert_used: int = 0            # experts each token is routed to (top-k)
    n_ff_exp: int = 0                 # an expert's feed-forward length
    n_ff_shexp: int = 0               # the shared expert's feed-forward length (0: none)
    expert_gating: str = "softmax"    # "softmax", "sigmoid" or "softmax_weight" (softmax over the top-k logits)
    expert_weights_norm: bool = False  # renormalise the k weights to sum 1 (norm_w)
    expert_weights_scale: float = 0.0  # multiply the k weights (0: unset)
    pooling_type: int = -1            # <arch>.pooling_type (embeddings: 0 none, 1 mean, 2 cls, 3 last, 4 rank); -1 unset

    def __post_init__(self):
        self.swa_layers = tuple(self.swa_layers) or (False,) * self.n_layer
        self.nope_layers = tuple(self.nope_layers) or (False,) * self.n_layer

    @classmethod
    def from_gguf(cls, gf, n_vocab):
        """Read and check the hyperparameters of a GGUFFile (n_vocab: decided by the caller).
        Each bad value raises ValueError naming the key, the value and the rule."""
        arch = _arch_name(gf)
        spec = _arch.get(arch)
        p = arch + "."
        n_layer = _int_key(gf, p + "block_count", hi=MAX_LAYERS)
        n_embd = _int_key(gf, p + "embedding_length")
        n_ff = _int_key(gf, p + "feed_forward_length", n_layer=n_layer)
        n_head = _int_key(gf, p + "attention.head_count", n_layer=n_layer)
        n_head_kv = _int_key(gf, p + "attention.head_count_kv", n_head, n_layer=n_layer)
        if n_head_kv > n_head or n_head % n_head_kv:
            raise ValueError(f"{p}attention.head_count_kv = {n_head_kv}: must divide attention.head_count = {n_head}")
        if p + "attention.key_length" in gf.kv:
            d_k = _int_key(gf, p + "attention.key_length")
        elif n_embd % n_head:
            raise ValueError(f"{p}embedding_length = {n_embd}: must be a multiple of attention.head_count = "
                             f"{n_head} (the head dim is n_embd / n_head when attention.key_length is absent)")
        else:
            d_k = n_embd // n_head
        d_v = _int_key(gf, p + "attention.value_length", d_k)
        if d_v != d_k:
            raise ValueError(f"{p}attention.value_length = {d_v}: must equal the key length {d_k} "
                             "(different K and V head dims are not supported)")
        n_rot = _int_key(gf, p + "rope.dimension_count", d_k, lo=2)
        if n_rot % 2 or n_rot > d_k:
            raise ValueError(f"{p}rope.dimension_count = {n_rot}: must be even and <= the head dim {d_k}")
        eps = _float_key(gf, p + "attention.layer_norm_rms_epsilon", hi=MAX_EPS)
        n_ctx_train = _int_key(gf, p + "context_length", hi=MAX_N_CTX)
        freq_base = _float_key(gf, p + "rope.freq_base", 10000.0)
        scaling = _str_key(gf, p + "rope.scaling.type", "linear")
        if scaling not in ("none", "linear", "yarn"):
            raise ValueError(f"{p}rope.scaling.type = {scaling!r}: supported are none, linear, yarn")
        k_factor = p + "rope.scaling.factor" if p + "rope.scaling.factor" in gf.kv else p + "rope.scale_linear"
        factor = _float_key(gf, k_factor, 0.0, zero_ok=True)   # 0 = unset, as in llama.cpp
        freq_scale = 1.0 / factor if factor else 1.0
        if scaling == "none":
            freq_scale = 1.0
        n_ctx_orig = _int_key(gf, p + "rope.scaling.original_context_length", n_ctx_train, hi=MAX_N_CTX)
        ext_factor = 1.0 if scaling == "yarn" else 0.0
        attn_factor = 1.0
        if ext_factor != 0.0:           # docs/semantics.md §10: the two 0.1·ln(factor) terms cancel
            fct = 1.0 / freq_scale
            a = 0.1 * math.log(fct) + 1.0 if fct > 1.0 else 1.0
            attn_factor = a * (1.0 / (1.0 + 0.1 * math.log(fct)))
        attn_factor *= _float_key(gf, p + "rope.scaling.attn_factor", 1.0)
        hp = cls(arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                 head_dim=d_k, n_rot=n_rot, n_vocab=n_vocab, n_ctx_train=n_ctx_train, eps=eps,
                 freq_base=freq_base, freq_scale=freq_scale, rope_mode=spec.rope,
                 rope_scaling=scaling, ext_factor=ext_factor, attn_factor=attn_factor,
                 n_ctx_orig=n_ctx_orig, kq_scale=1.0 / math.sqrt(d_k),
                 swa_layers=(False,) * n_layer, nope_layers=(False,) * n_layer,
                 pooling_type=_int_key(gf, p + "pooling_type", -1, lo=0, hi=4))
        if spec.hparams is not None:
            spec.hparams(Keys(gf, arch), hp)
        return hp


class Keys:
    """The typed, range-checked reads of one architecture's "<arch>.<suffix>" keys, for its
    hparams hook (cpufuse/llama/arch/*.py): each bad value raises ValueError naming the key."""
    MAX_LAYERS, MAX_N_CTX, MAX_DIM = MAX_LAYERS, MAX_N_CTX, MAX_DIM

    def __init__(self, gf, arch):
        self.gf, self.p = gf, arch + "."

    def key(self, suffix):
        return self.p + suffix

    def has(self, suffix):
        return self.p + suffix in self.gf.kv

    def value(self, suffix):
        return self.gf.kv[self.p + suffix]

    def type(self, suffix):
        return self.gf.value_type(self.p + suffix)

    def int(self, suffix, default=_MISSING, lo=1, hi=MAX_DIM):
        """an integer in [lo, hi] (default when absent; ValueError when absent without one)"""
        return _int_key(self.gf, self.p + suffix, default, lo=lo, hi=hi)

    def float(self, suffix, default=_MISSING, hi=None, zero_ok=False):
        """a finite number > 0 (<= hi; zero_ok: 0 allowed, llama.cpp's 'not set')"""
        return _float_key(self.gf, self.p + suffix, default, hi=hi, zero_ok=zero_ok)


def _arch_name(gf):
    arch = _str_key(gf, "general.architecture")
    _arch.get(arch)    # ValueError naming it and the supported ones
    return arch


def _vocab_size(gf):
    """n_vocab: the length of tokenizer.ggml.tokens (an array of strings), else token_embd's rows"""
    key = "tokenizer.ggml.tokens"
    if key in gf.kv:
        if gf.value_type(key) != "array[string]":
            raise ValueError(f"{key}: expected an array of strings, found {gf.value_type(key)}")
        n = len(gf.kv[key])
        if n < 1:
            raise ValueError(f"{key}: the vocabulary is empty")
        return n
    te = gf.tensors.get("token_embd.weight")
    if te is None:
        raise ValueError("GGUF has neither tokenizer.ggml.tokens nor the tensor token_embd.weight")
    return te.n_elements // te.ne[0]


def _check_special_ids(gf, n_vocab):
    """every tokenizer.ggml.*_token_id key: an integer in [0, n_vocab)"""
    from .tokenizer import special_token_id
    for key, v in gf.kv.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if not gf.is_int(key):
                raise ValueError(f"{key} = {_short(v)}: a special token id must be an integer, found "
                                 f"{gf.value_type(key)}")
            special_token_id(key, v, n_vocab)
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in gf.kv:
            v = gf.kv[key]
            if not (isinstance(v, np.ndarray) and v.dtype.kind in ("iu" if key.endswith("type") else "iuf")):
                raise ValueError(f"{key}: expected a numeric array, found {gf.value_type(key)}")
            if len(v) != n_vocab:
                raise ValueError(f"{key}: {len(v)} entries, expected one per token ({n_vocab})")


def read_hparams(gf):
    """The HParams of a GGUFFile: its architecture (refused unless supported), vocabulary size
    and special token ids checked, then every hyperparameter key."""
    _arch_name(gf)
    n_vocab = _vocab_size(gf)
    _check_special_ids(gf, n_vocab)
    return HParams.from_gguf(gf, n_vocab)

