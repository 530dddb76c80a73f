"""A llama-architecture GGUF model on cpufuse's fused kernels (SPEC-MODEL §1, §3).

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

Threads: one Model serializes its calls. generate(), eval(), logits(), reset() and
profile_decode() from several threads take turns on an internal lock (a call waits while another
runs), so each returns what it would have returned alone. A stream (generate(stream=True)) holds
the lock only while it computes a token, never between tokens: a stream that is closed or simply
dropped leaves the model usable, and a stream resumed after another call changed the KV cache
raises RuntimeError instead of continuing from someone else's cache.

Per layer (SPEC-MODEL §3.2), with every buffer preallocated at load time:
    q, k, v = matmul_multi(x, (Wq, Wk, Wv), norm_weight=attn_norm)   RMS_NORM fused in front
    rope(q) in place;  rope(k, cache=(K[l], pos0))                    RoPE + f16 K-cache store
    V[l][pos0:pos0+n] = v                                             f16 V-cache store
    a = flash_attn(q, K[l][:T], V[l][:T], causal mask)                GQA over the cache views
    x += a @ Wo^T
    g = matmul_swiglu(x, Wgate, Wup, norm_weight=ffn_norm)            RMS_NORM + SwiGLU fused
    x += g @ Wdown^T
then logits = matmul(x, Whead, norm_weight=output_norm) (Whead = token_embd when tied).

One-token decode steps (use_plan=True, the default) run the same chain as ONE compiled
cpufuse.Graph plan: one C call per token, no Python per layer (see `_decode_graph`). A plan has
fixed shapes, so it attends over a fixed KV length (a bucket: 256, 511, 1024, 2048, ... up to
n_ctx; 511 keeps flash_attn's strategy, which changes at 512, the same as over pos+1 cells) with
an f16 mask input that is 0 for cells <= pos and -inf after. A -inf cell is never read by
flash_attn (select semantics) and fully masked split-KV chunks are skipped, so the plan's logits
and KV cache equal the Python-step decode's bit for bit. Plans are compiled lazily, one per
bucket reached. Prompt batches (n > 1) keep the per-layer Python path.

Architectures: llama (RoPE NORM), qwen2 (Q/K/V biases, RoPE NEOX), qwen3 (per-head Q/K RMSNorm,
NEOX). Anything else is refused with a ValueError naming the architecture.
"""
from __future__ import annotations

import bisect
import math
import numbers
import operator
import os
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from cpufuse import _dispatch, flash_attn, matmul, matmul_multi, matmul_swiglu, rms_norm, rope
from cpufuse.graph import Graph
from cpufuse.ops import choose_strategy
from cpufuse.qtypes import QTensor, dequantize

__all__ = ["Model", "HParams", "GenerationResult", "SUPPORTED_ARCHS"]

F32 = np.float32
F16 = np.float16
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
_ROPE_MODE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox"}
DEFAULT_N_CTX = 2048
DEFAULT_N_BATCH = 512
PLAN_MIN_BUCKET = 256   # the smallest KV length a decode plan attends over
DIRECT_PLAN_CALL = True  # decode: run the plan bound once to its inputs (Plan.bind), not plan.run


