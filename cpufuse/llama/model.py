"""A GGUF decoder model (llama, qwen2, qwen3, gemma3, gemma2, phi3, smollm3, granite) on cpufuse's
fused kernels (docs/semantics.md §10, docs/architectures.md).

    from cpufuse.llama import Model
    m = Model.load("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048, n_threads=2)
    r = m.generate([{"role": "user", "content": "Hi!"}], max_tokens=64, temperature=0)
    print(r.text, r.prompt_tps, r.decode_tps)
    for piece in m.generate("Once upon a time", stream=True): print(piece, end="")
    lg = m.logits(m.tokenize("Hello"))          # (n_tokens, n_vocab) float32, from an empty cache

The GGUF is read by cpufuse's own reader (`cpufuse.llama.gguf_file`: every length, offset and
size checked against the file before it is mapped), then memory-mapped, and every weight stays in
its file bytes as a `cpufuse.QTensor`; nothing is dequantized except the token-embedding rows a
batch needs. The hyperparameters and tensor shapes are checked against each other at load.

Threads: one Model serializes its calls. generate(), eval(), logits() and reset() calls
from several threads take turns on an internal lock (a call waits while another
runs), so each returns what it would have returned alone. A stream (generate(stream=True)) holds
the lock only while it computes a token, never between tokens: a stream that is closed or simply
dropped leaves the model usable, and a stream resumed after another call changed the KV cache
raises RuntimeError instead of continuing from someone else's cache.

Forward pass: the decoder graph (`cpufuse.llama.decoder`, one builder per architecture) for a
batch of tokens, compiled once per capacity as a cpufuse.graph.DynamicPlan: a prompt micro-batch
(up to n_batch tokens) and a decode step are each ONE C call, whatever their length. Per layer:
    q, k, v = matmul_multi(norm(x), Wq, Wk, Wv)   RMS_NORM fused into the matmul's prologue
    rope(q), rope(k) -> K cells; v -> V cells      f16 cache writes (kv_write)
    a = attention per sequence over its own cells  (attn_seqs: flash_attn, causal)
    x = x + a Wo;  x = x + swiglu(norm(x)) Wd      gate/up + SiLU*mul fused
then the logits of the rows wanted: matmul(norm(x[rows]), Whead) (Whead = token_embd when tied).
CPUFUSE_DISABLE_FUSION=1 or Model.load(fusion=False) keeps every node a separate kernel.

Weights: Model.load(repack=True, the default) lays each quantized weight out in cpufuse's P16
panels for the kernels (QTensor.repack; the same results bit for bit) and drops the file pages it
read from the process's memory, so RSS stays near the file size; repack=False keeps the mapping.
KV cache: n_seq slots of n_ctx cells (k_cache[l] is (n_seq * n_ctx, n_kv_heads, head_dim)); the
generate/eval API uses slot 0, the server (cpufuse.serve.batch) all of them. Sliding-window layers
(gemma) keep a ring of window + n_batch cells per slot instead (docs/architectures.md).

Architectures: llama (RoPE NORM), qwen2 (Q/K/V biases, RoPE NEOX), qwen3 (per-head Q/K RMSNorm,
NEOX), gemma3, gemma2, phi3, smollm3, granite (docs/architectures.md). Anything else is refused
with a ValueError naming the architecture.
"""
from __future__ import annotations

import math
import numbers
import operator
import os
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from cpufuse import _dispatch
from cpufuse.quant.types import QTensor, dequantize

from .decoder import Batch, Decoder

__all__ = ["Model", "HParams", "GenerationResult", "SUPPORTED_ARCHS"]

F32 = np.float32
F16 = np.float16
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gemma2", "phi3", "smollm3", "granite")
_ROPE_MODE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox", "gemma2": "neox",
              "phi3": "neox", "smollm3": "norm", "granite": "norm"}
_GEMMA = ("gemma2", "gemma3")
_SMOLLM3_NOPE_STEP = 4     # llama.cpp's n_no_rope_layer_step for smollm3 (no GGUF key)
DEFAULT_N_CTX = 2048
DEFAULT_N_BATCH = 512
MAX_N_SEQ = 1024           # KV slots
SWA_RINGS = True           # sliding-window layers keep rings of window + n_batch cells (False: full
                           # caches, the same results bit for bit; tests and benchmarks compare)


