"""The decoder graph: one builder per architecture, for every batch (docs/architecture.md).

A batch is n tokens that may belong to several sequences, each with its own KV cells:

    x     (n, n_embd) float32   the tokens' embedding rows
    pos   (n,) int32            each token's position (RoPE)
    cells (n,) int32            the KV cell each token's K and V are written to
    seqs  (n_groups, 4) int32   per sequence in the batch: (cell0, row0, n_rows, pos0): rows
                                row0.. are its tokens at positions pos0.. (consecutive), its
                                position p lives in cell cell0 + p (unused rows: n_rows = 0)
    idx   (m,) int32            the rows whose logits are wanted (e.g. each sequence's last)

(cells and seqs, and the rings' cells_swa and seqs_swa, are the KV cache's: cpufuse.llama.kv.)

and the graph's output is the logits (m, n_vocab). Attention runs per sequence over exactly its
own cells (Graph.attn_seqs), so a token's result is what it gets when its sequence runs alone:
the same kernels, in the same order, on the same numbers, whatever else shares the batch.

`build(model, n, m, n_groups)` returns the Graph; `Decoder` compiles it once per capacity as a
cpufuse.graph.DynamicPlan (one C call per micro-batch or decode step, any n up to the capacity)
and runs batches through it. The layer functions mirror llama.cpp's build_graph for each
architecture; `ARCHS` maps a GGUF general.architecture to its builder.
"""
from __future__ import annotations

import numpy as np

from cpufuse.graph import DynamicPlan, Graph

__all__ = ["ARCHS", "build", "Decoder"]

F32 = np.float32


class _Ctx:
    """What every layer function needs: the graph, the batch inputs, the model and its options."""

    def __init__(self, g, model, n, x, pos, kv):
        self.g, self.m, self.hp, self.n = g, model, model.hparams, n
        self.x, self.pos = x, pos
        self.kv = kv       # kv(li) -> (k, v, cells, seqs, ring) of layer li (KVCache.graph_inputs)
        self.act = model.act
        self.rope_kw = {k: v for k, v in model.rope_kw.items() if k not in ("n_dims", "mode", "isa", "n_threads")}
        if self.rope_kw.get("freq_factors") is None:
            self.rope_kw.pop("freq_factors", None)

    def c(self, a, name):
        return self.g.constant(a, name)

    def norm(self, x, w, name):
        """RMS_NORM then MUL by the weight (fused into the consumer matmul's prologue by the plan)"""
        return self.g.mul(self.g.rms_norm(x, self.hp.eps, name=name), self.c(w, name + ".w"))

    def linear(self, x, w, b, name):
        y = self.g.qmatmul(x, w, act=self.act, name=name)
        return y if b is None else self.g.add(y, self.c(b, name + ".b"), name=name + "+b")

    def rope(self, x, name, kw=None):
        hp = self.hp
        return self.g.rope(x, self.pos, hp.n_rot, mode=hp.rope_mode, name=name, **(self.rope_kw if kw is None else kw))


def _rope_kw(cx, li):
    """layer li's RoPE parameters: the SWA layers' own base and scale (gemma)"""
    hp = cx.hp
    if hp.swa_layers[li] and hp.swa_window:
        return {**cx.rope_kw, "freq_base": hp.freq_base_swa, "freq_scale": hp.freq_scale_swa}
    return cx.rope_kw


def _attention(cx, li, L, h):
    """self-attention of layer li on the normalized input h: Q/K/V (+ biases), optional per-head
    Q/K RMSNorm (qwen3, gemma3), RoPE (none on NoPE layers), the K/V cell writes, attention per
    sequence (sliding window on SWA layers, the logit softcap of gemma2), the output projection"""
    g, hp, n, p = cx.g, cx.hp, cx.n, f"l{li}."
    H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim
    q = cx.linear(h, L.wq, L.bq, p + "q")
    k = cx.linear(h, L.wk, L.bk, p + "k")
    v = cx.linear(h, L.wv, L.bv, p + "v")
    q3, k3 = g.reshape(q, (n, H, D)), g.reshape(k, (n, Hkv, D))
    if L.q_norm is not None:
        q3 = g.reshape(cx.norm(g.reshape(q3, (n * H, D)), L.q_norm, p + "q_norm"), (n, H, D))
        k3 = g.reshape(cx.norm(g.reshape(k3, (n * Hkv, D)), L.k_norm, p + "k_norm"), (n, Hkv, D))
    rkw = None if hp.nope_layers[li] else _rope_kw(cx, li)
    window = hp.swa_window if hp.swa_layers[li] else 0
    kc, vc, cells, seqs, ring = cx.kv(li)     # ring: the cells per sequence of a ring, or 0
    kw = g.kv_write(k3 if rkw is None else cx.rope(k3, p + "rope_k", rkw), kc, cells, name=p + "k_cache")
    vw = g.kv_write(g.reshape(v, (n, Hkv, D)), vc, cells, name=p + "v_cache")
    a = g.attn_seqs(q3 if rkw is None else cx.rope(q3, p + "rope_q", rkw), kw, vw, seqs,
                    scale=hp.kq_scale, softcap=hp.attn_softcap, window=window, ring=ring, name=p + "attn")
    return cx.linear(g.reshape(a, (n, H * D)), L.wo, L.bo, p + "o")


