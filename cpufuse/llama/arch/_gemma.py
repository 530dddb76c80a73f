"""What gemma2 and gemma3 share: the Gemma block, its scales and its sliding-window keys."""
import math

import numpy as np

from . import blocks
from .spec import T, ffn_tensors, out_tensors, post_norm_tensors, qk_norm_tensors, qkv_tensors

TOKENS = ("<start_of_turn>", "<end_of_turn>")   # tiny.py's vocabulary: the Gemma turn tokens


def layer_tensors(d, qk_norm):
    """pre-norm, Q/K/V (+ the per-head Q/K norms), output, the branch outputs' norms (weights with
    Gemma's +1 already in), the pre-FFN norm, the GEGLU FFN"""
    return ([T("attn_norm.weight", (d.E,), "attn_norm")] + qkv_tensors(d)
            + (qk_norm_tensors(d) if qk_norm else []) + out_tensors(d) + post_norm_tensors(d)
            + [T("ffn_norm.weight", (d.E,), "ffn_norm")] + ffn_tensors(d))


def layer(cx, li, L, x, **attn):
    """x + norm(attn(norm(x))), then + norm(geglu(norm(.))); the layer's window and RoPE base and
    scale when it is a sliding-window layer; attn: attention()'s other options"""
    p = f"l{li}."
    window, rkw = blocks.swa_layer(cx, li)
    a = blocks.attention(cx, li, L, cx.norm(x, L.attn_norm, p + "attn_norm"), rope_kw=rkw, window=window, **attn)
    r = blocks.post_norm_add(cx, x, a, L.post_attn_norm, p + "res")
    f = blocks.ffn(cx, li, L, cx.norm(r, L.ffn_norm, p + "ffn_norm"), act="gelu")
    return blocks.post_norm_add(cx, r, f, L.post_ffn_norm, p + "out")


def final_softcap(cx, y):
    """cap * tanh(logits / cap) when final_softcap is set"""
    c = cx.hp.final_softcap
    return cx.g.softcap(y, c, name="final_softcap") if c else y


def scales(keys, hp, big_layers, final_default):
    """the embedding scale sqrtf(n_embd) (f32, as llama.cpp); the q scale 1/sqrt(key_length), except
    the 27B sizes (big_layers layers), which use 1/sqrt(n_embd / n_head); the final softcap"""
    hp.emb_scale = float(np.sqrt(np.float32(hp.n_embd)))
    big = hp.n_layer == big_layers
    hp.kq_scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head if big else hp.head_dim)
    hp.final_softcap = keys.float("final_logit_softcapping", final_default, zero_ok=True)


def sliding_window(keys, hp, window, pattern):
    """the SWA layers: attention.sliding_window_pattern (an integer n: layer il is SWA iff
    il % n < n - 1, n = 0: all, as llama.cpp's set_swa_pattern; or one bool per layer), used when
    the window is > 0"""
    L, key = hp.n_layer, "attention.sliding_window_pattern"
    swa = None
    if keys.has(key):
        v = keys.value(key)
        if isinstance(v, np.ndarray):
            if v.shape != (L,) or v.dtype.kind not in "biu":
                raise ValueError(f"{keys.key(key)}: a per-layer array needs one bool per layer (block_count = {L}), "
                                 f"found {keys.type(key)} of {v.size}")
            swa = tuple(bool(b) for b in v.tolist())
        else:
            pattern = keys.int(key, lo=0, hi=keys.MAX_LAYERS)
    if swa is None:
        swa = tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(L))
    if window > 0:
        hp.swa_window, hp.swa_layers = window, swa
