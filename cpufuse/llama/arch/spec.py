"""What an architecture declares (`Arch`), the tensor records it declares them with (`T`), and the
tensor lists most architectures share (the llama-style head, attention and gated FFN).

A tensor's shape is in numpy order: (n_out, n_in) for a matrix, (n,) for a vector, and any rank
for stacked weights (experts first). The loader (cpufuse/llama/loader.py) reads each declared
tensor into the field it names; the tiny-model writer (cpufuse/llama/tiny.py) writes the ones its
`tiny` condition selects, in the declared order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

__all__ = ["T", "Arch", "Dims", "head_tensors", "qkv_tensors", "out_tensors", "qk_norm_tensors",
           "post_norm_tensors", "ffn_tensors"]


class Dims(NamedTuple):
    """The sizes tensor shapes are written in: n_embd, heads, kv heads, head dim, n_ff, n_vocab,
    rotary dims, layers; mixtures of experts: experts, an expert's n_ff, the shared expert's n_ff
    (0 when none)"""
    E: int
    H: int
    Hkv: int
    D: int
    FF: int
    V: int
    rot: int
    L: int
    X: int = 0
    FX: int = 0
    FS: int = 0

    @classmethod
    def of(cls, hp):
        return cls(hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab, hp.n_rot, hp.n_layer,
                   hp.n_expert, hp.n_ff_exp, hp.n_ff_shexp)


@dataclass(frozen=True)
class T:
    """One tensor an architecture reads.

    name      GGUF name; a layer's without its "blk.{i}." prefix
    shape     numpy order (n_out, n_in), (n,), or any rank
    field     the Weights / Layer attribute it becomes
    optional  absent: the field(s) are None (else the load fails naming it)
    split     ((field, rows), ...): one tensor read as consecutive row ranges (fused Q/K/V)
    unless    not read when this tensor of the same layer is present (it replaces this one)
    requires  read only when this tensor of the same layer is present
    refuse    present: the load fails with this reason
    tiny      when tiny.py writes it: "" always, None never, an option name ("biases",
              "fused_qkv", "untied") when it is on, "!option" when it is off
    init      tiny.py's random values: "" (by name: norm weights near 1, biases small, matrices
              ~1/sqrt(n_in)), "rope_long" or "rope_short" (LongRoPE factors)"""
    name: str
    shape: tuple
    field: str = ""
    optional: bool = False
    split: tuple = ()
    unless: str = ""
    requires: str = ""
    refuse: str = ""
    tiny: object = ""
    init: str = ""

    @property
    def fields(self):
        return tuple(f for f, _ in self.split) if self.split else ((self.field,) if self.field else ())


@dataclass(frozen=True)
class Arch:
    """One architecture, declared in one module of cpufuse/llama/arch/.

    name           general.architecture
    rank           its place in the supported list (the order they were added)
    rope           "norm" (adjacent pairs) or "neox" (halves)
    model_tensors  Dims -> [T]: the tensors outside the layers
    layer_tensors  Dims -> [T]: one layer's tensors (names without "blk.{i}.")
    forward        blocks.Ctx -> the logits node: the decoder graph, built from arch/blocks.py
    hparams        (keys, hp) -> None: its GGUF keys, defaults and rules (keys: hparams.Keys)
    finish         (weights, hp, n_ctx) -> None: load-time choices after the tensors are read
    tiny_*         tiny.py's model: dims overrides, the fraction of the head dim that rotates,
                   {key suffix: value} of its keys, options on by default, extra special tokens,
                   the EOS token's text"""
    name: str
    rank: int
    rope: str
    forward: Callable
    layer_tensors: Callable
    model_tensors: Callable = None
    hparams: Callable = None
    finish: Callable = None
    tiny_dims: dict = field(default_factory=dict)
    tiny_rot: float = 1.0
    tiny_keys: dict = field(default_factory=dict)
    tiny_options: dict = field(default_factory=dict)
    tiny_tokens: tuple = ()
    tiny_eos: str = "<|im_end|>"

    def tensors(self, d):
        """(model-level tensors, one layer's tensors) at the sizes d"""
        return (self.model_tensors or head_tensors)(d), self.layer_tensors(d)