def _ffn(cx, li, L, h):
    """gated feed-forward on the normalized input h: act(h.Wg) * (h.Wu), then down; act = SiLU
    (SwiGLU) or the tanh GELU (GEGLU, gemma)"""
    g, p = cx.g, f"l{li}."
    gt = g.qmatmul(h, L.wg, act=cx.act, name=p + "gate")
    up = g.qmatmul(h, L.wu, act=cx.act, name=p + "up")
    a = g.gelu(gt, name=p + "gelu") if cx.hp.ffn_act == "gelu" else g.silu(gt, name=p + "silu")
    return cx.linear(g.mul(a, up, name=p + "ffn"), L.wd, L.bd, p + "down")


def _residual(cx, x, branch, post_w, name):
    """x + branch; gemma: x + norm(branch) (one fused RMS_NORM -> MUL -> ADD); granite: x + s*branch"""
    g = cx.g
    if post_w is not None:
        return g.add(cx.norm(branch, post_w, name + "_post"), x, name=name)
    if cx.hp.residual_scale:
        branch = g.scale(branch, cx.hp.residual_scale, name=name + "_scale")
    return g.add(x, branch, name=name)


def _layer(cx, li, L, x):
    """a pre-norm transformer block: x + attn(norm(x)), then + ffn(norm(.))"""
    p = f"l{li}."
    r = _residual(cx, x, _attention(cx, li, L, cx.norm(x, L.attn_norm, p + "attn_norm")), L.post_attn_norm,
                  p + "res")
    return _residual(cx, r, _ffn(cx, li, L, cx.norm(r, L.ffn_norm, p + "ffn_norm")), L.post_ffn_norm, p + "out")


def _stack(cx):
    x = cx.x
    if cx.hp.emb_scale:
        x = cx.g.scale(x, cx.hp.emb_scale, name="emb_scale")
    for li, L in enumerate(cx.m.layers):
        x = _layer(cx, li, L, x)
    return x


def llama(cx):
    """llama: pre-norm blocks, RoPE NORM (adjacent pairs; hparams.rope_mode), no biases"""
    return _stack(cx)


def qwen2(cx):
    """qwen2: llama's blocks with Q/K/V biases (the layers carry them), RoPE NEOX"""
    return _stack(cx)


def qwen3(cx):
    """qwen3: per-head RMSNorm of Q and K before RoPE, RoPE NEOX, no biases"""
    return _stack(cx)


def gemma3(cx):
    """gemma3: embedding x sqrt(n_embd); per-head Q/K RMSNorm before NEOX RoPE; each branch output
    RMS-normed before its residual add; GEGLU (tanh GELU); q scale 1/sqrt(key_length); SWA layers
    (il % 6 < 5) with a sliding window and RoPE base 10000, global layers on rope.freq_base with the
    linear scaling; optional final logit softcap; lm_head tied to token_embd"""
    return _stack(cx)


def gemma2(cx):
    """gemma2: gemma3's blocks without Q/K norms, the attention-logit softcap, SWA on even layers,
    the final logit softcap"""
    return _stack(cx)


def phi3(cx):
    """phi3: llama's blocks from a fused attn_qkv and a fused ffn_up (gate rows first), RoPE NEOX,
    possibly partial (rope.dimension_count < head dim), LongRoPE factors (the model's rope_freqs)"""
    return _stack(cx)


def smollm3(cx):
    """smollm3: llama with no RoPE on every 4th layer ((il + 1) % 4 == 0)"""
    return _stack(cx)


def granite(cx):
    """granite: llama with an embedding scale, attention.scale as the q.k scale, a residual scale on
    each branch and the logits divided by logit_scale"""
    return _stack(cx)


ARCHS = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "gemma3": gemma3, "gemma2": gemma2, "phi3": phi3,
         "smollm3": smollm3, "granite": granite}


def build(model, n, m, n_groups):
    """The decoder graph of `model` for a batch of n tokens, m logits rows and n_groups sequences."""
    hp = model.hparams
    g = Graph()
    x = g.input("x", (n, hp.n_embd))
    pos = g.input("pos", (n,), np.int32)
    kv = model.kv.graph_inputs(g, n, n_groups)
    idx = g.input("idx", (m,), np.int32)
    cx = _Ctx(g, model, n, x, pos, kv)
    h = ARCHS[hp.arch](cx)
    hn = cx.norm(g.gather_rows(h, idx, name="last"), model.output_norm, "output_norm")
    y = cx.linear(hn, model.output, model.output_bias, "output")
    if hp.logit_scale:      # granite: logits * (1 / logit_scale), as llama.cpp's ggml_scale
        y = g.scale(y, float(np.float32(1.0) / np.float32(hp.logit_scale)), name="logit_scale")
    if hp.final_softcap:    # gemma2 (gemma3 when set): cap * tanh(logits / cap)
        y = g.softcap(y, hp.final_softcap, name="final_softcap")
    g.output(y)
    return g


