"""olmoe (OLMoE-1B-7B): pre-norm blocks whose Q and K are RMS-normed over the full projection
(before the split into heads), NEOX RoPE, and a routed FFN: softmax gating, unnormalised top-k
weights, SiLU experts (llama.cpp's src/models/olmoe.cpp)."""
from . import _moe, blocks
from .spec import T, Arch, out_tensors, qk_norm_tensors, qkv_tensors


def layer_tensors(d):
    return ([T("attn_norm.weight", (d.E,), "attn_norm")] + qkv_tensors(d) + qk_norm_tensors(d, full=True)
            + out_tensors(d) + [T("ffn_norm.weight", (d.E,), "ffn_norm")] + _moe.moe_tensors(d))


def hparams(keys, hp):
    _moe.hparams(keys, hp, norm_w=False, ff_per_used=False)


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        x = blocks.pre_norm_layer(cx, li, L, x, ffn_block=_moe.moe_block, qk_norm="full")
    return blocks.head(cx, x)


ARCH = Arch("olmoe", rank=22, rope="neox", forward=forward, layer_tensors=layer_tensors, hparams=hparams,
            tiny_dims=_moe.moe_dims(n_expert=6, n_expert_used=3))
