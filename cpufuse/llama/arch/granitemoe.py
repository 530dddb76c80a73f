"""granitemoe (Granite 3.x 1B-A400M, 3B-A800M): granite's blocks and four scalars (embedding,
attention, residual and logit scales) with a routed FFN: softmax gating, the top-k weights
renormalised (norm_w), SiLU experts, and an optional shared expert added without a gate
(llama.cpp's src/models/granite.cpp, build_layer_ffn)."""
from . import _moe, blocks, granite
from .spec import T, Arch, out_tensors, qkv_tensors


def layer_tensors(d):
    return ([T("attn_norm.weight", (d.E,), "attn_norm")] + qkv_tensors(d) + out_tensors(d)
            + [T("ffn_norm.weight", (d.E,), "ffn_norm")] + _moe.moe_tensors(d, shared="optional"))


def hparams(keys, hp):
    granite.hparams(keys, hp)
    _moe.hparams(keys, hp, norm_w=True, shared="optional")


def forward(cx):
    return granite.forward(cx, ffn_block=_moe.moe_block)


ARCH = Arch("granitemoe", rank=23, rope="norm", forward=forward, layer_tensors=layer_tensors, hparams=hparams,
            tiny_dims=_moe.moe_dims(n_expert=8, n_expert_used=3, n_ff_shexp=32), tiny_keys=granite.ARCH.tiny_keys)
