"""gemma2: gemma3's blocks without the Q/K norms; the attention-logit softcap; sliding-window
layers on every even layer, on the global RoPE base and scale unless rope.freq_base_swa is set;
the final logit softcap, always on (default 30)."""
from . import _gemma, blocks
from .spec import Arch


def hparams(keys, hp):
    _gemma.scales(keys, hp, big_layers=46, final_default=30.0)
    hp.attn_softcap = keys.float("attn_logit_softcapping", 50.0, zero_ok=True)
    window = keys.int("attention.sliding_window", 4096, lo=0, hi=keys.MAX_N_CTX)
    hp.freq_base_swa = keys.float("rope.freq_base_swa", hp.freq_base)
    hp.freq_scale_swa = hp.freq_scale
    _gemma.sliding_window(keys, hp, window, pattern=2)


def forward(cx):
    x = blocks.embed_scale(cx, cx.hp.emb_scale)
    for li, L in enumerate(cx.layers):
        x = _gemma.layer(cx, li, L, x, softcap=cx.hp.attn_softcap)
    return _gemma.final_softcap(cx, blocks.head(cx, x))


ARCH = Arch("gemma2", rank=4, rope="neox", forward=forward, layer_tensors=lambda d: _gemma.layer_tensors(d, False),
            hparams=hparams, tiny_keys={"attention.sliding_window": 4, "attn_logit_softcapping": 50.0,
                       "final_logit_softcapping": 30.0},
            tiny_tokens=_gemma.TOKENS, tiny_eos="<|endoftext|>")
