"""qwen3: llama's blocks with a per-head RMSNorm of Q and K before RoPE, RoPE NEOX, no biases."""
from . import blocks
from .spec import T, Arch, ffn_tensors, out_tensors, qk_norm_tensors, qkv_tensors


def layer_tensors(d):
    return ([T("attn_norm.weight", (d.E,), "attn_norm")] + qkv_tensors(d) + qk_norm_tensors(d) + out_tensors(d)
            + [T("ffn_norm.weight", (d.E,), "ffn_norm")] + ffn_tensors(d))


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        x = blocks.pre_norm_layer(cx, li, L, x, qk_norm="head")
    return blocks.head(cx, x)


ARCH = Arch("qwen3", rank=2, rope="neox", forward=forward, layer_tensors=layer_tensors)