# ------------------------------------------------------------------------------- shared lists
def head_tensors(d):
    """token embedding, final norm, lm head (token_embd when absent: tied), optional output bias and
    RoPE frequency factors"""
    return [T("token_embd.weight", (d.V, d.E), "tok_embd"),
            T("output_norm.weight", (d.E,), "output_norm"),
            T("output.weight", (d.V, d.E), "output", optional=True, tiny="untied"),
            T("output.bias", (d.V,), "output_bias", optional=True, tiny=None),
            T("rope_freqs.weight", (d.rot // 2,), "rope_freqs", optional=True, tiny=None)]


def qkv_tensors(d):
    """Q, K, V projections: attn_q/k/v, or one fused attn_qkv read as three row ranges; optional
    biases (qwen2's, written by tiny.py's "biases" option)"""
    q, kv, E = d.H * d.D, d.Hkv * d.D, d.E
    split = (("wq", q), ("wk", kv), ("wv", kv))
    bsplit = (("bq", q), ("bk", kv), ("bv", kv))
    fused = "attn_qkv.weight"
    return [T(fused, (q + 2 * kv, E), split=split, optional=True, tiny="fused_qkv"),
            T("attn_q.weight", (q, E), "wq", unless=fused, tiny="!fused_qkv"),
            T("attn_k.weight", (kv, E), "wk", unless=fused, tiny="!fused_qkv"),
            T("attn_v.weight", (kv, E), "wv", unless=fused, tiny="!fused_qkv"),
            T("attn_qkv.bias", (q + 2 * kv,), split=bsplit, optional=True, requires=fused, tiny=None),
            T("attn_q.bias", (q,), "bq", optional=True, unless=fused, tiny="biases"),
            T("attn_k.bias", (kv,), "bk", optional=True, unless=fused, tiny="biases"),
            T("attn_v.bias", (kv,), "bv", optional=True, unless=fused, tiny="biases")]


def qk_norm_tensors(d, full=False):
    """the Q and K RMSNorm weights: per head (D values), or over the full projection (olmo2)"""
    return [T("attn_q_norm.weight", ((d.H if full else 1) * d.D,), "q_norm"),
            T("attn_k_norm.weight", ((d.Hkv if full else 1) * d.D,), "k_norm")]


def out_tensors(d):
    """the attention output projection and its optional bias"""
    return [T("attn_output.weight", (d.E, d.H * d.D), "wo"),
            T("attn_output.bias", (d.E,), "bo", optional=True, tiny=None)]


def post_norm_tensors(d):
    """the norms of the branch outputs, applied before the residual adds (gemma, olmo2)"""
    return [T("post_attention_norm.weight", (d.E,), "post_attn_norm"),
            T("post_ffw_norm.weight", (d.E,), "post_ffn_norm")]


def ffn_tensors(d, fused_up=False):
    """the gated FFN: gate, up, down (optional down bias); fused_up: one ffn_up of 2*n_ff rows, the
    gate's first (phi3)"""
    E, FF = d.E, d.FF
    if fused_up:
        up = [T("ffn_up.weight", (2 * FF, E), split=(("wg", FF), ("wu", FF)))]
    else:
        up = [T("ffn_gate.weight", (FF, E), "wg"), T("ffn_up.weight", (FF, E), "wu")]
    no = "FFN gate/up biases are not supported"
    return up + [T("ffn_down.weight", (E, FF), "wd"),
                 T("ffn_down.bias", (E,), "bd", optional=True, tiny=None),
                 T("ffn_gate.bias", (FF,), refuse=no, tiny=None),
                 T("ffn_up.bias", (FF,), refuse=no, tiny=None)]


def llama_layer_tensors(d):
    """a pre-norm llama layer: attn_norm, Q/K/V, output, ffn_norm, gated FFN"""
    return ([T("attn_norm.weight", (d.E,), "attn_norm")] + qkv_tensors(d) + out_tensors(d)
            + [T("ffn_norm.weight", (d.E,), "ffn_norm")] + ffn_tensors(d))
