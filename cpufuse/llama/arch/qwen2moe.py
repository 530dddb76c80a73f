"""qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): qwen2's attention (Q/K/V biases, NEOX RoPE) and a
routed FFN with softmax gating and unnormalised top-k weights, plus a shared expert (SwiGLU)
whose output is multiplied by sigmoid(ffn_gate_inp_shexp . x) (llama.cpp's src/models/qwen2moe.cpp)."""
from . import _moe, blocks
from .spec import T, Arch, llama_layer_tensors


def layer_tensors(d):
    dense = [t for t in llama_layer_tensors(d) if not t.name.startswith(("ffn_gate", "ffn_up", "ffn_down"))]
    return dense + _moe.moe_tensors(d, shared="required", shared_gate=True)


def hparams(keys, hp):
    _moe.hparams(keys, hp, norm_w=False, shared="required")


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        x = blocks.pre_norm_layer(cx, li, L, x, ffn_block=_moe.moe_block)
    return blocks.head(cx, x)


ARCH = Arch("qwen2moe", rank=21, rope="neox", forward=forward, layer_tensors=layer_tensors, hparams=hparams,
            tiny_dims=_moe.moe_dims(n_ff_shexp=64), tiny_options={"biases": True})
