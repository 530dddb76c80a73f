"""The one declaration of every int64 array that Python fills and a C kernel reads: the kernel
descriptors (SM, RN, FA, RP/RPF, QM/QW), the plan executor's opcodes and record layouts, and the
small enumerations they carry (flash_attn strategies, mask kinds).

native/kernels/layouts.h is GENERATED from this file (and the plan records of cpufuse/graph/kinds.py)
by tools/gen_layouts.py and checked in; tests/test_layouts.py fails when it is stale. After editing a
table here:

    python tools/gen_layouts.py           # rewrites native/kernels/layouts.h

The C names are <PREFIX>_<FIELD> (SM_S, RP_NDIMS, ...), <PREFIX>_LEN the length; a plan record is
[opcode, nargs, args...] with OP_<NAME> its opcode and R_<NAME>_<FIELD> the index of an argument
in args. Python packs them by name (Layout.pack, Record.pack), so no list is written by position.
The plan records are declared with their step kinds in cpufuse/graph/kinds.py.

This module imports nothing of the package: the rest of the package imports it (graph/kinds.py
declares its records with Record), and the generator lives outside it, so no import circle passes here.
"""

__all__ = ["Layout", "Record", "Enum", "SM", "RN", "FA", "FA_STRATEGY", "MASK_KIND", "RP", "RPF", "QM", "QW", "CP",
           "TABLES"]


def _field(v):
    """a field's value: an int (a bool or numpy integer converted); an int subclass is kept as it is
    (cpufuse.graph.ir.Dim, a size-dependent value whose slope the plan records)"""
    return v if isinstance(v, int) and not isinstance(v, bool) else int(v)


class Layout:
    """Named slots of an int64 descriptor, in order: Layout("SM", doc, [("S H R C", "x shape"), ...]).
    SM.S is a slot's index, SM.LEN the length (tail=(sub, n): n sub-layouts follow the fields, from
    the last field's index on, as QM's per-weight QW blocks)."""

    def __init__(self, prefix, doc, groups, tail=None):
        self.prefix, self.doc, self.groups, self.tail = prefix, doc, groups, tail
        self.fields = tuple(f for names, _ in groups for f in names.split())
        self.index = {f: i for i, f in enumerate(self.fields)}
        if len(self.index) != len(self.fields):
            raise ValueError(f"{prefix}: duplicate field names")
        self.LEN = len(self.fields) if tail is None else len(self.fields) - 1 + tail[0].LEN * tail[1]

    def __getattr__(self, name):
        try:
            return self.__dict__["index"][name]
        except KeyError:
            raise AttributeError(f"layout {self.__dict__.get('prefix')} has no field {name!r}") from None

    def pack(self, tail=(), **values):
        """the descriptor as a list, every field given by name (a missing or unknown one raises);
        a layout with a tail takes its fields but the last, and tail: up to n dicts of the
        sub-layout's fields (the unused sub-blocks are zeros)"""
        names = self.fields[:-1] if self.tail else self.fields
        if len(values) != len(names) or set(values) != set(names):
            missing = [f for f in names if f not in values]
            extra = [f for f in values if f not in names]
            raise ValueError(f"{self.prefix}.pack: missing fields {missing}, unknown fields {extra}")
        out = [_field(values[f]) for f in names]
        if self.tail:
            sub, n = self.tail
            if len(tail) > n:
                raise ValueError(f"{self.prefix}.pack: at most {n} {sub.prefix} blocks, got {len(tail)}")
            for t in tail:
                out += sub.pack(**t)
            out += [0] * (sub.LEN * (n - len(tail)))
        elif tail:
            raise ValueError(f"{self.prefix}.pack: this layout has no tail")
        return out

    def c(self):
        out = [f"/* {self.doc} */", "enum {"]
        for names, comment in self.groups:
            out.append("  " + ", ".join(f"{self.prefix}_{n}" for n in names.split()) + f", /* {comment} */")
        if not self.tail:
            out.append(f"  {self.prefix}_LEN")
        out.append("};")
        if self.tail:
            sub, n = self.tail
            last = self.fields[-1]
            out.append(f"#define {self.prefix}_LEN ({self.prefix}_{last} + {n} * {sub.prefix}_LEN)")
        return out


