"""gpt-oss (gpt-oss-20b, gpt-oss-120b; general.architecture "gpt-oss", llama.cpp's
src/models/openai-moe-iswa.cpp): pre-norm attention with Q/K/V/O biases, NEOX RoPE with YaRN
(rope.scaling.*), a learned sink logit per head (attn_sinks) and sliding-window attention on the
even layers (window attention.sliding_window, 128 in the released files); the post_attention_norm
is the pre-FFN norm; the FFN is a mixture of experts: router with bias, top-k on the raw logits,
a softmax over the k (gating softmax_weight, no norm_w), a bias per expert after each routed matmul
(add_id's) and swiglu_oai (min(g, 7), clamp(u, +-7), alpha 1.702), all in the routed matmuls'
epilogues (docs/architectures.md, docs/moe.md "gpt-oss").

    y = experts(cx, li, L, h)      # the routed FFN of layer li on the normed rows h
"""
import math

import numpy as np

from cpufuse.quant.types import QTensor, dequantize

from . import _moe, blocks
from .spec import T, Arch, head_tensors, qkv_tensors

SWA_PATTERN = 2   # llama.cpp's set_swa_pattern(2): layer il slides iff il % 2 == 0


def layer_tensors(d):
    """attn_norm, Q/K/V and output (biases), the sinks, post_attention_norm (the pre-FFN norm), the
    router (+ bias) and the stacked experts with their per-expert biases"""
    X, FX, E = d.X, d.FX, d.E
    moe = [t for t in _moe.moe_tensors(d) if not t.refuse and t.name != "exp_probs_b.bias"]
    moe = [T(t.name, t.shape, t.field, optional=False, tiny="") if t.name == "ffn_gate_inp.bias" else t for t in moe]
    out = [T("attn_output.weight", (E, d.H * d.D), "wo"), T("attn_output.bias", (E,), "bo", optional=True, tiny="biases")]
    return ([T("attn_norm.weight", (E,), "attn_norm")] + qkv_tensors(d) + out
            + [T("attn_sinks.weight", (d.H,), "attn_sinks"), T("post_attention_norm.weight", (E,), "post_attn_norm")]
            + moe + [T("ffn_gate_exps.bias", (X, FX), "bg_exps", init="router"),
                     T("ffn_up_exps.bias", (X, FX), "bu_exps", init="router"),
                     T("ffn_down_exps.bias", (X, E), "bd_exps", init="router")])


def hparams(keys, hp):
    _moe.hparams(keys, hp, norm_w=False, gating="softmax_weight")
    window = keys.int("attention.sliding_window", 0, lo=0, hi=keys.MAX_N_CTX)
    if window:
        hp.swa_window = window
        hp.swa_layers = tuple(il % SWA_PATTERN < SWA_PATTERN - 1 for il in range(hp.n_layer))
    hp.freq_base_swa, hp.freq_scale_swa = hp.freq_base, hp.freq_scale   # one RoPE for every layer
    hp.kq_scale = 1.0 / math.sqrt(hp.n_rot)


def _rows(t):
    """a bias table (rows, width) as float32 (F32 in the released files; any type dequantized)"""
    if isinstance(t, QTensor):
        return np.ascontiguousarray(dequantize(t.raw.reshape(t.shape[0], -1), t.qtype, t.n_in), np.float32)
    return np.ascontiguousarray(t, np.float32)


def experts(cx, li, L, h):
    """the routed FFN of layer li on h (n, n_embd): logits = router(h) + bias; the top-k of the
    logits (ties: the lower expert); their softmax as the weights (normw / scale when the file asks);
    per expert gate and up + their biases and swiglu_oai (one routed matmul), down + its bias; the weighted
    sum in slot order"""
    g, hp, n, p = cx.g, cx.hp, cx.n, f"l{li}."
    k, F, E = hp.n_expert_used, hp.n_ff_exp, hp.n_embd
    logits = g.add(g.qmatmul(h, L.router, act=cx.act, name=p + "router"), cx.c(L.router_b, p + "router.b"),
                   name=p + "router+b")
    probs = g.softmax(logits, name=p + "probs") if hp.expert_gating == "softmax" else \
        g.sigmoid(logits, name=p + "probs") if hp.expert_gating == "sigmoid" else logits
    ids = g.topk(probs, k, name=p + "topk")
    w = g.take(probs, ids, name=p + "weights")
    if hp.expert_gating == "softmax_weight":
        w = g.softmax(w, name=p + "weights_softmax")
    scale = hp.expert_weights_scale if hp.expert_weights_scale not in (0.0, 1.0) else 0.0
    if hp.expert_weights_norm or scale:
        w = g.normw(w, _moe.NORM_W_FLOOR if hp.expert_weights_norm else 0.0, scale, name=p + "weights_norm")
    # gate and up one routed matmul, their biases and swiglu_oai its epilogue (the bits of add_id, add_id,
    # swiglu_oai); down's bias its epilogue too
    a = g.qmatmul_id(h, L.wg_exps, ids, act=cx.act, up=L.wu_exps, glu="swiglu_oai",
                     bias=cx.c(_rows(L.bg_exps), p + "gate_exps.b"), up_bias=cx.c(_rows(L.bu_exps), p + "up_exps.b"),
                     name=p + "gate_up_exps")
    y = g.qmatmul_id(g.reshape(a, (n * k, F)), L.wd_exps, g.reshape(ids, (n * k, 1)), act=cx.act,
                     bias=cx.c(_rows(L.bd_exps), p + "down_exps.b"), name=p + "down_exps")
    return g.wsum(g.reshape(y, (n, k, E)), w, name=p + "moe_out")


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        p = f"l{li}."
        window, rkw = blocks.swa_layer(cx, li)
        a = blocks.attention(cx, li, L, cx.norm(x, L.attn_norm, p + "attn_norm"), rope_kw=rkw, window=window,
                             sinks=L.attn_sinks)
        r = blocks.add(cx, x, a, p + "res")
        x = blocks.add(cx, r, experts(cx, li, L, cx.norm(r, L.post_attn_norm, p + "ffn_norm")), p + "out")
    return blocks.head(cx, x)


ARCH = Arch("gpt-oss", rank=30, rope="neox", forward=forward, layer_tensors=layer_tensors, model_tensors=head_tensors,
            hparams=hparams, tiny_dims={**_moe.moe_dims(n_expert=4, n_expert_used=2, n_ff_exp=32), "n_layer": 4},
            tiny_keys={"attention.sliding_window": 3, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                       "rope.scaling.original_context_length": 16},
            tiny_options={"biases": True}, tiny_tokens=("<|start|>", "<|message|>", "<|end|>", "<|return|>",
                                                        "<|channel|>", "<|call|>", "<|constrain|>"), tiny_eos="<|return|>")
