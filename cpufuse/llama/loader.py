"""The weights of a GGUF decoder model: every tensor its architecture declares (the tensor list of
its module in cpufuse/llama/arch/), checked against the hyperparameters, as views of the
memory-mapped file (weights as cpufuse.QTensor, 1-D vectors as float32 copies), then optionally
repacked for the kernels.

    w = load_weights(gf, hp, n_ctx)        # Weights: tok_embd, output, layers[i].wq, ...
    repack_weights(w, gf, isa, progress)   # P16 panels, the file pages released
"""
from __future__ import annotations

import os

import numpy as np

from cpufuse import _pages
from cpufuse.quant.types import QTensor, dequantize

from .arch import get as get_arch
from .arch.spec import Dims

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
    """The weight `t` (ne = shape reversed) as a QTensor over its bytes in the mapped file, checked
    against the expected numpy shape ((n_out, n_in) for a matrix). The one place a weight becomes a
    QTensor (a load-time layout change, such as repacking, belongs here)."""
    if t.ne != tuple(reversed(shape)):
        if len(shape) == 2:
            n_out, n_in = shape
            raise ValueError(f"tensor {t.name}: ne = {list(t.ne)}, expected [{n_in}, {n_out}] "
                             f"(numpy shape ({n_out}, {n_in}) = (n_out, n_in))")
        raise ValueError(f"tensor {t.name}: ne = {list(t.ne)}, expected {list(reversed(shape))} "
                         f"(numpy shape {tuple(shape)})")
    try:
        return QTensor(_aligned_bytes(t), t.type_id, tuple(shape))
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


class _Tensors:
    """Attributes named by an architecture's tensor declarations (arch/spec.py's T.field); a
    field the architecture does not declare reads as None."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class Layer(_Tensors):
    """One block's tensors: wq, wk, wv, wo, wg, wu, wd (QTensor), attn_norm, ffn_norm, bq, ...
    (float32 vectors), as the architecture declares them (None where absent)."""


class Weights(_Tensors):
    """The model-level tensors and the layers. output is token_embd when tied (no output.weight);
    n_logits = output's rows; rope_freqs: the RoPE frequency factors, or None."""


def _read(tensors, specs, prefix, obj):
    """read the declared tensors `specs` (arch/spec.py's T) of one layer (prefix "blk.{i}.") or
    of the model (prefix "") into obj's fields"""
    for s in specs:
        name = prefix + s.name
        t = tensors.get(name)
        if s.refuse:
            if t is not None:
                raise ValueError(f"tensor {name}: {s.refuse}")
            continue
        if (s.unless and prefix + s.unless in tensors) or (s.requires and prefix + s.requires not in tensors):
            continue
        if t is None:
            if not s.optional:
                raise ValueError(f"GGUF is missing the tensor {name}")
            for f in s.fields:
                setattr(obj, f, None)
            continue
        v = _weight(t, s.shape) if len(s.shape) >= 2 else _vector(t, s.shape[0])
        if not s.split:
            setattr(obj, s.field, v)
            continue
        r = 0
        for f, rows in s.split:   # consecutive row ranges: views of the same bytes
            part = QTensor(v.raw[r:r + rows], v.qtype, (rows,) + v.shape[1:]) if len(s.shape) >= 2 else v[r:r + rows]
            setattr(obj, f, part)
            r += rows


def load_weights(gf, hp, n_ctx):
    """Every tensor the architecture declares (cpufuse/llama/arch/), checked against the
    hyperparameters: weights as QTensor views of the mapped file (`_weight`), 1-D vectors as
    float32 copies (`_vector`). A tensor the architecture does not declare is ignored. n_ctx: the
    context size (phi3's LongRoPE factors depend on it)."""
    spec = get_arch(hp.arch)
    model_specs, layer_specs = spec.tensors(Dims.of(hp))
    out = Weights()
    _read(gf.tensors, model_specs, "", out)
    out.tied = out.output is None
    if out.tied:
        out.output = out.tok_embd
    out.n_logits = out.output.n_out
    layers = []
    for i in range(hp.n_layer):
        L = Layer()
        _read(gf.tensors, layer_specs, f"blk.{i}.", L)
        layers.append(L)
    out.layers = layers
    # a mixture's stacked experts are views of the mapped file until repack_weights repacks them
    out.experts_mapped = any(isinstance(t, QTensor) and t.n_expert for L in layers for t in vars(L).values())
    if spec.finish is not None:
        spec.finish(out, hp, n_ctx)
    return out


def mem_available():
    """MemAvailable of /proc/meminfo in bytes, else the free physical pages (None where neither is known)"""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


MEM_MARGIN = 1 << 30   # what repacking leaves free for the KV cache, scratch and the rest


def repack_weights(w, gf, isa=None, progress=None):
    """Repack every quantized matmul weight for the kernels (QTensor.repack) and drop the file
    pages it came from (the token embedding stays mapped for its row lookups; a tied output
    gets its own repacked copy). A mixture's stacked expert weights (3-D) are repacked expert by
    expert, unless all the weights would not fit the memory available (MemAvailable less
    MEM_MARGIN): then they stay mapped from the file (w.experts_mapped True; the same results
    bit for bit, docs/moe.md)."""
    quant = [t for L in w.layers for t in vars(L).values() if isinstance(t, QTensor) and t.block_size > 1]
    avail = mem_available()
    w.experts_mapped = bool(avail is not None and any(t.n_expert for t in quant)
                            and sum(t.nbytes for t in quant) > avail - MEM_MARGIN)

    def rp(t):
        if t.n_expert and w.experts_mapped:
            return t
        p = t.repack(isa=isa)
        if p is not t:
            gf.release(t.raw)
        return p
    with _pages.arena():    # the panels packed into 2 MiB-aligned huge-page chunks (cpufuse/_pages.py)
        n = len(w.layers) + 1
        for i, L in enumerate(w.layers):
            for k, t in list(vars(L).items()):
                if isinstance(t, QTensor):
                    setattr(L, k, rp(t))
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
