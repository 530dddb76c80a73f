"""One declaration per fact: every table that both Python and C read is declared once, and this file
fails when the other side drifts from it.

- the kernel registry (cpufuse/_registry.py) against native/cdef.h, the extension's prototypes;
- the descriptors (QM / QW included), plan opcodes and records (cpufuse/_layouts.py) against
  native/kernels/layouts.h, which tools/gen_layouts.py generates from them (a stale header fails here);
- the plan records (cpufuse/graph/kinds.py): graph.inc reads them by their generated names only;
- the quant block table (cpufuse/quant/types.py) against native/kernels/qtypes.h, generated from it,
  the built C traits (quant.inc through cf_qtype_info, repack.c through cf_p16_bytes) and the Numba
  unpackers and quantizer; no C or Python source writes a type id as a number.
"""
import importlib.util
import os
import re

import numpy as np
import pytest

import cpufuse
from cpufuse import _backend, _dispatch, _layouts, _registry
from cpufuse.graph.kinds import ADD, GATHER_ROWS, RECORDS
from cpufuse.quant import types as qtypes
from cpufuse.quant.types import ACT_QTYPES, CODE_OFFSET, QTYPES, dequantize
from cpufuse.reference import quant as qref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "native")


def _load_generator():
    """tools/gen_layouts.py, the generator of layouts.h (a script outside the package)"""
    spec = importlib.util.spec_from_file_location("gen_layouts", os.path.join(ROOT, "tools", "gen_layouts.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen_layouts = _load_generator()


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


# ------------------------------------------------------------------------------------------------
# the kernel registry

def test_registry_matches_cdef():
    """every per-ISA prototype of native/cdef.h is a registry op, and every op's C symbol is declared"""
    declared = set(re.findall(r"\bCF_FN\((cf_\w+)\)\(", read("native", "cdef.h")))
    registered = {sym for sym, _ in _registry.KERNELS.values() if sym}
    assert declared == registered, (f"in cdef.h only: {sorted(declared - registered)}; "
                                    f"in the registry only: {sorted(registered - declared)}")


@pytest.mark.skipif(_backend.lib is None, reason="native extension not built")
def test_registry_native_tables():
    """the table of every op with a C symbol holds exactly the native ISAs usable here"""
    native = {i for i in _dispatch.AVAILABLE if i != "numba"}
    for op, (sym, _) in _registry.KERNELS.items():
        t = {i for i in _registry.table(op) if i != "numba"}
        assert t == (native if sym else set()), op


def test_registry_numba_entries():
    """every op with a Numba entry names a function that exists; ops without one refuse numba"""
    if "numba" not in _dispatch.AVAILABLE:
        pytest.skip("numba is not installed")
    for op, (_, nbk) in _registry.KERNELS.items():
        if nbk is None:
            with pytest.raises(ValueError, match="no Numba implementation"):
                _registry.kernel(op, "numba")
        else:
            assert callable(_registry.kernel(op, "numba")), op


# ------------------------------------------------------------------------------------------------
# descriptors, opcodes and plan records

def test_layouts_header_is_generated_and_current():
    """native/kernels/layouts.h is exactly what tools/gen_layouts.py generates from cpufuse/_layouts.py
    and graph/kinds.py (else: run `python tools/gen_layouts.py` and commit the header)"""
    for name in gen_layouts.HEADERS:
        assert read("native", "kernels", name) == gen_layouts.generate(name), (
            f"native/kernels/{name} is stale: run `python tools/gen_layouts.py`")


def _enum_names(text, first):
    """the names of the C enum whose first member is `first`, in order"""
    m = re.search(r"enum\s*\{\s*(" + first + r"\b[^}]*)\}", text)
    assert m, f"enum starting with {first} not found"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    return [n.split("=")[0].strip() for n in body.split(",") if n.strip()]


def c_sources():
    """(name, text) of every C source of native/ but the generated headers"""
    for root, _, files in os.walk(NATIVE):
        for f in sorted(files):
            if f.endswith((".h", ".inc", ".c")) and f not in ("layouts.h", qtypes.HEADER):
                yield os.path.relpath(os.path.join(root, f), NATIVE), open(os.path.join(root, f)).read()


def test_descriptor_enums_declared_once():
    """no C file but the generated headers declares a descriptor (QM / QW too), opcode, record or
    quant type enum"""
    tables = (_layouts.SM, _layouts.RN, _layouts.FA, _layouts.RP, _layouts.RPF, _layouts.QM, _layouts.QW)
    firsts = [f"{t.prefix}_{t.fields[0]}" for t in tables]
    firsts += [f"R_{r.name}_{r.fields[0].upper()}" for r in RECORDS] + ["OP_ADD"]
    firsts += ["GT_" + next(iter(QTYPES)), "QA_F32", "QK_" + next(iter(QTYPES)), "QB_" + next(iter(QTYPES))]
    for f, text in c_sources():
        for first in firsts:
            assert not re.search(r"enum\s*\{\s*" + first + r"\b", text), f"{f} declares {first}"
        assert not re.search(r"#define\s+(QM|QW)_LEN\b", text), f"{f} defines a QM / QW length"


def _plan_functions(text):
    """{name: body} of graph.inc's record functions PLAN_FN(name) { ... }"""
    out = {}
    for m in re.finditer(r"^PLAN_FN\((\w+)\)\s*\{", text, re.M):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        out[m.group(1)] = text[m.end():i - 1]
    return out


def _positional_reads(body):
    """the reads of a record's arguments or a descriptor by a bare number (a[6], d[0], PTR(2), ...)"""
    return re.findall(r"\b(?:a|d)\[\s*\d+\s*\]|\b(?:PTR|FPAR|DESC)\(\s*\d+\s*\)", body)


def test_executor_reads_records_by_name():
    """each record (a row of cpufuse/graph/kinds.py) runs as graph.inc's plan_<name>, dispatched by
    the generated CF_PLAN_OPS; the function reads each of its record's arguments through its
    generated name R_<NAME>_<FIELD>, every field and no other record's, and nothing by position, so
    the fields may be declared in any order (test_record_field_order_is_free)"""
    g = read("native", "kernels", "graph.inc")
    fns = _plan_functions(g)
    assert sorted(fns) == sorted(r.name.lower() for r in RECORDS)
    assert "CF_PLAN_OPS(CF_PLAN_CASE)" in g and not re.search(r"\bcase\s+OP_[A-Z]", g), "a hand-written case"
    for r in RECORDS:
        body = fns[r.name.lower()]
        assert not _positional_reads(body), (r.name, _positional_reads(body))
        named = set(re.findall(r"\bR_(\w+?)_(?:" + "|".join(f.upper() for f in r.fields) + r")\b", body))
        assert named == {r.name}, (r.name, named)
        used = {f for f in r.fields if re.search(rf"\bR_{r.name}_{f.upper()}\b", body)}
        assert used == set(r.fields), (r.name, sorted(set(r.fields) - used))
    # the scan finds what it looks for
    assert _positional_reads("x = a[6] + d[ 0 ]; y = PTR(3);") == ["a[6]", "d[ 0 ]", "PTR(3)"]


def test_record_field_order_is_free(monkeypatch):
    """declare every record's fields in reverse: the header changes (new R_* values), graph.inc reads
    the same names, and a plan lowered with the reversed declarations runs to the same results
    through a Python model of the C reads (field lookup by name, as the generated enums do)"""
    import cpufuse.graph.kinds as kinds
    from cpufuse._layouts import Record
    rev = [Record(r.name, r.op, " ".join(reversed(r.fields)), r.doc) for r in RECORDS]
    text = gen_layouts.generate("layouts.h", rev)
    assert text != gen_layouts.generate("layouts.h")
    for r, q in zip(RECORDS, rev):
        for f in r.fields:   # the C names are the same, their values follow the declaration
            assert re.search(rf"\bR_{r.name}_{f.upper()}\b", text)
            assert q.index[f] == r.nargs - 1 - r.index[f]
    # lowering packs by name: with the reversed declaration every record holds the same values
    g = cpufuse.Graph()
    x = g.input("x", (3, 8))
    h = g.mul(g.rms_norm(g.add(x, g.constant(np.ones((3, 8), np.float32))), 1e-5), g.constant(np.ones(8, np.float32)))
    g.output(g.softmax(g.scale(h, 0.5)))
    want = _records_of(g.compile(fusion=False))
    for r in RECORDS:
        monkeypatch.setattr(r, "fields", tuple(reversed(r.fields)))
        monkeypatch.setattr(r, "index", {f: i for i, f in enumerate(r.fields)})
    got = _records_of(g.compile(fusion=False))
    assert got == want and len({k[0] for k in want}) == 5
    assert kinds.ADD.fields[0] == "y"


def _records_of(plan):
    """{(op, field): value} of a plan's first C segment, the desc fields resolved to their descriptors"""
    from cpufuse.graph.kinds import RECORDS as recs
    if not plan.native:
        pytest.skip("no C plan executor")
    by_op = {r.op: r for r in recs}
    (kind, (_, prog, nrec, _)), = [s for s in plan.segments if s[0] == "c"]
    full = np.frombuffer(_backend.ffi.buffer(prog), np.int64)
    flat = full[:nrec].tolist()
    out, pc, k = {}, 0, 0
    while pc < nrec:
        r = by_op[flat[pc]]
        args = flat[pc + 2:pc + 2 + flat[pc + 1]]
        for f in r.fields:
            v = args[r.index[f]]
            out[(k, r.name, f)] = tuple(full[v:v + 8].tolist()) if f == "desc" else v
        pc += 2 + flat[pc + 1]
        k += 1
    return out


def test_pack_by_name():
    rp = _layouts.RP
    d = rp.pack(**{f: i + 100 for i, f in enumerate(rp.fields)})
    assert len(d) == rp.LEN and d[rp.NDIMS] == 100 + rp.fields.index("NDIMS")
    with pytest.raises(ValueError, match="missing fields"):
        rp.pack(T=1)
    qm, qw = _layouts.QM, _layouts.QW
    d = qm.pack(ROWS=1, K=32, XS=32, ACT=1, NW=1, EPI=0, NORM=0, RS=0, RSC=0, tail=[dict(T=8, N=4, WS=34, YS=4, LAY=0)])
    assert len(d) == qm.LEN == qm.W0 + 3 * qw.LEN and d[qm.W0 + qw.WS] == 34 and d[qm.W0 + qw.LEN:] == [0] * 10
    rec = GATHER_ROWS.pack(m=2, src=0, idx=1, dst=2, row=8, n_src=5)
    assert rec == [GATHER_ROWS.op, 6, 2, 0, 1, 2, 8, 5]
    with pytest.raises(ValueError, match="record GATHER_ROWS"):
        GATHER_ROWS.pack(m=2)


@pytest.mark.skipif(_backend.lib is None, reason="native extension not built")
def test_executor_refuses_a_record_of_another_layout():
    """a record whose nargs is not its layout's is refused (rc = its index + 1), never run"""
    isa = next(i for i in _registry.NATIVE)
    fn = _registry.kernel("plan_run", isa)
    ffi = _backend.ffi
    a = np.ones(4, np.float32)
    y = np.zeros(4, np.float32)
    ptrs = ffi.new("void *[]", [ffi.cast("void *", a.ctypes.data), ffi.cast("void *", y.ctypes.data)])
    fp = ffi.new("float[]", [0.0])
    good = ADD.pack(n=4, a=0, b=0, nb=4, y=1)
    for prog, want in ((good, 0), (good + [ADD.op, 4, 4, 0, 0, 4], 2), (good[:-1], 1), ([99, 0], 1)):
        assert fn(ffi.new("int64_t[]", prog), len(prog), ptrs, fp, ffi.NULL, 0, 1) == want, prog
    assert (y == 2).all()


# ------------------------------------------------------------------------------------------------
# quant block facts: cpufuse/quant/types.py is the table

QUANT = [t for t in QTYPES.values() if t.block_size > 1]


def test_qtypes_header_is_generated_and_current():
    """native/kernels/qtypes.h is exactly what cpufuse/quant/types.py generates (else: run
    `python cpufuse/quant/types.py` and commit the header), and it holds every type of the table"""
    text = read("native", "kernels", qtypes.HEADER)
    assert text == qtypes.generate(), f"native/kernels/{qtypes.HEADER} is stale: run `python cpufuse/quant/types.py`"
    for t in QTYPES.values():
        assert re.search(rf"\bGT_{t.name} = {t.type_id}\b", text) and f"QB_{t.name} = {t.type_size}," in text, t.name
    assert all(f"QA_{n} = {t.type_id}" in text for n, t in ACT_QTYPES.items())
    assert re.search(r"#define CF_QUANT_TYPES\(X\) " + r"\s*(?:\\\n\s*)?".join(f"X\\({t.name}\\)" for t in QUANT), text)


# Names that hold a ggml type id: C (a switch subject or a comparison operand) and Python (the
# Numba kernels' type arguments). A type id written as a number next to one of them is a second
# declaration of the table.
_C_TYPE = r"(?:\b(?:t|type|vtype|vt|tid)|->(?:id|vt|kind)|\[QW_T\])"
_PY_TYPE = r"\b(?:t|t[0-9]|ta|tid|type_id|vtype_id|vid)"


def bare_type_ids(text, python=False):
    """the places in a C (or Python) source where a type id is written as a number: a numeric case
    label in a switch over a type, or a type compared with (or looked up `in`) numbers"""
    found = []
    tv = _PY_TYPE if python else _C_TYPE
    cmp = rf"{tv}\s*[!=]=\s*-?\d+\b(?!\.)|(?<![.\w])\d+\s*[!=]=\s*{tv}\b"
    if python:  # (not a loop: for t in [0] + ...)
        cmp += rf"|(?<!for ){tv}\s+(?:not\s+)?in\s+[(\[{{]\s*\d"
    found += [m.group(0) for m in re.finditer(cmp, text)]
    if not python:
        for m in re.finditer(rf"\bswitch\s*\(\s*{tv}\s*\)\s*\{{", text):
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            found += [c.group(0) for c in re.finditer(r"\bcase\s+\d+\s*:", text[m.end():i])]
    return found


def test_bare_type_id_scanner_can_fail():
    """the scanner below finds every form it looks for, and passes the named forms"""
    bad_c = ("switch (t) {\n  case GT_Q4_0: return 1;\n  case 8: { return 2; }\n}\n"
             "if (type == 12) x(); if (14 != t) y(); d[QM_W0 + QW_T] = t; if (w[QW_T] == 2) z();\n"
             "return t->id == 30;")
    assert bare_type_ids(bad_c) == ["type == 12", "14 != t", "[QW_T] == 2", "->id == 30", "case 8:"]
    good_c = ("switch (t) { case GT_Q8_0: case GT_IQ4_NL: return 32; }\nswitch (what) { case 0: return 1; }\n"
              "if (t == GT_Q6_K && n == 8) f(); int tt = 2; if (tile == 3) g();")
    assert bare_type_ids(good_c) == []
    bad_py = "if t == 20:\n    pass\nelif t1 != 3 or ta in (10, 11):\n    pass\nx = vtype_id == 15\n"
    assert bare_type_ids(bad_py, python=True) == ["t == 20", "t1 != 3", "ta in (1", "vtype_id == 15"]
    good_py = "if t == GT_Q4_0 or n == 2 or ts == 3 or t != 0.0:\n    pass\nfor t in [0] + q:\n    pass\n"
    assert bare_type_ids(good_py, python=True) == []


def test_no_bare_type_ids():
    """every C source (the kernels, repack.c, the NEON tests) and every module of the package names
    the ggml types (GT_* / QA_* of qtypes.h, the table in Python): no type id is written as a number"""
    found = {f: b for f, text in c_sources() if (b := bare_type_ids(text))}
    for root, _, files in os.walk(os.path.join(ROOT, "cpufuse")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                if b := bare_type_ids(open(path).read(), python=True):
                    found[os.path.relpath(path, ROOT)] = b
    assert not found, f"type ids written as numbers (use the names of cpufuse/quant/types.py): {found}"


def _qrows():
    """the rows of native/kernels/qrows.h: [(type, hdr, codes, flags, panel, xrows)]"""
    text = read("native", "kernels", "qrows.h")
    body = text[text.index("#define CF_QROWS(X)"):text.index("/* clang-format on */")]
    rows = re.findall(r"X\((\w+),\s*(\w+),\s*(\w+),\s*([\w |]+?),\s*(\w+(?:\([^)]*\))?),\s*(\w+)\)", body)
    assert len(rows) == body.count("X("), "a row the pattern does not read"
    return rows


def test_quant_rows_are_the_table():
    """native/kernels/qrows.h has one row per quantized type of cpufuse/quant/types.py (in its order),
    each naming decoders that exist; and the kernels name no quantized type outside the rows: a type's
    behaviour is its row, not a test of its id (the float types F32/F16/BF16 are not rows)"""
    rows = _qrows()
    assert [r[0] for r in rows] == [t.name for t in QUANT]
    quant = read("native", "kernels", "quant.inc")
    for name, hdr, codes, flags, panel, xrows in rows:
        assert f"CF_FN(hdr_{hdr})(" in quant and f"CF_FN(codes_{codes})(" in quant, name
        assert re.fullmatch(r"(LEG\(\d+, \d+, \d+\)|K45\(\d\)|Q6K|Q2K|Q3K|IQ4NL|IQ4XS|MXFP4)", panel), (name, panel)
        assert xrows in ("NONE", "Q8", "IQ4") and all(f in ("0", "QR_SPLIT", "QR_MIN", "QR_MADD", "QR_MIN16", "QR_U8")
                                                      for f in flags.replace(" ", "").split("|")), name
    names = "|".join(t.name for t in QUANT)
    for f in ("quant.inc", "qpanel.inc", "qamx.inc", "getrows.inc"):
        found = re.findall(rf"\b(?:t|type)\s*[!=]=\s*GT_(?:{names})\b|case\s+GT_(?:{names})\s*:",
                           re.sub(r"/\*.*?\*/", "", read("native", "kernels", f), flags=re.S))
        assert not found, (f, found)


@pytest.mark.skipif(_backend.lib is None, reason="native extension not built")
@pytest.mark.parametrize("isa", _registry.NATIVE)
def test_c_quant_traits_match_table(isa):
    info = _registry.kernel("qtype_info", isa)
    for t in QTYPES.values():
        assert info(t.type_id, 0) == t.block_size, t.name
        assert info(t.type_id, 1) == (ACT_QTYPES[t.vec_dot_type].type_id if t.vec_dot_type else 0), t.name
        assert info(t.type_id, 2) == (16 * t.type_size if t.block_size > 1 else 0), t.name
        assert info(t.type_id, 3) == t.type_size and info(t.type_id, 4) == CODE_OFFSET.get(t.name, 0), t.name
    for n in ("Q8_1", "Q8_K"):   # not weight types here
        assert info(ACT_QTYPES[n].type_id, 0) == 0, n


@pytest.mark.skipif(_backend.lib is None, reason="native extension not built")
def test_repack_traits_match_table():
    """native/src/repack.c: one panel of 16 rows of one block is 16 GGUF blocks; half a block is refused"""
    lib = _backend.lib
    for t in QUANT:
        assert lib.cf_p16_bytes(t.type_id, 16, t.block_size) == 16 * t.type_size, t.name
        assert lib.cf_p16_bytes(t.type_id, 1, 3 * t.block_size) == 16 * 3 * t.type_size, t.name
        assert lib.cf_p16_bytes(t.type_id, 16, t.block_size // 2) == -1, t.name


@pytest.mark.skipif("numba" not in _dispatch.AVAILABLE, reason="numba is not installed")
@pytest.mark.parametrize("qtype", [t.name for t in QUANT])
def test_numba_unpacker_matches_table(qtype):
    """the Numba kernel walks rows of the table's block size and bytes: with f32 activations and
    x = the identity, y is dequant(W)^T exactly (one product per output), as the table decodes it"""
    t = QTYPES[qtype]
    K = 2 * t.block_size
    w = qref.random_blocks(qtype, 3, K, np.random.default_rng(7))
    assert w.row_bytes == 2 * t.type_size
    y = np.zeros((K, 3), np.float32)
    np.testing.assert_array_equal(
        np.asarray(_kernel_numba_qmatmul(np.eye(K, dtype=np.float32), w, y)), dequantize(w.raw, qtype, K).T)


def _kernel_numba_qmatmul(x, w, y):
    import cpufuse
    return cpufuse.matmul(x, w, act="f32", isa="numba", out=y)


@pytest.mark.skipif("numba" not in _dispatch.AVAILABLE, reason="numba is not installed")
@pytest.mark.parametrize("vtype", list(ACT_QTYPES))
def test_numba_quantizer_matches_table(vtype):
    t = ACT_QTYPES[vtype]
    x = np.random.default_rng(1).standard_normal((2, 2 * t.block_size)).astype(np.float32)
    import cpufuse.quant.matmul as qm
    assert qm.quantize_act(x, vtype, isa="numba").shape == (2, 2 * t.type_size)
