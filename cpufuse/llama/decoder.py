"""The decoder graph: one builder per architecture, for every batch (docs/architecture.md).

A batch is n tokens that may belong to several sequences, each with its own KV cells:

    x     (n, n_embd) float32   the tokens' embedding rows
    pos   (n,) int32            each token's position (RoPE)
    cells (n,) int32            the KV cell each token's K and V are written to
    seqs  (n_groups, 4) int32   per sequence in the batch: (cell0, row0, n_rows, pos0): rows
                                row0.. are its tokens at positions pos0.. (consecutive), its
                                position p lives in cell cell0 + p (unused rows: n_rows = 0)
    idx   (m,) int32            the rows whose logits are wanted (e.g. each sequence's last)

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


def build(model, n, m, n_groups):
    """The decoder graph of `model` for a batch of n tokens, m logits rows and n_groups sequences:
    the inputs, then its architecture's forward (cpufuse/llama/arch/), whose output is the logits."""
    hp = model.hparams
    g = Graph()
    x = g.input("x", (n, hp.n_embd))
    pos = g.input("pos", (n,), np.int32)
    cells = g.input("cells", (n,), np.int32)
    seqs = g.input("seqs", (n_groups, 4), np.int32)
    idx = g.input("idx", (m,), np.int32)
    ring = None
    if getattr(model, "swa_cells", 0):
        ring = (g.input("cells_swa", (n,), np.int32), g.input("seqs_swa", (n_groups, 4), np.int32))
    g.output(REGISTRY[hp.arch].forward(Ctx(g, model, n, x, pos, cells, seqs, idx, ring)))
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

    def run(self, cap, x, pos, cells, seqs, idx, n_threads=None, **ring):
        """Logits (len(idx), n_vocab) of a batch, on the plan of capacity cap = (n, m, n_groups);
        the plan's buffer, valid until its next run. ring: cells_swa= and seqs_swa= for a model
        whose sliding-window layers keep rings (model.swa_cells)."""
        dp = self.plan(*cap)
        n, m = x.shape[0], idx.shape[0]
        return dp.run({"n": n, "m": m}, n_threads=n_threads, x=x, pos=pos, cells=cells, seqs=seqs, idx=idx,
                      **ring)[0]


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
        self.cells = np.zeros(1, np.int32)
        self.seqs = np.array([[0, 0, 1, 0]], np.int32)   # (cell0, r0, nr, pos0) of slot 0
        ring = {}
        self.ring = getattr(model, "swa_cells", 0)
        if self.ring:
            ring = {"cells_swa": np.zeros(1, np.int32), "seqs_swa": np.array([[0, 0, 1, 0]], np.int32)}
        self.cells_swa, self.seqs_swa = ring.get("cells_swa"), ring.get("seqs_swa")
        self.embed = model.embedder(self.ids, self.x)
        self.run = model.decoder.plan(1, 1, 1).bind({"n": 1, "m": 1}, x=self.x, pos=self.pos, cells=self.cells,
                                                      seqs=self.seqs, idx=np.zeros(1, np.int32), **ring)

    def __call__(self, token, pos, n_threads=None):
        self.ids[0] = token
        self.embed()
        self.pos[0] = self.cells[0] = self.seqs[0, 3] = pos
        if self.ring:
            self.cells_swa[0] = pos % self.ring
            self.seqs_swa[0, 3] = pos
        return self.run(n_threads=n_threads)[0]


class Batch:
    """One decoder call over several sequences, each in its own KV slot of n_ctx cells.

        b = Batch(model)
        b.add(slot=0, tokens=[...], pos0=0, logits=True)   # a prompt chunk: logits of its last token
        b.add(slot=3, tokens=[t], pos0=57, logits=True)    # a decode step of another sequence
        rows = b.run(decoder, cap)                         # one logits row per add(logits=True)

    Slot s holds positions 0..n_ctx-1 of its sequence in cells s*n_ctx + position of the model's
    KV cache (model.k_cache[l] has n_seq * n_ctx rows)."""

    def __init__(self, model):
        self.m = model
        self.tokens, self.pos, self.cells, self.seqs, self.idx = [], [], [], [], []

    def add(self, slot, tokens, pos0, logits=True):
        n_ctx = self.m.n_ctx
        n = len(tokens)
        if not 0 <= slot < self.m.n_seq or n < 1 or pos0 < 0 or pos0 + n > n_ctx:
            raise ValueError(f"batch: slot {slot} with {n} tokens at position {pos0} does not fit "
                             f"{self.m.n_seq} slots of n_ctx = {n_ctx}")
        C = getattr(self.m, "swa_cells", 0)
        if C and n > C - self.m.hparams.swa_window + 1:
            raise ValueError(f"batch: {n} tokens of one sequence in one call do not fit the sliding-window "
                             f"layers' ring of {C} cells (window {self.m.hparams.swa_window} + n_batch "
                             f"{self.m.n_batch}); at most n_batch + 1 tokens per sequence and call")
        r0 = len(self.tokens)
        self.tokens += [int(t) for t in tokens]
        self.pos += range(pos0, pos0 + n)
        self.cells += range(slot * n_ctx + pos0, slot * n_ctx + pos0 + n)
        self.seqs.append((slot * n_ctx, r0, n, pos0))
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
        seqs = np.zeros((cap[2], 4), np.int32)
        seqs[:g] = self.seqs
        idx = self.idx or [n - 1]   # a plan computes >= 1 logits row: one nobody asked for
        ring = {}
        C = getattr(self.m, "swa_cells", 0)
        if C:   # the sliding-window layers' rings: slot s, position p in cell s*C + p % C
            n_ctx = self.m.n_ctx
            slot = np.asarray(self.cells, np.int64) // n_ctx
            ring["cells_swa"] = (slot * C + np.asarray(self.pos, np.int64) % C).astype(np.int32)
            sw = seqs.copy()
            sw[:g, 0] = seqs[:g, 0] // n_ctx * C
            ring["seqs_swa"] = sw
        out = decoder.run(cap, x, np.asarray(self.pos, np.int32), np.asarray(self.cells, np.int32), seqs,
                          np.asarray(idx, np.int32), n_threads=n_threads, **ring)
        return out[:m]