# ------------------------------------------------------------------------------------------------
# metadata: typed, range-checked reads of the GGUF keys (each error names the key, its value and
# the rule it breaks)

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
    # the per-architecture parts (docs/architectures.md); the defaults are llama's
    qk_norm: bool = False             # per-head Q/K RMSNorm before RoPE (qwen3, gemma3)
    post_norms: bool = False          # RMSNorm of each branch output before its residual add (gemma)
    ffn_act: str = "silu"             # the gate activation: "silu" (SwiGLU) or "gelu" (GEGLU, tanh form)
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

    def __post_init__(self):
        self.swa_layers = tuple(self.swa_layers) or (False,) * self.n_layer
        self.nope_layers = tuple(self.nope_layers) or (False,) * self.n_layer

    @classmethod
    def from_gguf(cls, gf, n_vocab):
        """Read and check the hyperparameters of a GGUFFile (n_vocab: decided by the caller).
        Each bad value raises ValueError naming the key, the value and the rule."""
        arch = _arch(gf)
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
        if arch == "llama" and n_rot != d_k:
            raise ValueError(f"{p}rope.dimension_count = {n_rot}: must equal the head dim {d_k} for llama "
                             "(llama.cpp rejects this too)")
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
                 freq_base=freq_base, freq_scale=freq_scale, rope_mode=_ROPE_MODE[arch],
                 rope_scaling=scaling, ext_factor=ext_factor, attn_factor=attn_factor,
                 n_ctx_orig=n_ctx_orig, kq_scale=1.0 / math.sqrt(d_k),
                 swa_layers=(False,) * n_layer, nope_layers=(False,) * n_layer)
        _arch_hparams(gf, hp)
        return hp


def _arch_hparams(gf, hp):
    """The architecture-specific keys and rules (as llama.cpp's load_hparams reads them)."""
    arch, p, L = hp.arch, hp.arch + ".", hp.n_layer
    hp.qk_norm = arch in ("qwen3", "gemma3")
    if arch in _GEMMA:
        hp.post_norms, hp.ffn_act = True, "gelu"
        hp.emb_scale = float(np.sqrt(np.float32(hp.n_embd)))   # llama.cpp: sqrtf(n_embd), f32
        # q scale: 1/sqrt(key_length), except the 27B sizes (gemma2 46 layers, gemma3 62) which use
        # 1/sqrt(n_embd / n_head)
        big = (arch == "gemma2" and L == 46) or (arch == "gemma3" and L == 62)
        hp.kq_scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head if big else hp.head_dim)
        hp.final_softcap = _float_key(gf, p + "final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0,
                                      zero_ok=True)
        if arch == "gemma2":
            hp.attn_softcap = _float_key(gf, p + "attn_logit_softcapping", 50.0, zero_ok=True)
            window = _int_key(gf, p + "attention.sliding_window", 4096, lo=0, hi=MAX_N_CTX)
            pattern = 2
            hp.freq_base_swa = _float_key(gf, p + "rope.freq_base_swa", hp.freq_base)
            hp.freq_scale_swa = hp.freq_scale
        else:
            window = _int_key(gf, p + "attention.sliding_window", 0, lo=0, hi=MAX_N_CTX)
            pattern = 6
            hp.freq_base_swa = _float_key(gf, p + "rope.freq_base_swa", 10000.0)
            hp.freq_scale_swa = 1.0
        key = p + "attention.sliding_window_pattern"
        if key in gf.kv:
            v = gf.kv[key]
            if isinstance(v, np.ndarray):
                if v.shape != (L,) or v.dtype.kind not in "biu":
                    raise ValueError(f"{key}: a per-layer array needs one bool per layer (block_count = {L}), "
                                     f"found {gf.value_type(key)} of {v.size}")
                swa = tuple(bool(b) for b in v.tolist())
            else:
                pattern = _int_key(gf, key, lo=0, hi=MAX_LAYERS)
                swa = None
        else:
            swa = None
        if swa is None:   # llama.cpp set_swa_pattern(n): layer il is SWA iff il % n < n - 1 (n = 0: all)
            swa = tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(L))
        if window > 0:
            hp.swa_window, hp.swa_layers = window, swa
    elif arch == "granite":
        hp.emb_scale = _float_key(gf, p + "embedding_scale", 0.0, zero_ok=True)
        hp.residual_scale = _float_key(gf, p + "residual_scale", 0.0, zero_ok=True)
        hp.logit_scale = _float_key(gf, p + "logit_scale", 0.0, zero_ok=True)
        a = _float_key(gf, p + "attention.scale", 0.0, zero_ok=True)
        if a:
            hp.kq_scale = a
    elif arch == "smollm3":
        hp.nope_layers = tuple((il + 1) % _SMOLLM3_NOPE_STEP == 0 for il in range(L))


