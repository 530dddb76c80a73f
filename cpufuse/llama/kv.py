"""The KV cache of a model: the one module that knows where a token's K and V live (docs/kv.md).

    kv = KVCache.for_model(hparams, n_ctx=64, n_seq=3, n_batch=8)      # Model.load makes model.kv
    kv.check_group(slot=2, n=5, pos0=0)              # what Batch.add refuses (ValueError)
    inputs = kv.batch_inputs([(2, 0, 5, 0)], n=5, n_groups=4)    # {"cells": ..., "seqs": ..., ...}
    kv.copy_prefix(src=2, dst=0, n=4, n_cached=5)    # positions 0..3 of slot 2 into slot 0
    kv.reusable(keep, n_cached)                      # how much of a cached prefix a slot may reuse

Layout. n_seq slots of n_ctx cells: each layer's K and V are (n_seq * n_ctx, n_head_kv,
head_dim) arrays, and position p of slot s lives in cell s * n_ctx + p. Sliding-window layers
keep a ring of ring_cells = window + n_batch cells per slot instead, when that is less than
n_ctx (SWA_RINGS): position p of slot s lives in cell s * ring_cells + p % ring_cells
(docs/architectures.md). Without rings `k` and `v` are (n_layer, n_cells, n_head_kv, head_dim)
arrays; with rings, lists of per-layer arrays. `layer(li)` gives one layer's pair either way.

A batch's cell inputs: every decoder graph reads `cells` (n,) int32, the cell each token's K and V
are written to, and `seqs` (n_groups, 4) int32, per sequence (cell0, row0, n_rows, pos0): rows
row0.. are its tokens at positions pos0.., its position p in cell cell0 + p. A model with rings
also reads `cells_swa` and `seqs_swa`, the same for the rings (cell0 = slot * ring_cells; the
attention kernel takes the position modulo the ring). `graph_inputs` declares them on a graph,
`batch_inputs` computes them for a batch, `step_inputs` binds them once for decode steps.

Element types: type_k and type_v name the cells' types (KV_TYPES: "f16", "f32"). Block types
(q8_0, q4_0) will be added as new rows of KV_TYPES; read_slot / write_slot move one sequence's
cells as bytes (the seam for saving and loading a sequence).
"""
from __future__ import annotations

import numbers

import numpy as np

__all__ = ["KVCache", "KV_TYPES", "SWA_RINGS"]

