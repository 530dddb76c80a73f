"""The shared blocks the architectures' forwards are built from (llama.cpp's build_norm,
build_attn, build_ffn): each adds nodes to the decoder graph through a `Ctx`.

    def forward(cx):                       # an architecture's builder (cpufuse/llama/arch/llama.py)
        x = cx.x
        for li, L in enumerate(cx.layers):
            x = pre_norm_layer(cx, li, L, x)
        return head(cx, x)

Node names are "l{li}.<part>" (plan.describe() and the tests read them).
"""
from __future__ import annotations

__all__ = ["Ctx", "attention", "ffn", "add", "post_norm_add", "scaled_add", "pre_norm_layer", "head",
           "embed_scale", "swa_layer"]


class Ctx:
    """What every block needs: the graph, the batch inputs (x, pos, idx), the model and its options,
    and kv(li) -> (k_cache, v_cache, cells, seqs, ring): layer li's cache arrays, the cell inputs
    its K/V writes and attention read, and its ring size (0: n_ctx cells per sequence), from the
    KV cache (cpufuse.llama.kv, KVCache.graph_inputs)."""

    def __init__(self, g, model, n, x, pos, idx, kv, hidden=False):
        self.g, self.m, self.hp, self.n = g, model, model.hparams, n
        self.hidden = hidden      # build the embeddings' output (head: the normed rows, no lm head)
        self.hidden_out = None
        self.x, self.pos, self.idx = x, pos, idx
        self.kv = kv
        self.layers = model.layers
        self.act = model.act
        self.rope_kw = {k: v for k, v in model.rope_kw.items() if k not in ("n_dims", "mode", "isa", "n_threads")}
        if self.rope_kw.get("freq_factors") is None:
            self.rope_kw.pop("freq_factors", None)

    def c(self, a, name):
        return self.g.constant(a, name)

    def norm(self, x, w, name):
        """RMS_NORM over the last axis, then MUL by the weight (fused into the consumer matmul's
        prologue by the plan)"""
        return self.g.mul(self.g.rms_norm(x, self.hp.eps, name=name), self.c(w, name + ".w"))

    def linear(self, x, w, b, name):
        y = self.g.qmatmul(x, w, act=self.act, name=name)
        return y if b is None else self.g.add(y, self.c(b, name + ".b"), name=name + "+b")

    def rope(self, x, name, kw=None):
        hp = self.hp
        return self.g.rope(x, self.pos, hp.n_rot, mode=hp.rope_mode, name=name, **(self.rope_kw if kw is None else kw))


def swa_layer(cx, li):
    """(window, RoPE keyword arguments) of layer li: a sliding-window layer's window and its own
    RoPE base and scale (gemma), else (0, the model's)"""
    hp = cx.hp
    if hp.swa_layers[li] and hp.swa_window:
        return hp.swa_window, {**cx.rope_kw, "freq_base": hp.freq_base_swa, "freq_scale": hp.freq_scale_swa}
    return 0, cx.rope_kw