def _arch(gf):
    arch = _str_key(gf, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"architecture {arch!r} is not supported by cpufuse.llama "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")
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


def _int_arg(v, name, lo, hi):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return int(v)


# the address alignment a weight's bytes need: f32 elements 4, f16/bf16 elements and the f16 block
# scales of quantized types 2. A GGUF with general.alignment < 4 can place a tensor off it; such a
# tensor is copied (once, at load) rather than handed to the kernels misaligned.
_ADDR_ALIGN = {"F32": 4}


def _aligned_bytes(t):
    a = t.data
    if a.ctypes.data % _ADDR_ALIGN.get(t.type_name, 2):
        a = np.require(a.copy(), requirements="A")
    return a


def _weight(t, shape):
    """The 2-D weight `t` (ne = [n_in, n_out]) as a QTensor over its bytes in the mapped file,
    checked against the expected (n_out, n_in). The one place a weight becomes a QTensor (a
    load-time layout change, such as repacking, belongs here)."""
    n_out, n_in = shape
    if t.ne != (n_in, n_out):
        raise ValueError(f"tensor {t.name}: ne = {list(t.ne)}, expected [{n_in}, {n_out}] "
                         f"(numpy shape ({n_out}, {n_in}) = (n_out, n_in))")
    try:
        return QTensor(_aligned_bytes(t), t.type_id, (n_out, n_in))
    except NotImplementedError as e:
        raise NotImplementedError(f"tensor {t.name}: {e}") from None


def _vector(t, n):
    """the 1-D tensor `t` of n elements as a new float32 array"""
    if t.n_elements != n or t.ne[0] != n:
        raise ValueError(f"tensor {t.name}: ne = {list(t.ne)}, expected [{n}]")
    try:
        a = dequantize(t.data, t.type_id, n)
    except NotImplementedError as e:
        raise NotImplementedError(f"tensor {t.name}: {e}") from None
    return np.ascontiguousarray(a.reshape(n), dtype=F32)


class _Layer:
    __slots__ = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo", "q_norm", "k_norm",
                 "ffn_norm", "wg", "wu", "wd", "bd", "post_attn_norm", "post_ffn_norm")


@dataclass
class GenerationResult:
    """What `Model.generate(..., stream=False)` returns."""
    tokens: List[int]                 # generated ids (without the stopping EOG token)
    text: str
    prompt_tokens: int                # prompt length
    prompt_eval_tokens: int           # prompt tokens actually evaluated (after cache reuse)
    prompt_time: float                # seconds
    decode_tokens: int                # single-token decode steps
    decode_time: float
    stop_reason: str                  # "eog" | "length" | "context" | "stop" (a stop string)
    stop_token: Optional[int] = None
    prompt_ids: List[int] = field(default_factory=list)
    tool_calls: Optional[List[dict]] = None    # generate(tools=...): the calls parsed from the text

    @property
    def prompt_tps(self):
        return self.prompt_eval_tokens / self.prompt_time if self.prompt_time > 0 else float("nan")

    @property
    def decode_tps(self):
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else float("nan")

    def timings(self):
        return {"prompt_tokens": self.prompt_eval_tokens, "prompt_s": self.prompt_time,
                "prompt_tps": self.prompt_tps, "decode_tokens": self.decode_tokens,
                "decode_s": self.decode_time, "decode_tps": self.decode_tps}

    def __str__(self):
        return self.text


class _Streamer:
    """Iterator of text pieces; `.result` holds the GenerationResult once exhausted."""

    def __init__(self, gen):
        self._gen = gen
        self.result = None

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._gen)
        except StopIteration as e:
            self.result = e.value
            raise StopIteration from None

    def close(self):
        self._gen.close()


# ------------------------------------------------------------------------------------------------