class Enum:
    """Named integer constants: Enum("FA", doc, ROWS=1, ...) -> FA_ROWS = 1 in C, .values in Python."""

    def __init__(self, prefix, doc, **values):
        self.prefix, self.doc, self.values = prefix, doc, dict(values)

    def __getitem__(self, name):
        return self.values[name]

    def c(self):
        body = ", ".join(f"{self.prefix}_{k} = {v}" for k, v in self.values.items())
        return [f"/* {self.doc} */", f"enum {{ {body} }};"]


# ------------------------------------------------------------------------------------------------
# kernel descriptors (strides in elements)

SM = Layout("SM", "softmax (cpufuse.ops.softmax -> cf_softmax_f32, native/kernels/softmax.inc)", [
    ("S H R C", "x shape (S, H, R, C)"),
    ("XS0 XS1 XS2", "x strides for S, H, R"),
    ("YS0 YS1 YS2", "y strides"),
    ("MS MH MS0 MS1 MS2", "mask dims (S, H) and strides (S, H, R)"),
    ("MKIND", "MASK_KIND: 0 none, 1 f32, 2 f16"),
])

RN = Layout("RN", "rms_norm (cpufuse.ops.norms -> cf_rms_norm_f32, native/kernels/rms_norm.inc)", [
    ("N3 N2 N1 N0", "x shape"),
    ("XS3 XS2 XS1", "x strides"),
    ("YS3 YS2 YS1", "y strides"),
    ("HS3 HS2 HS1", "h (x + residual) strides"),
    ("R3 R2 R1 RS3 RS2 RS1", "residual dims and strides (tiled by modulo)"),
    ("W3 W2 W1 WS3 WS2 WS1", "weight"),
    ("B3 B2 B1 BS3 BS2 BS1", "bias"),
])

FA = Layout("FA", "flash_attn (cpufuse.ops.attention -> cf_flash_attn_f32, native/kernels/flash_attn.inc)", [
    ("S HQ N DK HK HV T DV", "q (S, Hq, N, DK), k (S, Hk, T, DK), v (S, Hv, T, DV)"),
    ("QS0 QS1 QS2 KS0 KS1 KS2 VS0 VS1 VS2", "q, k, v strides for S, H, row"),
    ("KF16 VF16", "k, v element: 0 float32, 1 float16, 2 q8_0, 3 q4_0 (uint8 blocks, strides in bytes)"),
    ("MS MH MS0 MS1 MS2 MKIND", "mask dims (S, H), strides (S, H, row), MASK_KIND"),
    ("OS0 OS1 OS2", "out (S, N, Hq, DV) strides for S, N, Hq"),
    ("STRATEGY CHUNK QTILE", "FA_STRATEGY, split-KV chunk, query rows per tile"),
    ("COLD", "1: K/V come from DRAM (a decoder step's cache): prefetched at any size"),
])
FA_STRATEGY = Enum("FA", "flash_attn strategies (FA_STRATEGY)", ROWS=1, TILED=2, SPLIT=3)
MASK_KIND = Enum("MK", "mask element kinds (SM_MKIND, FA_MKIND)", NONE=0, F32=1, F16=2)

