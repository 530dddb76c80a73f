"""llama: pre-norm blocks (RMSNorm, attention, SwiGLU), RoPE NORM (adjacent pairs), no biases."""
from . import blocks
from .spec import Arch, llama_layer_tensors


def hparams(keys, hp):
    if hp.n_rot != hp.head_dim:
        raise ValueError(f"{keys.key('rope.dimension_count')} = {hp.n_rot}: must equal the head dim "
                         f"{hp.head_dim} for llama (llama.cpp rejects this too)")


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        x = blocks.pre_norm_layer(cx, li, L, x)
    return blocks.head(cx, x)


ARCH = Arch("llama", rank=0, rope="norm", forward=forward, layer_tensors=llama_layer_tensors,
            hparams=hparams)