class Model:
    """A loaded GGUF model with its KV cache (one sequence). Calls from several threads are
    serialized (see the module docstring); a paused stream is invalidated by any other call."""

    def __init__(self):
        raise TypeError("use Model.load(path, ...)")

    # -------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, path, n_ctx=DEFAULT_N_CTX, n_threads=None, kv_dtype="f16", act=None,
             n_batch=DEFAULT_N_BATCH, rope_ggml_compat=False, isa=None, repack=True, fusion=None, n_seq=1,
             progress=None):
        """Memory-map the GGUF at `path` and prepare a KV cache of n_ctx cells per sequence.

        n_ctx: the context size (KV cells); 0 or None = the model's context_length.
        n_threads: threads for every kernel (None: cpufuse's default, see cpufuse.set_num_threads).
        kv_dtype: "f16" (llama.cpp's default) or "f32". act: the matmul activation mode, "q8"
        (default, as llama.cpp) or "f32" (exact f32 activations). n_batch: the largest micro-batch
        a prompt is processed in (longer prompts are split). rope_ggml_compat: use ggml's f32
        angle chain (bit-compatible with llama.cpp) instead of cpufuse's float64 angles.
        isa: force a cpufuse ISA for every kernel (None = auto). repack: lay the quantized
        weights out for the kernels (QTensor.repack: P16 panels, the same results bit for bit) and
        release the file pages they were read from; False keeps them in the memory-mapped file.
        fusion: False (or CPUFUSE_DISABLE_FUSION=1 with None) runs every op of the decoder graph as
        its own kernel. n_seq: KV slots (sequences held at once; the server's --parallel).
        progress: None, or a callable(done, total) called as the weights are repacked, layer by
        layer (the CLI draws its progress line with it).

        The file is read with cpufuse's own GGUF reader (cpufuse.llama.gguf_file), which checks
        its layout before mapping it; then the hyperparameters and every tensor's shape are
        checked against each other. Bad files and arguments raise ValueError (NotImplementedError
        for a weight type or tokenizer cpufuse does not support) naming the key or tensor."""
        from .gguf_file import GGUFFile

        if kv_dtype not in ("f16", "f32"):
            raise ValueError(f"kv_dtype must be 'f16' or 'f32', got {kv_dtype!r}")
        if act not in (None, "q8", "f32"):
            raise ValueError(f"act must be None, 'q8' or 'f32', got {act!r}")
        n_threads = None if n_threads is None else _dispatch._check_threads(n_threads, "n_threads")
        if isa is not None:
            _dispatch.check_isa(isa)
        n_ctx = 0 if n_ctx is None else _int_arg(n_ctx, "n_ctx", 0, MAX_N_CTX)
        n_batch = _int_arg(n_batch, "n_batch", 1, MAX_N_CTX)
        n_seq = _int_arg(n_seq, "n_seq", 1, MAX_N_SEQ)
        if fusion is not None and not isinstance(fusion, (bool, np.bool_)):
            raise TypeError(f"fusion must be None, True or False, got {type(fusion).__name__}")

        self = object.__new__(cls)
        path = os.fspath(path)
        gf = GGUFFile(path)
        self.path = path
        self.act, self.isa, self.kv_dtype = act, isa, kv_dtype
        self.rope_ggml_compat = bool(rope_ggml_compat)
        self.n_threads = n_threads
        _arch(gf)
        n_vocab = _vocab_size(gf)
        _check_special_ids(gf, n_vocab)
        hp = self.hparams = HParams.from_gguf(gf, n_vocab)
        self.n_ctx = n_ctx = n_ctx or hp.n_ctx_train
        if n_ctx * n_seq > MAX_N_CTX:
            raise ValueError(f"n_ctx * n_seq must be <= {MAX_N_CTX} KV cells, got {n_ctx} * {n_seq}")
        self.n_seq = n_seq
        self.n_batch = min(n_batch, n_ctx)
        self._load_weights(gf)
        self.repacked = bool(repack)
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be None or a callable(done, total), got {type(progress).__name__}")
        if repack:
            self._repack(gf, progress)

        # tokenizer (built from the same file's metadata)
        self._tokenizer = None
        self._tokenizer_error = None
        try:
            from .tokenizer import Tokenizer
            self._tokenizer = Tokenizer(gf)
        except (ValueError, NotImplementedError, ImportError) as e:   # a model without (supported)
            self._tokenizer_error = e                                  # tokenizer metadata runs on ids
        self._max_text = None if self._tokenizer is None else n_ctx * self._tokenizer.max_piece_bytes

        self._rope_kw = dict(n_dims=hp.n_rot, mode=hp.rope_mode, freq_base=hp.freq_base,
                             freq_scale=hp.freq_scale, ext_factor=hp.ext_factor, attn_factor=hp.attn_factor,
                             n_ctx_orig=hp.n_ctx_orig, freq_factors=self.rope_freqs,
                             ggml_compat=self.rope_ggml_compat, isa=isa, n_threads=self.n_threads)
        self.decoder = Decoder(self, fusion=fusion, isa=isa)
        # Keep no reference to the parsed metadata (the vocabulary's strings, tens of MB on a large
        # vocab): the weights are views of the file's memory map, which keeps it alive; the
        # tokenizer has its copy. gguf_version/alignment/data_offset stay for inspection.
        self.gguf_version, self.gguf_alignment = gf.version, gf.alignment
        self._lock = threading.RLock()   # every call that touches the KV cache or the buffers
        self._epoch = 0                  # bumped by every such call: a paused stream checks it
        self._alloc()
        self.reset()
        return self

    def _load_weights(self, gf):
        """Every tensor the forward pass reads, checked against the hyperparameters: 2-D weights as
        QTensor views of the mapped file (`_weight`), 1-D vectors as float32 copies (`_vector`).
        A tensor the architecture does not use is ignored."""
        hp = self.hparams
        tensors = gf.tensors

        def qt(name, shape, required=True):
            t = tensors.get(name)
            if t is None:
                if required:
                    raise ValueError(f"GGUF is missing the tensor {name}")
                return None
            return _weight(t, shape)

        def vec(name, n, required=True):
            t = tensors.get(name)
            if t is None:
                if required:
                    raise ValueError(f"GGUF is missing the tensor {name}")
                return None
            return _vector(t, n)

        E, H, Hkv, D, FF, V = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab
        self.tok_embd = qt("token_embd.weight", (V, E))
        self.output_norm = vec("output_norm.weight", E)
        self.output = qt("output.weight", (V, E), required=False)
        self.tied = self.output is None
        if self.tied:
            self.output = self.tok_embd
        self.output_bias = vec("output.bias", V, required=False)
        self.n_logits = self.output.n_out
        self.rope_freqs = vec("rope_freqs.weight", hp.n_rot // 2, required=False)
        if hp.arch == "phi3" and "rope_factors_long.weight" in tensors:
            # LongRoPE: per-dimension frequency factors, the long ones when the context exceeds the
            # original one (llama.cpp build_rope_factors: n_ctx_per_seq > n_ctx_orig_yarn)
            which = "long" if self.n_ctx > hp.n_ctx_orig else "short"
            self.rope_freqs = vec(f"rope_factors_{which}.weight", hp.n_rot // 2)

        layers = []
        for i in range(hp.n_layer):
            b = f"blk.{i}."
            L = _Layer()
            L.attn_norm = vec(b + "attn_norm.weight", E)
            if b + "attn_qkv.weight" in tensors:   # fused QKV: three row ranges of one tensor
                w = qt(b + "attn_qkv.weight", ((H + 2 * Hkv) * D, E))
                raw = w.raw
                L.wq = QTensor(raw[:H * D], w.qtype, (H * D, E))
                L.wk = QTensor(raw[H * D:(H + Hkv) * D], w.qtype, (Hkv * D, E))
                L.wv = QTensor(raw[(H + Hkv) * D:], w.qtype, (Hkv * D, E))
                bqkv = vec(b + "attn_qkv.bias", (H + 2 * Hkv) * D, required=False)
                if bqkv is not None:
                    L.bq, L.bk, L.bv = bqkv[:H * D], bqkv[H * D:(H + Hkv) * D], bqkv[(H + Hkv) * D:]
                else:
                    L.bq = L.bk = L.bv = None
            else:
                L.wq = qt(b + "attn_q.weight", (H * D, E))
                L.wk = qt(b + "attn_k.weight", (Hkv * D, E))
                L.wv = qt(b + "attn_v.weight", (Hkv * D, E))
                L.bq = vec(b + "attn_q.bias", H * D, required=False)
                L.bk = vec(b + "attn_k.bias", Hkv * D, required=False)
                L.bv = vec(b + "attn_v.bias", Hkv * D, required=False)
            L.wo = qt(b + "attn_output.weight", (E, H * D))
            L.bo = vec(b + "attn_output.bias", E, required=False)
            if hp.qk_norm:
                L.q_norm = vec(b + "attn_q_norm.weight", D)
                L.k_norm = vec(b + "attn_k_norm.weight", D)
            else:
                L.q_norm = L.k_norm = None
            L.ffn_norm = vec(b + "ffn_norm.weight", E)
            if hp.post_norms:   # gemma: the branch outputs' norms (weights with the +1 already in)
                L.post_attn_norm = vec(b + "post_attention_norm.weight", E)
                L.post_ffn_norm = vec(b + "post_ffw_norm.weight", E)
            else:
                L.post_attn_norm = L.post_ffn_norm = None
            if b + "ffn_gate.weight" not in tensors and b + "ffn_up.weight" in tensors and \
                    tensors[b + "ffn_up.weight"].ne == (E, 2 * FF):
                # phi3: one ffn_up of 2*n_ff rows, the gate first (llama.cpp LLM_FFN_SWIGLU on the halves)
                w = qt(b + "ffn_up.weight", (2 * FF, E))
                L.wg = QTensor(w.raw[:FF], w.qtype, (FF, E))
                L.wu = QTensor(w.raw[FF:], w.qtype, (FF, E))
            else:
                L.wg = qt(b + "ffn_gate.weight", (FF, E))
                L.wu = qt(b + "ffn_up.weight", (FF, E))
            L.wd = qt(b + "ffn_down.weight", (E, FF))
            L.bd = vec(b + "ffn_down.bias", E, required=False)
            for nm in ("ffn_gate.bias", "ffn_up.bias"):
                if b + nm in tensors:
                    raise ValueError(f"tensor {b + nm}: FFN gate/up biases are not supported")
            layers.append(L)
        self.layers = layers

    def _repack(self, gf, progress=None):
        """Repack every quantized matmul weight for the kernels (QTensor.repack) and drop the file
        pages it came from (the token embedding stays mapped for its row lookups; a tied output
        gets its own repacked copy)."""
        isa = self.isa

        def rp(w):
            p = w.repack(isa=isa)
            if p is not w:
                gf.release(w.raw)
            return p
        n = len(self.layers) + 1
        for i, L in enumerate(self.layers):
            for k in ("wq", "wk", "wv", "wo", "wg", "wu", "wd"):
                setattr(L, k, rp(getattr(L, k)))
            if progress is not None:
                progress(i + 1, n)
        if self.tied:
            self.output = self.tok_embd.repack(isa=isa)
            if self.output is not self.tok_embd:
                gf.release(self.tok_embd.raw)   # the rows a batch needs fault back in
        else:
            self.output = rp(self.output)
        if progress is not None:
            progress(n, n)

    def _alloc(self):
        """The KV cache: per layer (n_seq * n_ctx, n_kv_heads, head_dim) cells, except that
        sliding-window layers hold a ring of swa_cells = window + n_batch cells per sequence when
        that is less than n_ctx (k_cache is then a list of per-layer arrays)."""
        hp = self.hparams
        kvt = F16 if self.kv_dtype == "f16" else F32
        n_cells = self.n_seq * self.n_ctx
        C = hp.swa_window + self.n_batch
        self.swa_cells = C if SWA_RINGS and hp.swa_window and any(hp.swa_layers) and C < self.n_ctx else 0
        if not self.swa_cells:
            self.k_cache = np.zeros((hp.n_layer, n_cells, hp.n_head_kv, hp.head_dim), kvt)
            self.v_cache = np.zeros((hp.n_layer, n_cells, hp.n_head_kv, hp.head_dim), kvt)
            return
        shape = [((self.n_seq * C) if swa else n_cells, hp.n_head_kv, hp.head_dim) for swa in hp.swa_layers]
        self.k_cache = [np.zeros(sh, kvt) for sh in shape]
        self.v_cache = [np.zeros(sh, kvt) for sh in shape]

    @property
    def kv_bytes(self):
        """bytes of the KV cache (K and V, every layer)"""
        return sum(a.nbytes for a in self.k_cache) + sum(a.nbytes for a in self.v_cache)

    def kv_reusable(self, keep, n_cached):
        """How many of the first `keep` cached tokens a new sequence may reuse when the slot holds
        n_cached evaluated tokens: all of them, except with the sliding-window rings, where the
        cells of positions keep - window + 1 .. keep - 1 must not have been overwritten by later
        positions (else 0: evaluate from the start)."""
        C, W = self.swa_cells, self.hparams.swa_window
        if not C or keep <= 0 or max(0, keep - W + 1) >= n_cached - C:
            return keep
        return 0

    def plan(self, n_tokens=1, all_logits=False):
        """The compiled decoder plan (cpufuse.graph.DynamicPlan) a micro-batch of n_tokens runs on,
        e.g. to read `.plan.describe()`: which ops were fused and the C calls."""
        return self.decoder.plan(*self._cap(int(n_tokens), all_logits))

    def _cap(self, n, all_logits):
        """plan capacities (tokens, logits rows, sequences): one exact plan for decode steps, one
        dynamic plan of n_batch tokens for prompts (last token's logits, or all of them)"""
        if n == 1:
            return 1, 1, 1
        B = self.n_batch
        return B, (B if all_logits else 1), 1

    # ------------------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise RuntimeError(f"this GGUF has no usable tokenizer: {self._tokenizer_error}")
        return self._tokenizer

    @property
    def n_vocab(self):
        return self.hparams.n_vocab

    @property
    def n_past(self):
        """tokens currently held in the KV cache"""
        return self._n_past

    @property
    def eog_ids(self):
        return self.tokenizer.eog_ids if self._tokenizer is not None else frozenset()

    def __repr__(self):
        hp = self.hparams
        return (f"Model({os.path.basename(self.path)!r}, arch={hp.arch}, n_layer={hp.n_layer}, "
                f"n_embd={hp.n_embd}, heads={hp.n_head}/{hp.n_head_kv}, n_ff={hp.n_ff}, n_vocab={hp.n_vocab}, "
                f"n_ctx={self.n_ctx}, kv={self.kv_dtype}, weights={self.layers[0].wq.qtype})")

    # ------------------------------------------------------------------------------- tokenizer
    def tokenize(self, text, add_bos=None, special=False):
        """Token ids of `text` (str or bytes). Text longer than the context could ever hold is
        refused before it is tokenized: ValueError when it has more than n_ctx x the longest
        token piece (`max_text_len`) characters (bytes for bytes): each token stands for at most
        that many bytes of text, each character for at least one."""
        tok = self.tokenizer
        self._check_text(text)
        return tok.tokenize(text, add_bos=add_bos, special=special)

    @property
    def max_text_len(self):
        """the longest prompt text (characters, or bytes) tokenize() and generate() accept"""
        return self._max_text

    def _check_text(self, text, what="text"):
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"{what} must be a str or bytes, got {type(text).__name__}")
        if len(text) > self._max_text:
            raise ValueError(f"{what} is too long for the context: {len(text)} {'characters' if isinstance(text, str) else 'bytes'} "
                             f"> n_ctx {self.n_ctx} x {self.tokenizer.max_piece_bytes} (the longest token "
                             f"piece, in bytes) = {self._max_text}; it could never fit in n_ctx tokens")

    def detokenize(self, ids, special=False):
        return self.tokenizer.detokenize(ids, special=special)

    # --------------------------------------------------------------------------------- forward
    def reset(self):
        """Forget the KV cache contents (cells are overwritten lazily)."""
        with self._lock:
            self._epoch += 1
            self._n_past = 0
            self._cached = []        # the token ids whose K/V are in the cache, in order

    def _embed(self, tokens, out):
        te = self.tok_embd
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.hparams.n_vocab):
            bad = ids[(ids < 0) | (ids >= self.hparams.n_vocab)][0]
            raise ValueError(f"token id {int(bad)} out of range [0, {self.hparams.n_vocab})")
        out[...] = dequantize(te.raw[ids], te.qtype, te.n_in)   # GET_ROWS: only these rows

    def _forward(self, tokens, all_logits_out=None):
        """Run one micro-batch (len(tokens) <= n_batch) at positions n_past.. of slot 0 through the
        decoder graph and append it to the cache. Returns the last position's logits (1, n_vocab)
        (the plan's buffer), or writes every position's into all_logits_out (n, n_vocab)."""
        n = len(tokens)
        pos0 = self._n_past
        if pos0 + n > self.n_ctx:
            raise ValueError(f"context overflow: {pos0} cached + {n} new tokens = {pos0 + n} > n_ctx = "
                             f"{self.n_ctx} (load the model with a larger n_ctx, or call reset())")
        b = Batch(self)
        b.add(0, tokens, pos0, logits=False)
        b.idx = list(range(n)) if all_logits_out is not None else [n - 1]
        out = b.run(self.decoder, self._cap(n, all_logits_out is not None), n_threads=self.n_threads)
        self._n_past = pos0 + n
        self._cached.extend(int(t) for t in tokens)
        if all_logits_out is not None:
            all_logits_out[...] = out
            return all_logits_out
        return out

    def eval(self, tokens, logits_all=False):
        """Append `tokens` to the cache (in micro-batches of n_batch) and return the logits as a
        new float32 array: of the last token, (n_vocab,), or with logits_all (len(tokens),
        n_vocab)."""
        tokens = self._token_list(tokens, "tokens")
        with self._lock:
            self._epoch += 1
            out = self._eval(tokens, logits_all)
            return out if logits_all else out.copy()

    def _token_list(self, tokens, what):
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        try:
            tokens = [operator.index(t) for t in tokens]
        except TypeError:
            raise TypeError(f"{what} must be a sequence of integer token ids, got "
                            f"{type(tokens).__name__}") from None
        n = self.hparams.n_vocab
        if tokens and not (0 <= min(tokens) and max(tokens) < n):
            bad = next(t for t in tokens if not 0 <= t < n)
            raise ValueError(f"token id {bad} out of range [0, {n})")
        return tokens

    def _eval(self, tokens, logits_all=False):
        """eval() under the lock: the last token's logits are a view of the model's buffer"""
        if not tokens:
            raise ValueError("eval: no tokens")
        if self._n_past + len(tokens) > self.n_ctx:
            raise ValueError(f"context overflow: {self._n_past} cached + {len(tokens)} new tokens = "
                             f"{self._n_past + len(tokens)} > n_ctx = {self.n_ctx} "
                             f"(load the model with a larger n_ctx, or call reset())")
        B = self.n_batch
        if logits_all:
            res = np.empty((len(tokens), self.n_logits), F32)
            for s in range(0, len(tokens), B):
                self._forward(tokens[s:s + B], all_logits_out=res[s:s + B])
            return res
        for s in range(0, len(tokens), B):
            out = self._forward(tokens[s:s + B])
        return out[0]

    def logits(self, tokens):
        """(len(tokens), n_vocab) float32 logits of every position, from an empty cache."""
        tokens = self._token_list(tokens, "tokens")
        with self._lock:
            self.reset()
            return self._eval(tokens, logits_all=True)

    # ------------------------------------------------------------------------------ generation
    def _prompt_ids(self, prompt):
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_bos=None, special=True)
        if isinstance(prompt, (bytes, bytearray)):
            return self.tokenize(bytes(prompt), add_bos=None, special=True)
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            if prompt and all(isinstance(m, dict) for m in prompt):
                from .chat import chat_prompt
                text = chat_prompt(self.tokenizer, list(prompt), add_generation_prompt=True,
                                   max_chars=self._max_text)
                return self.tokenize(text, add_bos=False, special=True)
            if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                return self._token_list(prompt, "prompt")
        raise TypeError("prompt must be a str, a list of token ids, or a list of chat messages "
                        "({'role': ..., 'content': ...} dicts)")

    def generate(self, prompt, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                 repeat_penalty=1.0, seed=None, stream=False, penalty_last_n=64, stop_at_eog=True,
                 reuse_cache=True, sampler=None, stop=None, response_format=None, grammar=None, tools=None,
                 tool_choice=None, parallel_tool_calls=None):
        """Generate up to max_tokens after `prompt` (text; token ids; or chat messages rendered with
        the GGUF chat template and tokenized with special=True). Sampling is llama.cpp's common
        chain (penalties, top-k, top-p, min-p, temperature, dist; see cpufuse.llama.sampling);
        temperature 0 is greedy. Stops at an end-of-generation token (not included).

        stream=False: returns a GenerationResult (.tokens, .text, .prompt_tps, .decode_tps, ...).
        stream=True: returns an iterator of text pieces; its .result is set when it is exhausted.
        reuse_cache: keep the KV cells of the longest common prefix with the previous sequence.
        stop: a string or a list of strings; the text ends before the first one that appears (it
        never shows, not even in a stream: text that could begin one is held back until it is
        decided) and generation stops there with stop_reason "stop". The tokens that made it stay
        in .tokens (and count in decode_tokens), as llama-cpp-python counts them.
        Arguments are checked here, before anything runs (ValueError naming the argument).
        response_format / grammar (GBNF) / tools + tool_choice (+ parallel_tool_calls) constrain the output (see
        cpufuse.llama.constrain and cpufuse.llama.tools); with tools, chat messages are rendered
        with them and the result's .tool_calls holds the calls parsed from the text.

        Threads: a call waits while another call on this Model runs. A stream computes each token
        under the model's lock and releases it before yielding the text; if another call changes
        the KV cache between two of its tokens, the stream raises RuntimeError on its next step.
        """
        from .sampling import Sampler
        from .stops import check_stop
        max_tokens = _int_arg(max_tokens, "max_tokens", 0, 1 << 31)
        stop = check_stop(stop)
        if sampler is None:
            sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, penalty_last_n=penalty_last_n, seed=seed)
        spec = None
        if any(a is not None for a in (response_format, grammar, tools, tool_choice, parallel_tool_calls)):
            from .tools import guide_generate
            prompt, sampler, spec = guide_generate(self, prompt, sampler, response_format, grammar, tools,
                                                   tool_choice, parallel_tool_calls)
        ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > self.n_ctx:
            raise ValueError(f"context overflow: the prompt has {len(ids)} tokens > n_ctx = {self.n_ctx}")
        gen = self._generate(ids, max_tokens, sampler, stop_at_eog, reuse_cache, stop)
        if spec is not None:
            from .tools import with_tool_calls
            gen = with_tool_calls(gen, spec, self.tokenizer)
        if stream:
            return _Streamer(gen)
        with self._lock:            # the whole generation at once: no other call in between
            try:
                while True:
                    next(gen)
            except StopIteration as e:
                return e.value

    def _generate(self, ids, max_tokens, sampler, stop_at_eog, reuse_cache, stops=()):
        """The generation loop. Every step that touches the cache runs under the lock, bumps the
        model's epoch and remembers it; a step that finds another epoch was interrupted."""
        from .stops import StopMatcher
        from .tokenizer import StreamDecoder
        eog = self.eog_ids if stop_at_eog else frozenset()
        sm = StopMatcher(stops)
        dec = StreamDecoder(self.tokenizer) if self._tokenizer is not None else None
        with self._lock:
            self._epoch += 1
            epoch = self._epoch
            # prefix reuse (llama-cpp-python style): keep the cached cells that match, re-evaluate >= 1
            keep = 0
            if reuse_cache:
                c = self._cached
                m = min(len(c), len(ids) - 1)
                while keep < m and c[keep] == ids[keep]:
                    keep += 1
                keep = self.kv_reusable(keep, len(c))
            self._n_past = keep
            del self._cached[keep:]
            sampler.accept_prompt(ids)
            t0 = time.perf_counter()
            logits = self._eval(ids[keep:])
            t_prompt = time.perf_counter() - t0
            tok = sampler.sample(logits) if max_tokens else None
        out, t_dec, n_dec = [], 0.0, 0
        stop, stop_tok = "length", None
        text_parts = []
        for i in range(max_tokens):
            if tok in eog:
                stop, stop_tok = "eog", tok
                break
            out.append(tok)
            if dec is not None:
                s, hit = sm.push(dec.push(tok))
                if s:
                    text_parts.append(s)
                    yield s                     # no lock is held here
                if hit:
                    stop = "stop"
                    break
            if i == max_tokens - 1:
                break
            with self._lock:
                if self._epoch != epoch:
                    raise RuntimeError("this stream was interrupted by another generate(), eval(), logits() or "
                                       "reset() call on the same Model, which changed its KV cache; start a new "
                                       "generate() (a Model holds one sequence)")
                if self._n_past >= self.n_ctx:
                    stop = "context"
                    break
                t0 = time.perf_counter()
                logits = self._eval([tok])
                t_dec += time.perf_counter() - t0
                n_dec += 1
                tok = sampler.sample(logits)
                self._epoch += 1
                epoch = self._epoch
        if dec is not None and stop != "stop":
            s, hit = sm.push(dec.flush())
            if hit:
                stop = "stop"
            else:
                s += sm.flush()
            if s:
                text_parts.append(s)
                yield s
        return GenerationResult(tokens=out, text="".join(text_parts), prompt_tokens=len(ids),
                                prompt_eval_tokens=len(ids) - keep, prompt_time=t_prompt,
                                decode_tokens=n_dec, decode_time=t_dec, stop_reason=stop, stop_token=stop_tok,
                                prompt_ids=list(ids))
