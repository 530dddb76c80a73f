"""olmo2 (OLMo 2): no pre-norms. Q and K are RMS-normed over the full projection (n_head * head_dim
and n_head_kv * head_dim values, before splitting into heads), then NEOX RoPE; each branch output
is RMS-normed (post_attention_norm, post_ffw_norm) before its residual add; SwiGLU FFN. As
llama.cpp's src/models/olmo2.cpp. OLMo 3's sliding-window layers (attention.sliding_window > 0)
are refused."""
from . import blocks
from .spec import Arch, ffn_tensors, out_tensors, post_norm_tensors, qk_norm_tensors, qkv_tensors


def layer_tensors(d):
    return qkv_tensors(d) + qk_norm_tensors(d, full=True) + out_tensors(d) + post_norm_tensors(d) + ffn_tensors(d)


def hparams(keys, hp):
    w = keys.int("attention.sliding_window", 0, lo=0, hi=keys.MAX_N_CTX)
    if w:
        raise ValueError(f"{keys.key('attention.sliding_window')} = {w}: OLMo 3's sliding-window layers are "
                         "not supported (only 0 or absent)")


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        p = f"l{li}."
        r = blocks.post_norm_add(cx, x, blocks.attention(cx, li, L, x, qk_norm="full"), L.post_attn_norm, p + "res")
        x = blocks.post_norm_add(cx, r, blocks.ffn(cx, li, L, r), L.post_ffn_norm, p + "out")
    return blocks.head(cx, x)


ARCH = Arch("olmo2", rank=8, rope="neox", forward=forward, layer_tensors=layer_tensors, hparams=hparams)
