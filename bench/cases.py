"""The kernel tables' one case table (a Case is a row, a Variant a column) and the vocabulary every
section shares; the fields and flags: bench/README.md.
"""
from dataclasses import dataclass

import numpy as np

from cpufuse import reference as ref

EPS = 1e-6


class Case:
    def __init__(self, section, name, quick=True, big=False, rounds=None, group=None, mode="kernel", scaling=False,
                 **params):
        self.__dict__.update(section=section, name=name, quick=quick, big=big, rounds=rounds, group=group, mode=mode,
                             scaling=scaling, **params)

    def asdict(self):
        return dict(self.__dict__)

    def __repr__(self):
        return f"Case({self.section!r}, {self.name!r})"


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str               # user | cpufuse | peer | baseline (timed, not checked)
    isa: str = None         # cpufuse ISA (None for user/peer)
    fused: bool = True
    tol: float = 1e-10      # NMSE limit against the float64 reference
    nth: int = 1            # threads: 1, or threads.ALL (every core of the affinity set), or n
    strategy: str = None    # flash_attn strategy (None: auto)
    max_call_s: float = None  # not timed when one call takes longer than this


class Unavailable(Exception):
    """a variant that cannot run here; quiet=True: expected by design (shown blank, not in the notes)"""

    def __init__(self, why, quiet=False):
        super().__init__(why)
        self.quiet = quiet


def check(case, got, want, tol):
    """NMSE of each output (a pair for add_rms_norm) against the float64 reference: (ok, worst)"""
    pairs = list(zip(got, want)) if getattr(case, "op", None) == "add_rms_norm" else [(got, want)]
    worst = 0.0
    for g, w in pairs:
        g = np.asarray(g)
        if g.shape != np.shape(w) or not np.all(np.isfinite(g)):
            return False, float("inf")
        worst = max(worst, ref.nmse(w, g))
    return worst <= tol, worst


class Section:
    """what the runner (bench/run.py) and the reporter (bench/report.py) ask of a section; the
    defaults suit most. vlist: the columns. derived_cols: [(header, derived key, format)] of the
    derived table (format: x ratio, pct, g, us, s)."""
    key = title = intro = ""
    unit = "µs"
    settle_s = 0.0
    derived_cols = []

    def cases(self, a):
        return [c for c in CASES if c.section == self.key and (not a.quick or c.quick) and not (c.big and a.no_big)]

    def tol(self, case, v):
        return v.tol, None

    def work(self, case, inp):
        return {}

    def annotate(self, case, r, work):
        r["median_us"] = r["median_ns"] / 1e3
        if work.get("bytes"):
            r["gbps"] = work["bytes"] / r["median_ns"]
        if work.get("flops"):
            r["gflops"] = work["flops"] / r["median_ns"]

    def derived(self, case, res, env):
        return {}

    def tables(self, entries):
        """[(subtitle or None, entries, intro)] of the time tables (one per row kind where they differ)"""
        return [(None, entries, self.intro)]


def ops(name, op, shape, mask=None, scale=1.0, eps=EPS, dram=False, **kw):
    return Case("ops", name, op=op, shape=shape, mask=mask, scale=scale, eps=eps, dram=dram, **kw)


def att(name, N, T, kv="f16", causal=False, **kw):
    return Case("attention", name, N=N, T=T, kv=kv, causal=causal, op="flash_attn", kind="prefill" if N > 1 else "decode",
                **kw)


def block(name, model, n_tok, n_past, **kw):
    return Case("graph", name, model=model, n_tok=n_tok, n_past=n_past, op="block", **kw)


def chain(name, kind, n_nodes, width):
    return Case("dispatch", name, chain=kind, n_nodes=n_nodes, width=width, op="dispatch")


def qcase(name, kind, model, qtype, n_in, n_out, rows, proj="", n_kv=0, **kw):
    return Case("quant", name, kind=kind, model=model, qtype=qtype, n_in=n_in, n_out=n_out, rows=rows, proj=proj,
                n_kv=n_kv, **kw)


def call(name, op, bound, kind="op", qtype=None, n=64):
    """bound: the ratio to np.add (op rows) or microseconds above isa="scalar" (numba rows)"""
    return Case("calls", name, op=op, bound=bound, kind=kind, qtype=qtype, n=n)


SMOL_SHAPES = [(576, 576, "q/o"), (576, 192, "k/v"), (576, 1536, "gate/up"), (1536, 576, "down")]
LLAMA_SHAPES = [(4096, 4096, "q/k/v/o"), (4096, 11008, "gate/up"), (11008, 4096, "down")]
SMOL_TYPES = ("Q4_1", "Q8_0")
LLAMA_TYPES = ("Q4_0", "Q4_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K")
ROPE_HEADS, ROPE_DIM = 32, 128


