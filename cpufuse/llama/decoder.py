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
and runs batches through it. Each architecture's forward is its module's in cpufuse/llama/arch/,
built from the shared blocks of arch/blocks.py as llama.cpp's build_graph of it; `ARCHS` maps a
GGUF general.architecture to it.
"""
from __future__ import annotations

import numpy as np

from cpufuse.graph import DynamicPlan, Graph

from .arch import REGISTRY
from .arch.blocks import Ctx

__all__ = ["ARCHS", "build", "Decoder"]

F32 = np.float32

# general.architecture -> its builder (the forward of its module in cpufuse/llama/arch/)
ARCHS = {name: a.forward for name, a in REGISTRY.items()}


def build(model, n, m, n_groups, hidden=False):
    """The decoder graph of `model` for a batch of n tokens, m logits rows and n_groups sequences:
    the inputs, then its architecture's forward (cpufuse/llama/arch/), whose output is the logits.
    hidden: the output is the m rows' hidden states after output_norm, (m, n_embd) (the
    embeddings), and the lm head is not built (blocks.head)."""
    hp = model.hparams
    g = Graph()
    x = g.input("x", (n, hp.n_embd))
    pos = g.input("pos", (n,), np.int32)
    kv = model.kv.graph_inputs(g, n, n_groups)
    idx = g.input("idx", (m,), np.int32)
    cx = Ctx(g, model, n, x, pos, idx, kv, hidden=hidden)
    y = REGISTRY[hp.arch].forward(cx)
    if hidden and cx.hidden_out is None:
        raise NotImplementedError(f"{hp.arch}: its forward does not end in blocks.head, so it has no hidden-state output")
    g.output(cx.hidden_out if hidden else y)
    return g


class Decoder:
    """Compiled decoder plans of one model, by capacity: (n tokens, m logits rows, n_groups), and
    by output (logits, or with hidden the hidden states: build)."""

    def __init__(self, model, fusion=None, isa=None):
        self.model, self.fusion, self.isa = model, fusion, isa
        self.plans = {}

    def plan(self, n_cap, m_cap, n_groups, hidden=False):
        key = (n_cap, m_cap, n_groups) + (("hidden",) if hidden else ())
        dp = self.plans.get(key)
        if dp is None:
            dp = self.plans[key] = DynamicPlan(
                lambda n, m: build(self.model, n, m, n_groups, hidden), {"n": n_cap, "m": m_cap},
                fusion=self.fusion, isa=self.isa)
        return dp

    def run(self, cap, x, pos, idx, cells, n_threads=None, hidden=False):
        """Logits (len(idx), n_vocab) of a batch, on the plan of capacity cap = (n, m, n_groups);
        the plan's buffer, valid until its next run. cells: the batch's KV cell inputs
        (KVCache.batch_inputs). hidden: the hidden states (len(idx), n_embd) instead (build)."""
        dp = self.plan(*cap, hidden=hidden)
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

    def __call__(self, token, pos, n_threads=None, out=None):
        """the logits (1, n_logits): the plan's buffer, or out (such an array, which the head's
        kernel then writes directly: no copy)"""
        self.ids[0] = token
        self.embed()
        self.pos[0] = pos
        self.set_cells(pos)
        return self.run(n_threads=n_threads, out=None if out is None else (out,))[0]


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

    def run(self, decoder, cap, n_threads=None, hidden=False):
        """Logits (len(idx), n_vocab) of the rows asked for: the plan's buffer (valid until its next
        run). cap = (n_tokens, n_logits, n_groups) capacities of the plan to use. hidden: their
        hidden states after output_norm (len(idx), n_embd) instead (the embeddings)."""
        n, m, g = len(self.tokens), len(self.idx), len(self.seqs)
        if n == 0 or n > cap[0] or m > cap[1] or g > cap[2]:
            raise ValueError(f"batch: {n} tokens, {m} logits rows, {g} sequences do not fit the capacity {cap}")
        x = np.empty((n, self.m.hparams.n_embd), F32)
        self.m.embed(self.tokens, x)
        idx = self.idx or [n - 1]   # a plan computes >= 1 logits row: one nobody asked for
        cells = self.m.kv.batch_inputs(self.seqs, n, cap[2])
        out = decoder.run(cap, x, np.asarray(self.pos, np.int32), np.asarray(idx, np.int32), cells,
                          n_threads=n_threads, hidden=hidden)
        return out[:m]