def attention(cx, li, L, h, qk_norm=None, rope=True, rope_kw=None, window=0, softcap=0.0, sinks=None):
    """self-attention of layer li on h: Q/K/V (+ biases), the Q/K RMSNorms (qk_norm "head": per
    head before RoPE, qwen3/gemma3; "full": over the whole projection, olmo2), RoPE (rope=False:
    none, smollm3's NoPE layers; rope_kw: the layer's own base/scale), the K/V cell writes,
    attention per sequence (a sliding window when window > 0, the logit softcap when > 0; sinks:
    one sink logit per head, gpt-oss), the output projection"""
    g, hp, n, p = cx.g, cx.hp, cx.n, f"l{li}."
    H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
    q = cx.linear(h, L.wq, L.bq, p + "q")
    k = cx.linear(h, L.wk, L.bk, p + "k")
    v = cx.linear(h, L.wv, L.bv, p + "v")
    if qk_norm == "full":
        q, k = cx.norm(q, L.q_norm, p + "q_norm"), cx.norm(k, L.k_norm, p + "k_norm")
    q3, k3 = g.reshape(q, (n, H, D)), g.reshape(k, (n, Hkv, D))
    if qk_norm == "head":
        q3 = g.reshape(cx.norm(g.reshape(q3, (n * H, D)), L.q_norm, p + "q_norm"), (n, H, D))
        k3 = g.reshape(cx.norm(g.reshape(k3, (n * Hkv, D)), L.k_norm, p + "k_norm"), (n, Hkv, D))
    kc, vc, cells, seqs, ring = cx.kv(li)
    qk, qv = cx.m.kv.quant_k, cx.m.kv.quant_v    # block types (q8_0, q4_0) or None
    kw = g.kv_write(cx.rope(k3, p + "rope_k", rope_kw) if rope else k3, kc, cells, kv_type=qk, name=p + "k_cache")
    vw = g.kv_write(g.reshape(v, (n, Hkv, D)), vc, cells, kv_type=qv, name=p + "v_cache")
    a = g.attn_seqs(cx.rope(q3, p + "rope_q", rope_kw) if rope else q3, kw, vw, seqs, scale=hp.kq_scale,
                    softcap=softcap, window=window, ring=ring,
                    sinks=None if sinks is None else cx.c(sinks, p + "sinks"), name=p + "attn")
    return cx.linear(g.reshape(a, (n, H * D)), L.wo, L.bo, p + "o")


def ffn(cx, li, L, h, act="silu"):
    """gated feed-forward on h: act(h.Wg) * (h.Wu), then down; act "silu" (SwiGLU) or "gelu"
    (the tanh GELU: GEGLU, gemma)"""
    g, p = cx.g, f"l{li}."
    gt = g.qmatmul(h, L.wg, act=cx.act, name=p + "gate")
    up = g.qmatmul(h, L.wu, act=cx.act, name=p + "up")
    a = g.gelu(gt, name=p + "gelu") if act == "gelu" else g.silu(gt, name=p + "silu")
    return cx.linear(g.mul(a, up, name=p + "ffn"), L.wd, L.bd, p + "down")


def add(cx, x, branch, name):
    """the residual add x + branch"""
    return cx.g.add(x, branch, name=name)


def post_norm_add(cx, x, branch, w, name):
    """x + norm(branch) (gemma, olmo2): one fused RMS_NORM -> MUL -> ADD"""
    return cx.g.add(cx.norm(branch, w, name + "_post"), x, name=name)


def scaled_add(cx, x, branch, s, name):
    """x + s * branch (granite's residual scale; s = 0: unset, x + branch)"""
    if s:
        branch = cx.g.scale(branch, s, name=name + "_scale")
    return cx.g.add(x, branch, name=name)


def pre_norm_layer(cx, li, L, x, ffn_block=None, **attn):
    """llama's block: x + attn(norm(x)), then + ffn(norm(.)); ffn_block: the FFN (cx, li, L, h) ->
    node (default ffn; the MoE archs' _moe.moe_block); attn: attention()'s options"""
    p = f"l{li}."
    r = add(cx, x, attention(cx, li, L, cx.norm(x, L.attn_norm, p + "attn_norm"), **attn), p + "res")
    return add(cx, r, (ffn_block or ffn)(cx, li, L, cx.norm(r, L.ffn_norm, p + "ffn_norm")), p + "out")


def embed_scale(cx, s):
    """the input rows times s (gemma's sqrt(n_embd), granite's embedding scale); s = 0: unchanged"""
    return cx.g.scale(cx.x, s, name="emb_scale") if s else cx.x


def head(cx, h):
    """the logits of the rows asked for (idx): the final norm, then the lm head (+ bias)"""
    g, m = cx.g, cx.m
    hn = cx.norm(g.gather_rows(h, cx.idx, name="last"), m.output_norm, "output_norm")
    if cx.hidden:       # the embeddings: these rows are the graph's output (decoder.build); no lm head
        cx.hidden_out = hn
        return hn
    return cx.linear(hn, m.output, m.output_bias, "output")
