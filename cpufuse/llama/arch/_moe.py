"""Mixture-of-experts pieces the MoE architectures share (qwen3moe, qwen2moe, olmoe, granitemoe):
their GGUF keys, their FFN tensors and the routed FFN block, as llama.cpp's build_moe_ffn
(docs/moe.md).

    hparams(keys, hp, norm_w=...)      # expert_count, expert_used_count, ... into hp
    moe_tensors(d, shared=...)         # ffn_gate_inp, ffn_{gate,up,down}_exps, optional shared expert
    y = moe_ffn(cx, li, L, h)          # the routed FFN of layer li on the normed rows h
"""
from __future__ import annotations

import numpy as np

from cpufuse.quant.types import QTensor

from .spec import T

__all__ = ["hparams", "moe_tensors", "moe_ffn", "shared_ffn", "moe_block", "moe_dims", "GATING", "NORM_W_FLOOR"]

# {arch}.expert_gating_func: llama.cpp's llama_expert_gating_func_type (gguf-py writes 1 and 2; 3 is
# what gpt-oss's builder hard-codes: top-k on the raw logits, then a softmax over the k)
GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
NORM_W_FLOOR = 6.103515625e-5   # build_moe_ffn: w /= max(sum w, 2^-14)


def _bool(keys, suffix, default):
    if not keys.has(suffix):
        return default
    v = keys.value(suffix)
    if not isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{keys.key(suffix)} = {v!r}: expected a bool, found {keys.type(suffix)}")
    return bool(v)