class Decoder:
    """Compiled decoder plans of one model, by capacity: (n tokens, m logits rows, n_groups)."""

    def __init__(self, model, fusion=None, isa=None):
        self.model, self.fusion, self.isa = model, fusion, isa
        self.plans = {}

    def plan(self, n_cap, m_cap, n_groups):
        key = (n_cap, m_cap, n_groups)
        dp = self.plans.get(key)
        if dp is None:
            dp = self.plans[key] = DynamicPlan(
                lambda n, m: build(self.model, n, m, n_groups), {"n": n_cap, "m": m_cap},
                fusion=self.fusion, isa=self.isa)
        return dp

    def run(self, cap, x, pos, idx, cells, n_threads=None):
        """Logits (len(idx), n_vocab) of a batch, on the plan of capacity cap = (n, m, n_groups);
        the plan's buffer, valid until its next run. cells: the batch's KV cell inputs
        (KVCache.batch_inputs)."""
        dp = self.plan(*cap)
        n, m = x.shape[0], idx.shape[0]
        return dp.run({"n": n, "m": m}, n_threads=n_threads, x=x, pos=pos, idx=idx, **cells)[0]


class Step:
    """A decode step of slot 0 (Model.eval of one token): what Batch(model).add(0, [token], pos)
    and run() compute on the decode plan (capacity (1, 1, 1)), with the plan's inputs bound once,
    so a token costs a few array stores, the embedding call and the plan's C call.

        step = Step(model)
        logits = step(token, pos, n_threads)      # (1, n_vocab), the plan's buffer"""

    def __init__(self, model):
        self.ids = np.zeros(1, np.int64)
        self.x = np.empty((1, model.hparams.n_embd), F32)
        self.pos = np.zeros(1, np.int32)
        cells, self.set_cells = model.kv.step_inputs(0)
        self.embed = model.embedder(self.ids, self.x)
        self.run = model.decoder.plan(1, 1, 1).bind({"n": 1, "m": 1}, x=self.x, pos=self.pos,
                                                      idx=np.zeros(1, np.int32), **cells)

    def __call__(self, token, pos, n_threads=None):
        self.ids[0] = token
        self.embed()
        self.pos[0] = pos
        self.set_cells(pos)
        return self.run(n_threads=n_threads)[0]


class Batch:
    """One decoder call over several sequences, each in its own KV slot of n_ctx cells.

        b = Batch(model)
        b.add(slot=0, tokens=[...], pos0=0, logits=True)   # a prompt chunk: logits of its last token
        b.add(slot=3, tokens=[t], pos0=57, logits=True)    # a decode step of another sequence
        rows = b.run(decoder, cap)                         # one logits row per add(logits=True)

    Slot s holds positions 0..n_ctx-1 of its sequence in the model's KV cache (model.kv, which
    lays out the cells: cpufuse.llama.kv)."""

    def __init__(self, model):
        self.m = model
        self.tokens, self.pos, self.seqs, self.idx = [], [], [], []   # seqs: (slot, row0, n_rows, pos0)

    def add(self, slot, tokens, pos0, logits=True):
        n = len(tokens)
        self.m.kv.check_group(slot, n, pos0)
        r0 = len(self.tokens)
        self.tokens += [int(t) for t in tokens]
        self.pos += range(pos0, pos0 + n)
        self.seqs.append((slot, r0, n, pos0))
        if logits:
            self.idx.append(r0 + n - 1)
        return len(self.idx) - 1 if logits else None

    def __len__(self):
        return len(self.tokens)

    def run(self, decoder, cap, n_threads=None):
        """Logits (len(idx), n_vocab) of the rows asked for: the plan's buffer (valid until its next
        run). cap = (n_tokens, n_logits, n_groups) capacities of the plan to use."""
        n, m, g = len(self.tokens), len(self.idx), len(self.seqs)
        if n == 0 or n > cap[0] or m > cap[1] or g > cap[2]:
            raise ValueError(f"batch: {n} tokens, {m} logits rows, {g} sequences do not fit the capacity {cap}")
        x = np.empty((n, self.m.hparams.n_embd), F32)
        self.m.embed(self.tokens, x)
        idx = self.idx or [n - 1]   # a plan computes >= 1 logits row: one nobody asked for
        cells = self.m.kv.batch_inputs(self.seqs, n, cap[2])
        out = decoder.run(cap, x, np.asarray(self.pos, np.int32), np.asarray(idx, np.int32), cells,
                          n_threads=n_threads)
        return out[:m]