KV_TYPES = {"f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}   # type name -> cell element
SWA_RINGS = True           # sliding-window layers keep rings of window + n_batch cells (False: full
                           # caches, the same results bit for bit; tests and benchmarks compare)
I32 = np.int32


def int_arg(v, name, lo, hi):
    """v as an int in [lo, hi]: TypeError / ValueError naming `name` otherwise"""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return int(v)


def check_type(t, name="kv_dtype"):
    """t, a KV cell type name (KV_TYPES), or ValueError naming `name`"""
    if not isinstance(t, str) or t not in KV_TYPES:
        raise ValueError(f"{name} must be one of {', '.join(repr(k) for k in KV_TYPES)}, got {t!r}")
    return t


class KVCache:
    """The K and V cells of every layer of a model: n_seq slots of n_ctx cells, rings of
    ring_cells cells per slot on the sliding-window layers (see the module docstring)."""

    def __init__(self, n_layer, n_head_kv, head_dim, n_ctx, n_seq=1, type_k="f16", type_v=None,
                 swa_window=0, swa_layers=None, n_batch=None, rings=None):
        self.n_layer = int_arg(n_layer, "n_layer", 1, 1 << 16)
        self.n_head_kv = int_arg(n_head_kv, "n_head_kv", 1, 1 << 16)
        self.head_dim = int_arg(head_dim, "head_dim", 1, 1 << 16)
        self.n_ctx = int_arg(n_ctx, "n_ctx", 1, 1 << 31)
        self.n_seq = int_arg(n_seq, "n_seq", 1, 1 << 31)
        self.type_k = check_type(type_k, "type_k")
        self.type_v = check_type(type_k if type_v is None else type_v, "type_v")
        self.dtype_k, self.dtype_v = KV_TYPES[self.type_k], KV_TYPES[self.type_v]
        self.window = int_arg(swa_window, "swa_window", 0, 1 << 31)
        swa = (False,) * self.n_layer if swa_layers is None else tuple(bool(s) for s in swa_layers)
        if len(swa) != self.n_layer:
            raise ValueError(f"swa_layers must have one flag per layer ({self.n_layer}), got {len(swa)}")
        n_batch = self.n_ctx if n_batch is None else int_arg(n_batch, "n_batch", 1, self.n_ctx)
        C = self.window + n_batch
        use = SWA_RINGS if rings is None else bool(rings)
        self.ring_cells = C if use and self.window and any(swa) and C < self.n_ctx else 0
        self.ring_layers = swa if self.ring_cells else (False,) * self.n_layer
        n_cells = self.n_seq * self.n_ctx
        row = (self.n_head_kv, self.head_dim)
        if not self.ring_cells:
            self.k = np.zeros((self.n_layer, n_cells) + row, self.dtype_k)
            self.v = np.zeros((self.n_layer, n_cells) + row, self.dtype_v)
        else:
            shape = [((self.n_seq * C) if r else n_cells,) + row for r in self.ring_layers]
            self.k = [np.zeros(sh, self.dtype_k) for sh in shape]
            self.v = [np.zeros(sh, self.dtype_v) for sh in shape]

    @classmethod
    def for_model(cls, hp, n_ctx, n_seq=1, n_batch=None, type_k="f16", type_v=None):
        """the cache of a model with hyperparameters hp (cpufuse.llama.hparams.HParams)"""
        return cls(hp.n_layer, hp.n_head_kv, hp.head_dim, n_ctx, n_seq, type_k, type_v,
                   swa_window=hp.swa_window, swa_layers=hp.swa_layers, n_batch=n_batch)

    def __repr__(self):
        ring = f", rings of {self.ring_cells} cells" if self.ring_cells else ""
        return (f"KVCache({self.n_seq} slots x {self.n_ctx} cells, {self.n_layer} layers of "
                f"{self.n_head_kv}x{self.head_dim}, k {self.type_k}, v {self.type_v}{ring})")

    # --------------------------------------------------------------------------- cell layout
    @property
    def nbytes(self):
        """bytes of the cache (K and V, every layer)"""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def layer(self, li):
        """layer li's (K, V) arrays, (n_cells, n_head_kv, head_dim) each"""
        return self.k[li], self.v[li]

    def slot_cells(self, li):
        """cells per slot of layer li: ring_cells on a ring, else n_ctx"""
        return self.ring_cells if self.ring_layers[li] else self.n_ctx

    def _slot(self, v, name):
        return int_arg(v, name, 0, self.n_seq - 1)

    def check_group(self, slot, n, pos0):
        """ValueError unless n tokens of slot `slot` at positions pos0.. fit one batch: the slot
        exists, the positions fit n_ctx, and with rings at most n_batch + 1 tokens (a group of n
        tokens reads window - 1 + n positions, which its ring must hold)"""
        if not 0 <= slot < self.n_seq or n < 1 or pos0 < 0 or pos0 + n > self.n_ctx:
            raise ValueError(f"batch: slot {slot} with {n} tokens at position {pos0} does not fit "
                             f"{self.n_seq} slots of n_ctx = {self.n_ctx}")
        C = self.ring_cells
        if C and n > C - self.window + 1:
            raise ValueError(f"batch: {n} tokens of one sequence in one call do not fit the sliding-window "
                             f"layers' ring of {C} cells (window {self.window} + n_batch {C - self.window}); "
                             f"at most n_batch + 1 tokens per sequence and call")

    # ----------------------------------------------------------------------- batch inputs
    def graph_inputs(self, g, n, n_groups):
        """Declare the cell inputs of a batch of n tokens and n_groups sequences on graph g
        (cells, seqs, and cells_swa, seqs_swa with rings). Returns layer(li) -> (k, v, cells,
        seqs, ring): layer li's cache arrays, the input nodes its kv_write and attn_seqs read,
        and its ring size (0: no ring)."""
        cells = g.input("cells", (n,), I32)
        seqs = g.input("seqs", (n_groups, 4), I32)
        ring = None
        if self.ring_cells:
            ring = (g.input("cells_swa", (n,), I32), g.input("seqs_swa", (n_groups, 4), I32))

        def layer(li):
            if self.ring_layers[li]:
                return self.k[li], self.v[li], ring[0], ring[1], self.ring_cells
            return self.k[li], self.v[li], cells, seqs, 0
        return layer

    def batch_inputs(self, groups, n, n_groups):
        """The cell inputs (a dict of int32 arrays, keyed as graph_inputs names them) of a batch of
        n rows whose sequences are `groups`: (slot, row0, n_rows, pos0) each, checked by
        check_group; n_groups (>= len(groups)) rows of seqs, the unused ones zero."""
        if len(groups) > n_groups:
            raise ValueError(f"batch: {len(groups)} sequences do not fit {n_groups} groups")
        C, N = self.ring_cells, self.n_ctx
        cells, seqs = np.empty(n, I32), np.zeros((n_groups, 4), I32)
        out = {"cells": cells, "seqs": seqs}
        if C:
            cr, sr = out["cells_swa"], out["seqs_swa"] = np.empty(n, I32), np.zeros((n_groups, 4), I32)
        for i, (slot, r0, nr, p0) in enumerate(groups):
            p = np.arange(p0, p0 + nr, dtype=np.int64)
            cells[r0:r0 + nr] = slot * N + p
            seqs[i] = slot * N, r0, nr, p0
            if C:
                cr[r0:r0 + nr] = slot * C + p % C
                sr[i] = slot * C, r0, nr, p0
        return out

    def step_inputs(self, slot=0):
        """The cell inputs of a one-token decode step of `slot`, as arrays to bind once: returns
        (inputs, set) where set(pos) points them at position pos (trusted: the caller checked it)"""
        s, N, C = self._slot(slot, "slot"), self.n_ctx, self.ring_cells
        cells, seqs = np.array([s * N], I32), np.array([[s * N, 0, 1, 0]], I32)
        inputs = {"cells": cells, "seqs": seqs}
        if not C:
            def set_pos(pos):
                cells[0] = s * N + pos
                seqs[0, 3] = pos
            return inputs, set_pos
        cr, sr = inputs["cells_swa"], inputs["seqs_swa"] = np.array([s * C], I32), np.array([[s * C, 0, 1, 0]], I32)

        def set_ring(pos):
            cells[0] = s * N + pos
            seqs[0, 3] = sr[0, 3] = pos
            cr[0] = s * C + pos % C
        return inputs, set_ring

    # --------------------------------------------------------------------- prefixes and slots
    def reusable(self, keep, n_cached):
        """How many of the first `keep` cached tokens a new sequence may reuse when its slot holds
        n_cached evaluated tokens: all of them, except with rings, where the cells of positions
        keep - window + 1 .. keep - 1 must not have been overwritten by later positions (else 0:
        evaluate from the start)."""
        C, W = self.ring_cells, self.window
        if not C or keep <= 0 or max(0, keep - W + 1) >= n_cached - C:
            return keep
        return 0

    def _ring_positions(self, n, n_cached):
        """the positions of [0, n) a ring holds after n_cached (>= n) positions were written"""
        return np.arange(max(0, n_cached - self.ring_cells), n, dtype=np.int64)

    def copy_prefix(self, src, dst, n, n_cached=None):
        """Copy the K/V of positions [0, n) of slot src into slot dst, which then continues as if
        it had evaluated them. n_cached: the positions slot src holds (default n); with rings
        the positions src wrote after n may have overwritten what dst needs: ValueError when
        reusable(n, n_cached) says so."""
        src, dst = self._slot(src, "src"), self._slot(dst, "dst")
        n = int_arg(n, "n", 0, self.n_ctx)
        n_cached = n if n_cached is None else int_arg(n_cached, "n_cached", n, self.n_ctx)
        if self.reusable(n, n_cached) != n:
            raise ValueError(f"copy_prefix: slot {src}'s rings of {self.ring_cells} cells no longer hold the "
                             f"window before position {n} ({n_cached} positions were written)")
        if src == dst or n == 0:
            return
        a, b, N = src * self.n_ctx, dst * self.n_ctx, self.n_ctx
        if not self.ring_cells:
            self.k[:, b:b + n] = self.k[:, a:a + n]
            self.v[:, b:b + n] = self.v[:, a:a + n]
            return
        C = self.ring_cells
        rc = self._ring_positions(n, n_cached) % C
        for li in range(self.n_layer):
            for arr in (self.k[li], self.v[li]):
                if self.ring_layers[li]:
                    arr[dst * C + rc] = arr[src * C + rc]
                else:
                    arr[dst * N:dst * N + n] = arr[src * N:src * N + n]

    def shift(self, slot, n_keep, n_discard, n_past, rotate):
        """Context shift (llama.cpp's --context-shift) of slot `slot` holding n_past positions: drop
        positions [n_keep, n_keep + n_discard), move the later ones down by n_discard, and re-rotate
        their K by -n_discard positions with rotate(k rows as float32 (n, n_head_kv, head_dim),
        delta) -> float32 (RoPE is additive in the angle). Not with rings (ValueError)."""
        if self.ring_cells:
            raise ValueError("a context shift needs plain cells: this cache has sliding-window rings")
        slot = self._slot(slot, "slot")
        a = slot * self.n_ctx
        src, dst, n = a + n_keep + n_discard, a + n_keep, n_past - n_keep - n_discard
        if n <= 0 or n_discard <= 0:
            return
        for li in range(self.n_layer):
            k = self.k[li][src:src + n].astype(np.float32)
            self.k[li][dst:dst + n] = rotate(k, -n_discard)
            self.v[li][dst:dst + n] = self.v[li][src:src + n].copy()

    def _slot_rows(self, slot, n):
        """per layer, the cell indices of positions [0, n) of slot (rings: those a ring holds after
        exactly n positions), in position order"""
        N, C = self.n_ctx, self.ring_cells
        ring = slot * C + self._ring_positions(n, n) % C if C else None
        return [ring if r else slice(slot * N, slot * N + n) for r in self.ring_layers]

    def slot_nbytes(self, n):
        """bytes of read_slot(slot, n)"""
        n = int_arg(n, "n", 0, self.n_ctx)
        cells = sum(min(n, self.ring_cells) if r else n for r in self.ring_layers)
        return cells * self.n_head_kv * self.head_dim * (self.dtype_k.itemsize + self.dtype_v.itemsize)

    def read_slot(self, slot, n):
        """The cells of positions [0, n) of slot `slot`, which holds exactly n evaluated positions,
        as bytes: layer by layer, K then V, in position order (ring layers: the last ring_cells
        positions). write_slot puts them back into any slot of a cache of the same shape."""
        rows = self._slot_rows(self._slot(slot, "slot"), int_arg(n, "n", 0, self.n_ctx))
        return b"".join(a[r].tobytes() for li, r in enumerate(rows) for a in self.layer(li))

    def write_slot(self, slot, n, data):
        """The inverse of read_slot: slot `slot` then holds positions [0, n) from `data` (bytes-like
        of exactly slot_nbytes(n) bytes)"""
        slot, n = self._slot(slot, "slot"), int_arg(n, "n", 0, self.n_ctx)
        try:
            buf = memoryview(data).cast("B")
        except TypeError:
            raise TypeError(f"data must be bytes-like, got {type(data).__name__}") from None
        if buf.nbytes != self.slot_nbytes(n):
            raise ValueError(f"data must hold {self.slot_nbytes(n)} bytes for {n} positions, got {buf.nbytes}")
        off = 0
        for li, r in enumerate(self._slot_rows(slot, n)):
            cnt = r.stop - r.start if isinstance(r, slice) else len(r)
            for a in self.layer(li):
                sz = cnt * a[0].nbytes
                a[r] = np.frombuffer(buf[off:off + sz], a.dtype).reshape((cnt,) + a.shape[1:])
                off += sz