def hparams(keys, hp, norm_w, gating="softmax", shared=None, ff_per_used=True):
    """Read the expert keys into hp. norm_w, gating: the architecture's (llama.cpp hard-codes them in
    each builder), which expert_weights_norm and expert_gating_func override when the file sets them.
    An absent expert_feed_forward_length is n_ff / expert_used_count (ff_per_used; else n_ff, olmoe),
    as llama.cpp's tensor shapes. shared: expert_shared_feed_forward_length is read, "required"
    (absent: n_ff, qwen2moe) or "optional" (0 or absent: no shared expert, granitemoe)."""
    hp.n_expert = keys.int("expert_count", lo=1, hi=1 << 16)
    hp.n_expert_used = keys.int("expert_used_count", lo=1, hi=hp.n_expert)
    hp.n_ff_exp = keys.int("expert_feed_forward_length", hp.n_ff // hp.n_expert_used if ff_per_used else hp.n_ff)
    if hp.n_ff_exp < 1:
        raise ValueError(f"{keys.key('expert_feed_forward_length')}: absent, and n_ff {hp.n_ff} / expert_used_count "
                         f"{hp.n_expert_used} is 0")
    hp.n_ff_shexp = 0
    if shared:
        hp.n_ff_shexp = keys.int("expert_shared_feed_forward_length", hp.n_ff if shared == "required" else 0,
                                 lo=1 if shared == "required" else 0)
    hp.expert_weights_norm = _bool(keys, "expert_weights_norm", norm_w)
    hp.expert_weights_scale = keys.float("expert_weights_scale", 0.0, zero_ok=True)
    g = keys.int("expert_gating_func", 0, lo=0, hi=3)
    if g == 0:
        hp.expert_gating = gating
    elif g in GATING:
        hp.expert_gating = GATING[g]
    if keys.has("expert_group_count") and keys.int("expert_group_count", 0, lo=0) > 1:
        raise ValueError(f"{keys.key('expert_group_count')}: group-limited routing is not supported")
    if keys.has("leading_dense_block_count") and keys.int("leading_dense_block_count", 0, lo=0):
        raise ValueError(f"{keys.key('leading_dense_block_count')}: leading dense layers are not supported")


def moe_tensors(d, shared=None, shared_gate=False):
    """The routed FFN's tensors: the router ffn_gate_inp (n_expert rows of n_embd) and its optional
    bias, the optional selection bias exp_probs_b, the stacked experts ffn_{gate,up}_exps (numpy
    (n_expert, n_ff_exp, n_embd)) and ffn_down_exps ((n_expert, n_embd, n_ff_exp)). shared: the
    shared expert ffn_{gate,up,down}_shexp ("required", "optional" or None); shared_gate: its
    sigmoid gate ffn_gate_inp_shexp (n_embd values, qwen2moe)."""
    E, X, FX, FS = d.E, d.X, d.FX, d.FS
    ts = [T("ffn_gate_inp.weight", (X, E), "router", init="router"),
          T("ffn_gate_inp.bias", (X,), "router_b", optional=True, tiny="moe_bias"),
          T("exp_probs_b.bias", (X,), "exp_probs_b", optional=True, tiny="moe_bias"),
          T("ffn_gate_exps.weight", (X, FX, E), "wg_exps"),
          T("ffn_up_exps.weight", (X, FX, E), "wu_exps"),
          T("ffn_down_exps.weight", (X, E, FX), "wd_exps")]
    no = "per-expert biases are not supported"
    ts += [T(f"ffn_{n}_exps.bias", (X, FX), refuse=no, tiny=None) for n in ("gate", "up")]
    ts.append(T("ffn_down_exps.bias", (X, E), refuse=no, tiny=None))
    if shared and FS:
        opt, tiny = shared == "optional", ("shexp" if shared == "optional" else "")
        ts += [T("ffn_gate_shexp.weight", (FS, E), "wg_shexp", optional=opt, tiny=tiny),
               T("ffn_up_shexp.weight", (FS, E), "wu_shexp", optional=opt, tiny=tiny),
               T("ffn_down_shexp.weight", (E, FS), "wd_shexp", optional=opt, tiny=tiny)]
        if shared_gate:
            ts.append(T("ffn_gate_inp_shexp.weight", (E,), "gate_shexp", init="bias"))
    return ts


def moe_ffn(cx, li, L, h):
    """The routed FFN of layer li on h (n, n_embd), in build_moe_ffn's order: router logits (+ bias)
    -> softmax / sigmoid / the raw logits (softmax_weight) -> + selection bias -> top-k (ties: the
    lower expert) -> the k weights from the unbiased probabilities -> softmax over the k
    (softmax_weight) -> norm_w -> scale; then each expert's routed rows through gate/up + SiLU and
    down (QMM_ID: the chosen experts' weights only, rows grouped by expert), then the weighted sum
    over the k in slot order. A row's result depends on that row only."""
    g, hp, n, p = cx.g, cx.hp, cx.n, f"l{li}."
    k, F = hp.n_expert_used, hp.n_ff_exp
    logits = g.qmatmul(h, L.router, act=cx.act, name=p + "router")
    if L.router_b is not None:
        logits = g.add(logits, cx.c(L.router_b, p + "router.b"), name=p + "router+b")
    gating = hp.expert_gating
    if gating == "softmax":
        probs = g.softmax(logits, name=p + "probs")
    elif gating == "sigmoid":
        probs = g.sigmoid(logits, name=p + "probs")
    else:
        probs = logits
    sel = probs if L.exp_probs_b is None else g.add(probs, cx.c(L.exp_probs_b, p + "exp_probs_b"),
                                                    name=p + "select")
    ids = g.topk(sel, k, name=p + "topk")
    w = g.take(probs, ids, name=p + "weights")
    if gating == "softmax_weight":
        w = g.softmax(w, name=p + "weights_softmax")
    scale = hp.expert_weights_scale if hp.expert_weights_scale not in (0.0, 1.0) else 0.0
    if hp.expert_weights_norm or scale:
        w = g.normw(w, NORM_W_FLOOR if hp.expert_weights_norm else 0.0, scale, name=p + "weights_norm")
    gu = g.qmatmul_id(h, L.wg_exps, ids, act=cx.act, up=L.wu_exps, glu="swiglu", name=p + "gate_up_exps")
    y = g.qmatmul_id(g.reshape(gu, (n * k, F)), L.wd_exps, g.reshape(ids, (n * k, 1)), act=cx.act,
                     name=p + "down_exps")
    return g.wsum(g.reshape(y, (n, k, hp.n_embd)), w, name=p + "moe_out")


def shared_ffn(cx, li, L, h, moe_out):
    """moe_out + the shared expert's SwiGLU FFN of h (none when the layer has no shared expert);
    qwen2moe's times sigmoid(ffn_gate_inp_shexp . h) per row"""
    if L.wg_shexp is None:
        return moe_out
    g, p = cx.g, f"l{li}."
    gt = g.qmatmul(h, L.wg_shexp, act=cx.act, name=p + "gate_shexp")
    up = g.qmatmul(h, L.wu_shexp, act=cx.act, name=p + "up_shexp")
    s = g.qmatmul(g.mul(g.silu(gt, name=p + "silu_shexp"), up, name=p + "ffn_shexp"), L.wd_shexp, act=cx.act,
                  name=p + "down_shexp")
    if L.gate_shexp is not None:
        gw = QTensor(np.ascontiguousarray(L.gate_shexp, np.float32).reshape(1, -1), "F32", (1, L.gate_shexp.size))
        gate = g.sigmoid(g.qmatmul(h, gw, act=cx.act, name=p + "gate_inp_shexp"), name=p + "shexp_gate")
        s = g.wsum(g.reshape(s, (cx.n, 1, cx.hp.n_embd)), gate, name=p + "shexp_gated")
    return g.add(moe_out, s, name=p + "moe+shexp")


def moe_block(cx, li, L, h):
    """the FFN of an MoE layer: the routed experts, plus the shared expert where the layer has one"""
    return shared_ffn(cx, li, L, h, moe_ffn(cx, li, L, h))


def moe_dims(n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=0):
    """tiny.py's MoE sizes (an Arch's tiny_dims)"""
    return {"n_expert": n_expert, "n_expert_used": n_expert_used, "n_ff_exp": n_ff_exp, "n_ff_shexp": n_ff_shexp}
