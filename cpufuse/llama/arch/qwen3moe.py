"""qwen3moe (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): qwen3's attention (per-head Q/K RMSNorm, NEOX
RoPE) and a routed FFN: softmax gating, top-k, the k weights renormalised (norm_w), SiLU experts,
no shared expert (llama.cpp's src/models/qwen3moe.cpp)."""
from . import _moe, blocks
from .spec import T, Arch, out_tensors, qk_norm_tensors, qkv_tensors


def layer_tensors(d):
    return ([T("attn_norm.weight", (d.E,), "attn_norm")] + qkv_tensors(d) + qk_norm_tensors(d) + out_tensors(d)
            + [T("ffn_norm.weight", (d.E,), "ffn_norm")] + _moe.moe_tensors(d))


def hparams(keys, hp):
    _moe.hparams(keys, hp, norm_w=True)


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        x = blocks.pre_norm_layer(cx, li, L, x, ffn_block=_moe.moe_block, qk_norm="head")
    return blocks.head(cx, x)


ARCH = Arch("qwen3moe", rank=20, rope="neox", forward=forward, layer_tensors=layer_tensors, hparams=hparams,
            tiny_dims=_moe.moe_dims())
