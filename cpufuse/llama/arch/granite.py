"""granite: llama plus four scalars: embedding_scale multiplies the input, attention.scale replaces
1/sqrt(head dim), residual_scale multiplies each branch before its residual add, and the logits
are multiplied by 1/logit_scale (the reciprocal rounded to f32, as ggml_scale). 0 or absent: unset."""
import numpy as np

from . import blocks
from .spec import Arch, llama_layer_tensors


def hparams(keys, hp):
    hp.emb_scale = keys.float("embedding_scale", 0.0, zero_ok=True)
    hp.residual_scale = keys.float("residual_scale", 0.0, zero_ok=True)
    hp.logit_scale = keys.float("logit_scale", 0.0, zero_ok=True)
    a = keys.float("attention.scale", 0.0, zero_ok=True)
    if a:
        hp.kq_scale = a


def forward(cx, ffn_block=blocks.ffn):
    """ffn_block: the FFN block (granitemoe: the routed experts)"""
    hp, s = cx.hp, cx.hp.residual_scale
    x = blocks.embed_scale(cx, hp.emb_scale)
    for li, L in enumerate(cx.layers):
        p = f"l{li}."
        r = blocks.scaled_add(cx, x, blocks.attention(cx, li, L, cx.norm(x, L.attn_norm, p + "attn_norm")), s,
                              p + "res")
        x = blocks.scaled_add(cx, r, ffn_block(cx, li, L, cx.norm(r, L.ffn_norm, p + "ffn_norm")), s, p + "out")
    y = blocks.head(cx, x)
    if hp.logit_scale:
        y = cx.g.scale(y, float(np.float32(1.0) / np.float32(hp.logit_scale)), name="logit_scale")
    return y


ARCH = Arch("granite", rank=7, rope="norm", forward=forward, layer_tensors=llama_layer_tensors,
            hparams=hparams, tiny_keys={"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.0078125,
                       "logit_scale": 8.0})