RP = Layout("RP", "rope (cpufuse.ops.rope -> cf_rope_f32, native/kernels/rope.inc)", [
    ("T H D", "x shape (tokens, heads, head_dim)"),
    ("NDIMS", "rotated dims (even, <= D); dims >= n_dims are copied"),
    ("MODE", "0 norm: pairs (2k, 2k+1); 1 neox: pairs (k, k + n_dims/2)"),
    ("COMPAT", "0 accurate (f64 angles), 1 ggml's f32 chain"),
    ("YF16", "output element: 0 float32, 1 float16 (RNE)"),
    ("XS0 XS1", "x strides for tokens, heads; last axis unit"),
    ("YS0 YS1", "y strides (elements of y's type) for tokens, heads"),
    ("NCTX_ORIG", "YaRN n_ctx_orig"),
])
RPF = Layout("RPF", "rope's float64 parameters (the double array fp of cf_rope_f32)", [
    ("BASE SCALE EXT ATTN BETA_FAST BETA_SLOW", "freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow"),
])

QW = Layout("QW", "one weight of a quantized matmul, at QM_W0 + i * QW_LEN", [
    ("T", "ggml type id (cpufuse.quant.types)"),
    ("N", "n_out"),
    ("WS", "GGUF row stride (bytes)"),
    ("YS", "y row stride (floats)"),
    ("LAY", "layout: 0 GGUF rows, 1 P16 panels (native/src/repack.c)"),
])
QM = Layout("QM", "quantized matmul (cpufuse.quant.matmul -> cf_qmatmul_f32, native/kernels/quant.inc)", [
    ("ROWS K XS", "activation rows, n_in, x row stride (floats)"),
    ("ACT", "0 f32 activations, 1 q8"),
    ("NW", "number of weights (1..3)"),
    ("EPI", "0 one output per weight, 1 silu(y0) * y1 (matmul_swiglu), 2 y0 = res + y0 (matmul residual=), 3 gelu(y0) * y1 (matmul_geglu), 4 swiglu_oai(y0, y1) (qmatmul_id only), 5 y0 = res + f32(s * y0) (s: RSC; a scaled residual branch, granite), 6 y0 = f32(s * y0) (granite's logit scale)"),
    ("NORM", "1: RMS_NORM (x norm_w) prologue"),
    ("RS", "EPI 2 and 5: the residual's row stride (floats)"),
    ("RSC", "EPI 5 and 6: the product's scale s, the bits of an f32 (as an unsigned 32-bit int)"),
    ("W0", "the first weight's QW_* block (3 blocks)"),
], tail=(QW, 3))


CP = Layout("CP", "the plan's strided 4-D copy (OP_COPY's descriptor, native/kernels/graph.inc)", [
    ("N0 N1 N2 N3", "shape"),
    ("S0 S1 S2 S3", "source strides (elements)"),
    ("D0 D1 D2 D3", "destination strides (elements)"),
])


# the tables of native/kernels/layouts.h, in the header's order
TABLES = (SM, RN, FA, FA_STRATEGY, MASK_KIND, RP, RPF, CP, QW, QM)


# ------------------------------------------------------------------------------------------------
# plan records: [opcode, nargs, args...]. The records are declared with their step kinds, one row
# each, in cpufuse/graph/kinds.py (Kind, a Record); tools/gen_layouts.py writes their opcodes, field
# names and the executor's dispatch into layouts.h.

class Record:
    def __init__(self, name, op, fields, doc):
        self.name, self.op, self.doc = name, op, doc
        self.fields = tuple(fields.split())
        self.index = {f: i for i, f in enumerate(self.fields)}
        self.nargs = len(self.fields)

    def pack(self, **args):
        """[opcode, nargs, args...], every argument given by name"""
        if len(args) != self.nargs or set(args) != set(self.fields):
            raise ValueError(f"record {self.name}: missing {[f for f in self.fields if f not in args]}, "
                             f"unknown {[f for f in args if f not in self.index]}")
        return [self.op, self.nargs] + [_field(args[f]) for f in self.fields]

    def c(self):
        body = ", ".join(f"R_{self.name}_{f.upper()}" for f in self.fields)
        return [f"/* OP_{self.name} [{', '.join(self.fields)}]: {self.doc} */",
                f"enum {{ {body}, R_{self.name}_NARGS }};"]
