"""smollm3: llama, except that the layers with (il + 1) % 4 == 0 skip RoPE (NoPE). The step of 4
is llama.cpp's n_no_rope_layer_step; there is no GGUF key for it."""
from . import blocks
from .spec import Arch, llama_layer_tensors

NOPE_STEP = 4


def hparams(keys, hp):
    hp.nope_layers = tuple((il + 1) % NOPE_STEP == 0 for il in range(hp.n_layer))


def forward(cx):
    x = cx.x
    for li, L in enumerate(cx.layers):
        x = blocks.pre_norm_layer(cx, li, L, x, rope=not cx.hp.nope_layers[li])
    return blocks.head(cx, x)


ARCH = Arch("smollm3", rank=6, rope="norm", forward=forward, layer_tensors=llama_layer_tensors,
            hparams=hparams)
