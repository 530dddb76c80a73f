"""The float64 reference of the mixture-of-experts FFN (llama.cpp's build_moe_ffn) for
reference/archs.py: every step in float64, from the dequantized tensors of the file."""
import numpy as np

# general.architecture -> (gating, norm_w) as llama.cpp's builders hard-code them; the file's
# expert_gating_func / expert_weights_norm keys override (cpufuse/llama/arch/_moe.py)
ARCH_GATING = {"qwen3moe": ("softmax", True), "qwen2moe": ("softmax", False), "olmoe": ("softmax", False),
               "granitemoe": ("softmax", True)}
GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def routing(f, b, h):
    """(ids (n, k), weights (n, k), selection scores (n, n_expert)) of layer prefix b for the normed
    rows h: logits (+ router bias) -> probabilities -> (+ selection bias) -> top-k by a stable sort
    (ties: the lower expert) -> weights from the unbiased probabilities -> softmax over the k ->
    norm_w -> scale"""
    T = f.t
    gating, norm_w = ARCH_GATING[f.arch]
    gating = GATING.get(f.a("expert_gating_func", 0), gating)
    norm_w = bool(f.a("expert_weights_norm", norm_w))
    scale = f.a("expert_weights_scale", 0.0)
    k = f.a("expert_used_count")
    logits = h @ T[b + "ffn_gate_inp.weight"].T
    if b + "ffn_gate_inp.bias" in T:
        logits = logits + T[b + "ffn_gate_inp.bias"]
    probs = _softmax(logits) if gating == "softmax" else 1.0 / (1.0 + np.exp(-logits)) if gating == "sigmoid" \
        else logits
    sel = probs + T[b + "exp_probs_b.bias"] if b + "exp_probs_b.bias" in T else probs
    ids = np.argsort(-sel, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if gating == "softmax_weight":
        w = _softmax(w)
    if norm_w:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), 6.103515625e-5)
    if scale and scale != 1.0:
        w = w * scale
    return ids, w, sel


def ref_moe_ffn(f, b, h):
    """the routed FFN (+ the shared expert) of layer prefix b ("blk.{il}.") on the normed rows h
    (n, n_embd), float64"""
    T = f.t
    ids, w, _ = routing(f, b, h)
    G, U, D = T[b + "ffn_gate_exps.weight"], T[b + "ffn_up_exps.weight"], T[b + "ffn_down_exps.weight"]
    out = np.zeros_like(h)
    for r in range(h.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[r, j]
            out[r] += w[r, j] * (D[e] @ (_silu(G[e] @ h[r]) * (U[e] @ h[r])))
    if b + "ffn_gate_shexp.weight" in T:
        s = (_silu(h @ T[b + "ffn_gate_shexp.weight"].T) * (h @ T[b + "ffn_up_shexp.weight"].T)) \
            @ T[b + "ffn_down_shexp.weight"].T
        if b + "ffn_gate_inp_shexp.weight" in T:
            s = s * (1.0 / (1.0 + np.exp(-(h @ T[b + "ffn_gate_inp_shexp.weight"].reshape(-1)))))[:, None]
        out = out + s
    return out
