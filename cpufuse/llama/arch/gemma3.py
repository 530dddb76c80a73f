"""gemma3: the embedding times sqrt(n_embd); per-head Q/K RMSNorm before NEOX RoPE; each branch
output RMS-normed before its residual add; GEGLU (tanh GELU); q scale 1/sqrt(key_length);
sliding-window layers (il % 6 < 5) on RoPE base 10000 with scale 1, global layers on
rope.freq_base with the linear scaling; the optional final logit softcap; lm_head tied to
token_embd (docs/architectures.md)."""
from . import _gemma, blocks
from .spec import Arch


def hparams(keys, hp):
    _gemma.scales(keys, hp, big_layers=62, final_default=0.0)
    window = keys.int("attention.sliding_window", 0, lo=0, hi=keys.MAX_N_CTX)
    hp.freq_base_swa = keys.float("rope.freq_base_swa", 10000.0)
    hp.freq_scale_swa = 1.0
    _gemma.sliding_window(keys, hp, window, pattern=6)


def forward(cx):
    x = blocks.embed_scale(cx, cx.hp.emb_scale)
    for li, L in enumerate(cx.layers):
        x = _gemma.layer(cx, li, L, x, qk_norm="head")
    return _gemma.final_softcap(cx, blocks.head(cx, x))


ARCH = Arch("gemma3", rank=3, rope="neox", forward=forward, layer_tensors=lambda d: _gemma.layer_tensors(d, True),
            hparams=hparams, tiny_dims={"n_layer": 6}, tiny_keys={"attention.sliding_window": 4},
            tiny_tokens=_gemma.TOKENS, tiny_eos="<|endoftext|>")