def kv_buckets(n_ctx, min_bucket=PLAN_MIN_BUCKET):
    """The KV lengths decode plans are compiled for: powers of two from min_bucket, n_ctx last,
    plus L-1 wherever flash_attn's auto strategy for one query changes at length L (512: rows ->
    split-KV), so that a bucket always runs the strategy the Python step runs over pos+1 cells."""
    n_ctx = int(n_ctx)
    bs, b = set(), int(min_bucket)
    while b < n_ctx:
        bs.add(b)
        b *= 2
    bs.add(n_ctx)
    prev = choose_strategy(1, 1)
    for t in range(2, min(n_ctx, 1 << 16) + 1):
        cur = choose_strategy(1, t)
        if cur != prev:
            bs.add(t - 1)
        prev = cur
    # a power of two right after a strategy bucket (512 after 511) would serve one length only
    return sorted(b for b in bs if b == n_ctx or (b - 1) not in bs or b & (b - 1))


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
    """The hyperparameters read from the GGUF (SPEC-MODEL §1.2) and decided at load (§1.4)."""
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
        if ext_factor != 0.0:           # SPEC-MODEL §1.4: the two 0.1·ln(factor) terms cancel
            fct = 1.0 / freq_scale
            a = 0.1 * math.log(fct) + 1.0 if fct > 1.0 else 1.0
            attn_factor = a * (1.0 / (1.0 + 0.1 * math.log(fct)))
        attn_factor *= _float_key(gf, p + "rope.scaling.attn_factor", 1.0)
        return cls(arch=arch, n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                   head_dim=d_k, n_rot=n_rot, n_vocab=n_vocab, n_ctx_train=n_ctx_train, eps=eps,
                   freq_base=freq_base, freq_scale=freq_scale, rope_mode=_ROPE_MODE[arch],
                   rope_scaling=scaling, ext_factor=ext_factor, attn_factor=attn_factor,
                   n_ctx_orig=n_ctx_orig, kq_scale=1.0 / math.sqrt(d_k))


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
                 "ffn_norm", "wg", "wu", "wd", "bd")


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
    stop_reason: str                  # "eog" | "length" | "context"
    stop_token: Optional[int] = None
    prompt_ids: List[int] = field(default_factory=list)

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

class _DecodePlan:
    """A compiled one-token decode plan over nkv KV cells and its mask input (0 for the cells
    [0, n) attended to, -inf after; only the changed cells are rewritten per step).

    run(): the plan's inputs are always the same three arrays, so the plan is bound to them once
    (Plan.bind checks them) and each step is one call of the bound plan, skipping plan.run's
    per-call input checks and output views (~0.1 ms a token on a cold cache)."""
    __slots__ = ("plan", "nkv", "lo", "mask", "n", "_fast", "_key")

    def __init__(self, plan, nkv, lo):
        self.plan, self.nkv, self.lo = plan, nkv, lo   # serves the KV lengths (lo, nkv]
        self.mask = np.full((1, 1, 1, nkv), -np.inf, F16)
        self.n = 0
        self._fast = None   # the plan bound to (x, pos, mask)
        self._key = None

    def set_len(self, n):
        m = self.mask.reshape(-1)
        if n > self.n:
            m[self.n:n] = 0
        elif n < self.n:
            m[n:self.n] = -np.inf
        self.n = n

    def run(self, x, pos, n_threads):
        if not DIRECT_PLAN_CALL:
            self._fast = None
            return self.plan.run(x=x, pos=pos, mask=self.mask, n_threads=n_threads)[0]
        if self._fast is None or self._key[0] is not x or self._key[1] is not pos:
            self._fast = self.plan.bind(x=x, pos=pos, mask=self.mask)
            self._key = (x, pos)
        return self._fast(n_threads=n_threads)[0]