def _quant_cases():
    out = [qcase(f"SmolLM2 {p} {k}→{n} {qt} ×{rows}", "matmul", "SmolLM2-135M", qt, k, n, rows, p)
           for qt in SMOL_TYPES for k, n, p in SMOL_SHAPES for rows in (1, 128)]
    for qt in LLAMA_TYPES:
        for k, n, p in LLAMA_SHAPES:
            out.append(qcase(f"Llama-7B {p} {k}→{n} {qt} ×1", "matmul", "Llama-7B", qt, k, n, 1, p))
            out.append(qcase(f"Llama-7B {p} {k}→{n} {qt} ×128", "matmul", "Llama-7B", qt, k, n, 128, p,
                             quick=False, big=True, rounds=3))
    fused = [("SmolLM2 gate/up+SwiGLU 576→1536 Q8_0", "swiglu", "Q8_0", 576, 1536, 0),
             ("Llama-7B gate/up+SwiGLU 4096→11008 Q4_K", "swiglu", "Q4_K", 4096, 11008, 0),
             ("SmolLM2 RMSNorm→quant→matmul 576→576 Q8_0", "norm_matmul", "Q8_0", 576, 576, 0),
             ("Llama-7B RMSNorm→quant→matmul 4096→4096 Q4_K", "norm_matmul", "Q4_K", 4096, 4096, 0),
             ("SmolLM2 matmul+residual 576→1536 Q4_1", "residual", "Q4_1", 576, 1536, 0),
             ("SmolLM2 QKV 576→576+192+192 Q8_0", "qkv", "Q8_0", 576, 576, 192),
             ("Llama-7B QKV 3×4096→4096 Q4_K", "qkv", "Q4_K", 4096, 4096, 4096)]
    for name, kind, qt, k, n, n_kv in fused:
        model = name.split()[0].replace("SmolLM2", "SmolLM2-135M")
        for rows in (1, 128):
            slow = model == "Llama-7B"
            out.append(qcase(f"{name} ×{rows}", kind, model, qt, k, n, rows, n_kv=n_kv, quick=not slow,
                             big=slow and rows > 1, rounds=3 if slow and rows > 1 else None))
    out += [qcase(f"Llama-7B RoPE+f16 cache write {ROPE_HEADS}×{ROPE_DIM} ×{t}", "rope", "Llama-7B", "F16",
                  ROPE_HEADS * ROPE_DIM, 0, t) for t in (1, 512)]
    return out


CASES = [
    # 32 new tokens at the end of a 4096-token context: causal f32 mask, so rows 0..31 see 4065..4096 keys
    ops("softmax 32×4096 +mask f32", "softmax", (32, 4096), mask="f32", scale=0.125, scaling=True),
    # 8 heads x 512 queries over 512 keys, flattened to 4096 rows: f16 mask, row i masks keys j > i % 512
    ops("softmax 4096×512 causal f16", "softmax", (4096, 512), mask="f16-causal", scale=0.125, scaling=True),
    ops("softmax 1×32000 (vocab)", "softmax", (1, 32000), scaling=True),
    ops("softmax 1×151936 (vocab)", "softmax", (1, 151936)),
    ops("rms_norm×w 1×576", "rms_norm", (1, 576)),
    ops("rms_norm×w 1×4096", "rms_norm", (1, 4096), scaling=True),
    ops("rms_norm×w 32×4096", "rms_norm", (32, 4096)),
    ops("rms_norm×w 512×4096", "rms_norm", (512, 4096)),
    ops("rms_norm×w 512×8192", "rms_norm", (512, 8192), dram=True, scaling=True),
    ops("add_rms_norm 32×4096", "add_rms_norm", (32, 4096)),
    # from-Python latency: every call timed on its own (k = 1), output allocated vs passed as out=
    ops("latency rms_norm×w 1×4096, alloc", "rms_norm", (1, 4096), mode="alloc", group="latency"),
    ops("latency rms_norm×w 1×4096, out=", "rms_norm", (1, 4096), mode="out", group="latency"),

    att("decode T=512 f16", 1, 512),
    att("decode T=512 f32", 1, 512, kv="f32"),
    att("decode T=4096 f16", 1, 4096),
    att("decode T=4096 f32", 1, 4096, kv="f32", quick=False),
    att("decode T=16384 f16", 1, 16384, quick=False, rounds=9, scaling=True),
    att("decode T=16384 f32", 1, 16384, kv="f32", quick=False, rounds=9),
    att("prefill 512 causal f16", 512, 512, causal=True, rounds=5, scaling=True),

    block("SmolLM2 block n_tok=1 n_past=256", "SmolLM2-135M", 1, 256),
    block("SmolLM2 block n_tok=128 n_past=0", "SmolLM2-135M", 128, 0, quick=False, scaling=True),
    block("SmolLM2 block n_tok=128 n_past=128", "SmolLM2-135M", 128, 128),
    block("Llama-7B block n_tok=1 n_past=256", "Llama-7B", 1, 256, big=True, quick=False, rounds=9),
    block("Llama-7B block n_tok=128 n_past=128", "Llama-7B", 128, 128, big=True, quick=False, rounds=4),

    chain("200 nodes scale/add on 8 floats", "scale_add", 200, 8),
    chain("100 nodes rms_norm, mul(w) on 1×64 (50 fused kernels)", "rms_norm", 100, 64),

    *_quant_cases(),

    call("softmax 1×64", "softmax", 2.0),
    call("rms_norm×w 1×64", "rms_norm", 2.0),
    call("add_rms_norm 1×64", "add_rms_norm", 2.0),
    call("matmul Q8_0 1×64 → 64", "matmul", 2.0, qtype="Q8_0"),
    call("matmul Q4_0 1×64 → 64", "matmul", 2.0, qtype="Q4_0"),
    call("matmul_multi Q8_0 1×64 → 3×64", "matmul_multi", 2.0, qtype="Q8_0"),
    call("matmul_swiglu Q4_0 1×64 → 64", "matmul_swiglu", 2.0, qtype="Q4_0"),
    call("rope 1 token × 1 head × 64, out=", "rope", 2.0),
    call("rope 1×1×64 → f16 cache", "rope_cache", 2.0),
    call("flash_attn 1 query × 1 KV (f16), D=64", "flash_attn", 3.0),
    call("numba − scalar: rms_norm×w 1×576", "rms_norm", 3.0, kind="numba", n=576),
    call("numba − scalar: softmax 1×576", "softmax", 3.0, kind="numba", n=576),
]
