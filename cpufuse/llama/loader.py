"""The weights of a GGUF decoder model: every tensor the forward pass reads, checked against the
hyperparameters, as views of the memory-mapped file (2-D weights as cpufuse.QTensor, 1-D vectors
as float32 copies), then optionally repacked for the kernels.

    w = load_weights(gf, hp, n_ctx)        # Weights: tok_embd, output, layers[i].wq, ...
    repack_weights(w, gf, isa, progress)   # P16 panels, the file pages released
"""
from __future__ import annotations

import numpy as np

from cpufuse.quant.types import QTensor, dequantize

__all__ = ["Layer", "Weights", "load_weights", "repack_weights"]

F32 = np.float32

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


class Layer:
    """One block's tensors (None where the architecture has none)."""
    __slots__ = ("attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo", "q_norm", "k_norm",
                 "ffn_norm", "wg", "wu", "wd", "bd", "post_attn_norm", "post_ffn_norm")


class Weights:
    """The model-level tensors and the layers. output is token_embd when tied (no output.weight);
    n_logits = output's rows; rope_freqs: the RoPE frequency factors, or None."""
    __slots__ = ("tok_embd", "output_norm", "output", "tied", "output_bias", "n_logits", "rope_freqs", "layers")


def load_weights(gf, hp, n_ctx):
    """Every tensor the forward pass reads, checked against the hyperparameters: 2-D weights as
    QTensor views of the mapped file (`_weight`), 1-D vectors as float32 copies (`_vector`).
    A tensor the architecture does not use is ignored. n_ctx: the context size (phi3's LongRoPE
    factors depend on it)."""
    out = Weights()
    tensors = gf.tensors

    def tensor(name, required):
        t = tensors.get(name)
        if t is None and required:
            raise ValueError(f"GGUF is missing the tensor {name}")
        return t

    def qt(name, shape, required=True):
        t = tensor(name, required)
        return None if t is None else _weight(t, shape)

    def vec(name, n, required=True):
        t = tensor(name, required)
        return None if t is None else _vector(t, n)

    E, H, Hkv, D, FF, V = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab
    out.tok_embd = qt("token_embd.weight", (V, E))
    out.output_norm = vec("output_norm.weight", E)
    out.output = qt("output.weight", (V, E), required=False)
    out.tied = out.output is None
    if out.tied:
        out.output = out.tok_embd
    out.output_bias = vec("output.bias", V, required=False)
    out.n_logits = out.output.n_out
    out.rope_freqs = vec("rope_freqs.weight", hp.n_rot // 2, required=False)
    if hp.arch == "phi3" and "rope_factors_long.weight" in tensors:
        # LongRoPE: per-dimension frequency factors, the long ones when the context exceeds the
        # original one (llama.cpp build_rope_factors: n_ctx_per_seq > n_ctx_orig_yarn)
        which = "long" if n_ctx > hp.n_ctx_orig else "short"
        out.rope_freqs = vec(f"rope_factors_{which}.weight", hp.n_rot // 2)

    layers = []
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        L = Layer()
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
    out.layers = layers
    return out


def repack_weights(w, gf, isa=None, progress=None):
    """Repack every quantized matmul weight for the kernels (QTensor.repack) and drop the file
    pages it came from (the token embedding stays mapped for its row lookups; a tied output
    gets its own repacked copy)."""

    def rp(t):
        p = t.repack(isa=isa)
        if p is not t:
            gf.release(t.raw)
        return p
    n = len(w.layers) + 1
    for i, L in enumerate(w.layers):
        for k in ("wq", "wk", "wv", "wo", "wg", "wu", "wd"):
            setattr(L, k, rp(getattr(L, k)))
        if progress is not None:
            progress(i + 1, n)
    if w.tied:
        w.output = w.tok_embd.repack(isa=isa)
        if w.output is not w.tok_embd:
            gf.release(w.tok_embd.raw)   # the rows a batch needs fault back in
    else:
        w.output = rp(w.output)
    if progress is not None:
        progress(n, n)