class Model:
    """A loaded GGUF model with its KV cache (one sequence). Calls from several threads are
    serialized (see the module docstring); a paused stream is invalidated by any other call."""

    def __init__(self):
        raise TypeError("use Model.load(path, ...)")

    # -------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, path, n_ctx=DEFAULT_N_CTX, n_threads=None, kv_dtype="f16", act=None,
             n_batch=DEFAULT_N_BATCH, rope_ggml_compat=False, isa=None, use_plan=True):
        """Memory-map the GGUF at `path` and prepare a KV cache of n_ctx cells.

        n_ctx: the context size (KV cells); 0 or None = the model's context_length.
        n_threads: threads for every kernel (None: cpufuse's default, see cpufuse.set_num_threads).
        kv_dtype: "f16" (llama.cpp's default) or "f32". act: the matmul activation mode, "q8"
        (default, as llama.cpp) or "f32" (exact f32 activations). n_batch: the largest micro-batch
        a prompt is processed in (longer prompts are split). rope_ggml_compat: use ggml's f32
        angle chain (bit-compatible with llama.cpp) instead of cpufuse's float64 angles.
        isa: force a cpufuse ISA for every kernel (None = auto). use_plan: run one-token decode
        steps as one compiled graph plan per KV-length bucket (one C call per token); False keeps
        the per-layer Python calls (the plan is also skipped where it cannot be built, e.g. an ISA
        without the C plan executor: see `plan_error`).

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
        self.n_batch = min(n_batch, n_ctx)
        self._load_weights(gf)

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
        self.use_plan = bool(use_plan)
        self.plan_error = None      # why the decode plan is not used (None: it is, or not tried yet)
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
            if hp.arch == "qwen3":
                L.q_norm = vec(b + "attn_q_norm.weight", D)
                L.k_norm = vec(b + "attn_k_norm.weight", D)
            else:
                L.q_norm = L.k_norm = None
            L.ffn_norm = vec(b + "ffn_norm.weight", E)
            L.wg = qt(b + "ffn_gate.weight", (FF, E))
            L.wu = qt(b + "ffn_up.weight", (FF, E))
            L.wd = qt(b + "ffn_down.weight", (E, FF))
            L.bd = vec(b + "ffn_down.bias", E, required=False)
            for nm in ("ffn_gate.bias", "ffn_up.bias"):
                if b + nm in tensors:
                    raise ValueError(f"tensor {b + nm}: FFN gate/up biases are not supported")
            layers.append(L)
        self.layers = layers

    def _alloc(self):
        hp = self.hparams
        E, H, Hkv, D, FF, B = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, self.n_batch
        kvt = F16 if self.kv_dtype == "f16" else F32
        self.k_cache = np.zeros((hp.n_layer, self.n_ctx, Hkv, D), kvt)
        self.v_cache = np.zeros((hp.n_layer, self.n_ctx, Hkv, D), kvt)
        self._x = np.zeros((B, E), F32)
        self._q = np.zeros((B, H * D), F32)
        self._k = np.zeros((B, Hkv * D), F32)
        self._v = np.zeros((B, Hkv * D), F32)
        self._attn = np.zeros((1, B, H, D), F32)
        self._o = np.zeros((B, E), F32)
        self._g = np.zeros((B, FF), F32)
        self._mask = np.zeros((B, self.n_ctx), F16)
        self._logits1 = np.zeros((1, self.n_logits), F32)
        self._views = {}
        self._plans = {}            # KV bucket -> _DecodePlan
        self._dp_last = None
        self._buckets = None
        self._x1 = np.zeros((1, E), F32)      # the decode plan's inputs
        self._pos1 = np.zeros(1, np.int32)

    def _views_for(self, n):
        v = self._views.get(n)
        if v is None:
            hp = self.hparams
            H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
            q = self._q[:n]
            k = self._k[:n]
            v_ = self._v[:n]
            q3 = q.reshape(n, H, D)
            k3 = k.reshape(n, Hkv, D)
            v3 = v_.reshape(n, Hkv, D)
            q4 = q3.transpose(1, 0, 2)[None]          # (1, H, n, D) view for flash_attn
            attn = self._attn[:, :n]                  # (1, n, H, D)
            attn2 = self._attn.reshape(-1, H * D)[:n]
            v = self._views[n] = (self._x[:n], q, k, v_, q3, k3, v3, q4, attn, attn2, self._o[:n], self._g[:n])
        return v

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
        """Run one micro-batch (len(tokens) <= n_batch) at positions n_past.. and append it to
        the cache. Writes the last position's logits into self._logits1 (returned), or every
        position's into all_logits_out (n, n_vocab)."""
        n = len(tokens)
        pos0 = self._n_past
        T = pos0 + n
        if T > self.n_ctx:
            raise ValueError(f"context overflow: {pos0} cached + {n} new tokens = {T} > n_ctx = {self.n_ctx} "
                             f"(load the model with a larger n_ctx, or call reset())")
        if n == 1 and self.use_plan and self.plan_error is None:
            dp = self._decode_plan(T)
            if dp is not None:
                out = self._forward_plan(dp, tokens[0], pos0)
                if all_logits_out is not None:
                    all_logits_out[...] = out
                    return all_logits_out
                return out
        hp = self.hparams
        eps = hp.eps
        act = self.act
        nt = self.n_threads
        isa = self.isa
        x, q, k, v, q3, k3, v3, q4, attn, attn2, o, g = self._views_for(n)
        self._embed(tokens, x)
        pos = np.arange(pos0, T, dtype=np.int32)
        if n == 1:
            mask = None              # one query at the newest position sees every cached cell
        else:
            mask = self._mask[:n, :T]
            mask[:, :pos0] = 0
            tri = np.triu(np.full((n, n), -np.inf, F16), 1)
            mask[:, pos0:T] = tri
            mask = mask[None, None]
        rope_kw = self._rope_kw
        scale = hp.kq_scale
        kc_all, vc_all = self.k_cache, self.v_cache
        qkv_out = (q, k, v)
        for li, L in enumerate(self.layers):
            matmul_multi(x, (L.wq, L.wk, L.wv), out=qkv_out, norm_weight=L.attn_norm, eps=eps, act=act,
                         isa=isa, n_threads=nt)
            if L.bq is not None:
                q += L.bq
            if L.bk is not None:
                k += L.bk
            if L.bv is not None:
                v += L.bv
            if L.q_norm is not None:   # qwen3: per-head RMSNorm of q and k before RoPE
                q2 = q.reshape(-1, hp.head_dim)
                q2[...] = rms_norm(q2, L.q_norm, eps=eps, isa=isa, n_threads=nt)
                k2 = k.reshape(-1, hp.head_dim)
                k2[...] = rms_norm(k2, L.k_norm, eps=eps, isa=isa, n_threads=nt)
            kc = kc_all[li]
            vc = vc_all[li]
            rope(q3, pos, out=q3, **rope_kw)
            rope(k3, pos, cache=(kc, pos0), **rope_kw)
            vc[pos0:T] = v3
            flash_attn(q4, kc[:T].transpose(1, 0, 2)[None], vc[:T].transpose(1, 0, 2)[None], mask,
                       scale=scale, out=attn, isa=isa, n_threads=nt)
            matmul(attn2, L.wo, out=o, act=act, isa=isa, n_threads=nt)
            if L.bo is not None:
                o += L.bo
            x += o
            matmul_swiglu(x, L.wg, L.wu, out=g, norm_weight=L.ffn_norm, eps=eps, act=act, isa=isa, n_threads=nt)
            matmul(g, L.wd, out=o, act=act, isa=isa, n_threads=nt)
            if L.bd is not None:
                o += L.bd
            x += o
        self._n_past = T
        self._cached.extend(int(t) for t in tokens)
        if all_logits_out is not None:
            matmul(x, self.output, out=all_logits_out, norm_weight=self.output_norm, eps=eps, act=act,
                   isa=isa, n_threads=nt)
            if self.output_bias is not None:
                all_logits_out += self.output_bias
            return all_logits_out
        out = self._logits1
        matmul(x[n - 1:n], self.output, out=out, norm_weight=self.output_norm, eps=eps, act=act,
               isa=isa, n_threads=nt)
        if self.output_bias is not None:
            out += self.output_bias
        return out

    # ----------------------------------------------------------------------------- decode plan
    def _decode_graph(self, nkv):
        """One decode step over every layer as a cpufuse.Graph attending over KV cells [0, nkv):
        inputs x (1, n_embd) f32 (the token's embedding row), pos (1,) int32 (the RoPE position
        and the cache row), mask (1, 1, 1, nkv) f16; output the logits (1, n_vocab). The plan
        fuses RMS_NORM -> MUL -> Q/K/V (one matmul_multi with the norm prologue), ROPE(k) ->
        CACHE_WRITE, RMS_NORM -> MUL -> gate/up -> SILU -> MUL (one matmul_swiglu) and the head's
        norm prologue, the same kernels as `_forward`, in one C call."""
        hp = self.hparams
        E, H, Hkv, D, eps, act = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.eps, self.act
        rkw = {k: v for k, v in self._rope_kw.items() if k not in ("n_dims", "mode", "isa", "n_threads")}
        if rkw.get("freq_factors") is None:
            rkw.pop("freq_factors", None)
        g = Graph()
        x = g.input("x", (1, E))
        pos = g.input("pos", (1,), np.int32)          # RoPE position = cache row (one token)
        mask = g.input("mask", (1, 1, 1, nkv), np.float16)

        def c(a, name):
            return g.constant(a, name)

        for li, L in enumerate(self.layers):
            p = f"l{li}."
            kc, vc = self.k_cache[li, :nkv], self.v_cache[li, :nkv]   # C-contiguous views
            h = g.mul(g.rms_norm(x, eps, name=p + "attn_norm"), c(L.attn_norm, p + "attn_norm.w"))
            q, k, v = (g.qmatmul(h, w, act=act, name=p + nm) for w, nm in ((L.wq, "q"), (L.wk, "k"), (L.wv, "v")))
            if L.bq is not None:
                q = g.add(q, c(L.bq, p + "bq"), name=p + "q+b")
            if L.bk is not None:
                k = g.add(k, c(L.bk, p + "bk"), name=p + "k+b")
            if L.bv is not None:
                v = g.add(v, c(L.bv, p + "bv"), name=p + "v+b")
            q3, k3 = g.reshape(q, (1, H, D)), g.reshape(k, (1, Hkv, D))
            if L.q_norm is not None:   # qwen3: per-head RMSNorm of q and k before RoPE
                q3 = g.reshape(g.mul(g.rms_norm(g.reshape(q3, (H, D)), eps, name=p + "q_norm"),
                                     c(L.q_norm, p + "q_norm.w")), (1, H, D))
                k3 = g.reshape(g.mul(g.rms_norm(g.reshape(k3, (Hkv, D)), eps, name=p + "k_norm"),
                                     c(L.k_norm, p + "k_norm.w")), (1, Hkv, D))
            kr = g.rope(k3, pos, hp.n_rot, mode=hp.rope_mode, name=p + "rope_k", **rkw)
            kcw = g.cache_write(kr, kc, pos, name=p + "k_cache")
            vcw = g.cache_write(g.reshape(v, (1, Hkv, D)), vc, pos, name=p + "v_cache")
            qr = g.rope(q3, pos, hp.n_rot, mode=hp.rope_mode, name=p + "rope_q", **rkw)
            Q = g.permute(g.reshape(qr, (1, 1, H, D)), (0, 2, 1, 3))
            K = g.permute(g.reshape(kcw, (1, nkv, Hkv, D)), (0, 2, 1, 3))
            V = g.permute(g.reshape(vcw, (1, nkv, Hkv, D)), (0, 2, 1, 3))
            a = g.flash_attn(Q, K, V, mask, scale=hp.kq_scale, name=p + "attn")
            o = g.qmatmul(g.reshape(a, (1, H * D)), L.wo, act=act, name=p + "o")
            if L.bo is not None:
                o = g.add(o, c(L.bo, p + "bo"), name=p + "o+b")
            r = g.add(x, o, name=p + "res")
            h2 = g.mul(g.rms_norm(r, eps, name=p + "ffn_norm"), c(L.ffn_norm, p + "ffn_norm.w"))
            gt = g.qmatmul(h2, L.wg, act=act, name=p + "gate")
            up = g.qmatmul(h2, L.wu, act=act, name=p + "up")
            f = g.mul(g.silu(gt, name=p + "silu"), up, name=p + "ffn")
            dn = g.qmatmul(f, L.wd, act=act, name=p + "down")
            if L.bd is not None:
                dn = g.add(dn, c(L.bd, p + "bd"), name=p + "down+b")
            x = g.add(r, dn, name=p + "out")
        hn = g.mul(g.rms_norm(x, eps, name="output_norm"), c(self.output_norm, "output_norm.w"))
        lg = g.qmatmul(hn, self.output, act=act, name="output")
        if self.output_bias is not None:
            lg = g.add(lg, c(self.output_bias, "output.b"), name="output+b")
        g.output(lg)
        return g

    def _decode_plan(self, T):
        """the compiled decode plan for a step that leaves T cells in the cache, or None (and
        plan_error set) when it cannot be built"""
        dp = self._dp_last
        if dp is not None and dp.lo < T <= dp.nkv:   # the common case: the previous step's bucket
            return dp
        if self._buckets is None:
            self._buckets = kv_buckets(self.n_ctx)
        i = bisect.bisect_left(self._buckets, T)
        b = self._buckets[i]
        dp = self._plans.get(b)
        if dp is None:
            try:
                plan = self._decode_graph(b).compile(isa=self.isa)
            except Exception as e:   # a graph the plan cannot express: the Python steps run instead
                self.plan_error = f"{type(e).__name__}: {e}"
                return None
            if not plan.native:
                self.plan_error = f"isa {plan.isa} has no C plan executor"
                return None
            dp = self._plans[b] = _DecodePlan(plan, b, self._buckets[i - 1] if i else 0)
        self._dp_last = dp
        return dp

    def _forward_plan(self, dp, tok, pos0):
        """one token at position pos0 through the decode plan; returns the (1, n_vocab) logits
        (the plan's buffer: valid until the next call)"""
        tok = int(tok)
        if tok < 0 or tok >= self.hparams.n_vocab:
            raise ValueError(f"token id {tok} out of range [0, {self.hparams.n_vocab})")
        te = self.tok_embd
        x = self._x1
        x[...] = dequantize(te.raw[tok:tok + 1], te.qtype, te.n_in)   # GET_ROWS: one row
        dp.set_len(pos0 + 1)
        self._pos1[0] = pos0
        out = dp.run(x, self._pos1, self.n_threads)
        self._n_past = pos0 + 1
        self._cached.append(tok)
        return out

    def decode_plan(self, n_kv=None):
        """The compiled decode plan for KV length n_kv (default: the next step's), e.g. to read
        its describe(); None when the plan route is off or cannot be built (see plan_error)."""
        if not self.use_plan:
            return None
        with self._lock:
            T = self._n_past + 1 if n_kv is None else int(n_kv)
            if not 1 <= T <= self.n_ctx:
                raise ValueError(f"n_kv must be in [1, {self.n_ctx}], got {T}")
            dp = self._decode_plan(T) if self.plan_error is None else None
            return None if dp is None else dp.plan

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
                 reuse_cache=True, sampler=None):
        """Generate up to max_tokens after `prompt` (text; token ids; or chat messages rendered with
        the GGUF chat template and tokenized with special=True). Sampling is llama.cpp's common
        chain (penalties, top-k, top-p, min-p, temperature, dist; see cpufuse.llama.sampling);
        temperature 0 is greedy. Stops at an end-of-generation token (not included).

        stream=False: returns a GenerationResult (.tokens, .text, .prompt_tps, .decode_tps, ...).
        stream=True: returns an iterator of text pieces; its .result is set when it is exhausted.
        reuse_cache: keep the KV cells of the longest common prefix with the previous sequence.
        Arguments are checked here, before anything runs (ValueError naming the argument).

        Threads: a call waits while another call on this Model runs. A stream computes each token
        under the model's lock and releases it before yielding the text; if another call changes
        the KV cache between two of its tokens, the stream raises RuntimeError on its next step.
        """
        from .sampling import Sampler
        max_tokens = _int_arg(max_tokens, "max_tokens", 0, 1 << 31)
        if sampler is None:
            sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, penalty_last_n=penalty_last_n, seed=seed)
        ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > self.n_ctx:
            raise ValueError(f"context overflow: the prompt has {len(ids)} tokens > n_ctx = {self.n_ctx}")
        gen = self._generate(ids, max_tokens, sampler, stop_at_eog, reuse_cache)
        if stream:
            return _Streamer(gen)
        with self._lock:            # the whole generation at once: no other call in between
            try:
                while True:
                    next(gen)
            except StopIteration as e:
                return e.value

    def _generate(self, ids, max_tokens, sampler, stop_at_eog, reuse_cache):
        """The generation loop. Every step that touches the cache runs under the lock, bumps the
        model's epoch and remembers it; a step that finds another epoch was interrupted."""
        from .tokenizer import StreamDecoder
        eog = self.eog_ids if stop_at_eog else frozenset()
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
                s = dec.push(tok)
                if s:
                    text_parts.append(s)
                    yield s                     # no lock is held here
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
        if dec is not None:
            s = dec.flush()
            if s:
                text_parts.append(s)
                yield s
        return GenerationResult(tokens=out, text="".join(text_parts), prompt_tokens=len(ids),
                                prompt_eval_tokens=len(ids) - keep, prompt_time=t_prompt,
                                decode_tokens=n_dec, decode_time=t_dec, stop_reason=stop, stop_token=stop_tok,
                                prompt_ids=list(ids))

    # ------------------------------------------------------------------------------- profiling
    def profile_decode(self, n_steps=8, token=None):
        """Per-op wall time (seconds, mean per decode step) of `n_steps` single-token decodes
        appended to the current cache: each op is timed with perf_counter around its call."""
        with self._lock:
            self._epoch += 1
            return self._profile_decode(n_steps, token)

    def _profile_decode(self, n_steps, token):
        import collections
        tm = collections.defaultdict(float)
        hp = self.hparams
        token = int(token if token is not None else (self._cached[-1] if self._cached else 0))
        pc = time.perf_counter
        for _ in range(n_steps):
            if self._n_past + 1 > self.n_ctx:
                raise ValueError("profile_decode: context full")
            t_all = pc()
            n = 1
            pos0 = self._n_past
            T = pos0 + 1
            eps, act, nt, isa = hp.eps, self.act, self.n_threads, self.isa
            t = pc()
            x, q, k, v, q3, k3, v3, q4, attn, attn2, o, g = self._views_for(n)
            self._embed([token], x)
            pos = np.arange(pos0, T, dtype=np.int32)
            rope_kw = self._rope_kw
            tm["embed+setup"] += pc() - t
            for li, L in enumerate(self.layers):
                t = pc()
                matmul_multi(x, (L.wq, L.wk, L.wv), out=(q, k, v), norm_weight=L.attn_norm, eps=eps, act=act,
                             isa=isa, n_threads=nt)
                t1 = pc(); tm["norm+qkv matmul"] += t1 - t  # noqa: E702
                if L.bq is not None:
                    q += L.bq
                    k += L.bk
                    v += L.bv
                kc, vc = self.k_cache[li], self.v_cache[li]
                rope(q3, pos, out=q3, **rope_kw)
                t2 = pc(); tm["rope q"] += t2 - t1  # noqa: E702
                rope(k3, pos, cache=(kc, pos0), **rope_kw)
                t3 = pc(); tm["rope k + cache store"] += t3 - t2  # noqa: E702
                vc[pos0:T] = v3
                t4 = pc(); tm["v cache store"] += t4 - t3  # noqa: E702
                flash_attn(q4, kc[:T].transpose(1, 0, 2)[None], vc[:T].transpose(1, 0, 2)[None], None,
                           scale=hp.kq_scale, out=attn, isa=isa, n_threads=nt)
                t5 = pc(); tm["flash_attn"] += t5 - t4  # noqa: E702
                matmul(attn2, L.wo, out=o, act=act, isa=isa, n_threads=nt)
                t6 = pc(); tm["attn_output matmul"] += t6 - t5  # noqa: E702
                x += o
                t7 = pc(); tm["residual adds"] += t7 - t6  # noqa: E702
                matmul_swiglu(x, L.wg, L.wu, out=g, norm_weight=L.ffn_norm, eps=eps, act=act, isa=isa,
                              n_threads=nt)
                t8 = pc(); tm["norm+gate/up swiglu"] += t8 - t7  # noqa: E702
                matmul(g, L.wd, out=o, act=act, isa=isa, n_threads=nt)
                t9 = pc(); tm["ffn_down matmul"] += t9 - t8  # noqa: E702
                x += o
                tm["residual adds"] += pc() - t9
            t = pc()
            matmul(x, self.output, out=self._logits1, norm_weight=self.output_norm, eps=eps, act=act,
                   isa=isa, n_threads=nt)
            tm["norm+output matmul"] += pc() - t
            self._n_past = T
            self._cached.append(token)
            tm["TOTAL"] += pc() - t_all
        return {k: v / n_steps for k, v in tm.items()}
