"""phi3: llama's blocks from a fused attn_qkv (Q, K, V row ranges) and one ffn_up of 2*n_ff rows
(the gate's first, SwiGLU on the halves); RoPE NEOX, possibly partial (rope.dimension_count < the
head dim); LongRoPE: rope_factors_long when n_ctx > rope.scaling.original_context_length, else
rope_factors_short, as the RoPE frequency factors. Its sliding-window key is ignored, as
llama.cpp does."""
from .llama import forward as llama_forward
from .spec import T, Arch, ffn_tensors, head_tensors, out_tensors, qkv_tensors


def model_tensors(d):
    n = d.rot // 2
    return [T("rope_factors_long.weight", (n,), "rope_long", optional=True, init="rope_long"),
            T("rope_factors_short.weight", (n,), "rope_short", optional=True, init="rope_short")] + head_tensors(d)


def layer_tensors(d):
    return ([T("attn_norm.weight", (d.E,), "attn_norm")] + qkv_tensors(d) + out_tensors(d)
            + [T("ffn_norm.weight", (d.E,), "ffn_norm")] + ffn_tensors(d, fused_up=True))


def finish(w, hp, n_ctx):
    """LongRoPE: the long factors when the context exceeds the original one (llama.cpp
    build_rope_factors: n_ctx_per_seq > n_ctx_orig_yarn), chosen once for the model's n_ctx"""
    if w.rope_long is None:
        return
    which = "long" if n_ctx > hp.n_ctx_orig else "short"
    f = w.rope_long if which == "long" else w.rope_short
    if f is None:
        raise ValueError(f"GGUF is missing the tensor rope_factors_{which}.weight")
    w.rope_freqs = f


ARCH = Arch("phi3", rank=5, rope="neox", forward=llama_forward, layer_tensors=layer_tensors,
            model_tensors=model_tensors, finish=finish,
            tiny_rot=0.5, tiny_keys={"rope.scaling.original_context_length": 64, "rope.scaling.attn_factor": 1.19},
            tiny_options={"fused_qkv": True})
