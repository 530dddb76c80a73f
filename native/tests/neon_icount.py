#!/usr/bin/env python3
"""Dynamic instruction counts of the NEON panel tiles (native/kernels/qpanel.inc on native/simd/neon_p.h)
under qemu-user: a developer tool for comparing kernel variants without ARM hardware, not a test.

    python3 native/tests/neon_icount.py [plain] [dotprod] [i8mm]   (default: all three)

For each build (plain armv8-a, +dotprod, armv8.6-a+i8mm) it cross-compiles native/src/isa_neon.c with
the neon flags of cpufuse/_isa.py plus the build's -march, links native/tests/neon_icount.c (one
q8-mode matmul call), and runs it under qemu-aarch64 with native/tests/neon_icount_plugin.c, which
counts every executed instruction of the p16 tile functions. Per type it prints the instructions
per panel block (16 weight columns x one GGUF block: 32 K elements, or 256 for the K-quants) of
the one-row tile and of the P16_MR-row tile, and per activation row:
  all   every instruction;  valu  vector ALU instructions (integer dots included);
  dot   the int8 dot instructions (SDOT/USDOT/SMMLA/USMMLA, or SMULL/SMLAL on plain armv8-a);
  mem   loads and stores;   scal  other (address arithmetic, loop control).
Counts are not timings: they ignore latency, issue width and which pipes an instruction uses.
Needs aarch64-linux-gnu-gcc/-objdump/-nm, qemu-aarch64 built with plugin support (API version 1,
QEMU 6.x-8.1) and a host C compiler. K = 2048, N = 32, activation rows 1 and 2 * P16_MR.
"""
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NATIVE = os.path.dirname(HERE)
CROSS = os.environ.get("AARCH64_CC", "aarch64-linux-gnu-gcc")
PREFIX = CROSS[: -len("gcc")] if CROSS.endswith("gcc") else "aarch64-linux-gnu-"
QEMU = os.environ.get("QEMU_AARCH64", "qemu-aarch64")
BASE = ["-O3", "-std=c11", "-fno-math-errno", "-ffp-contract=off", "-static"]
VARIANTS = {"plain": [], "dotprod": ["-march=armv8.2-a+dotprod"], "i8mm": ["-march=armv8.6-a+i8mm"]}
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")   # neon_icount.c knows their headers
K, N = 2048, 32
DOTS = {"sdot", "udot", "usdot", "sudot", "smmla", "ummla", "usmmla", "smull", "smull2", "smlal", "smlal2"}


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def category(ins):
    m = ins.split()[0]
    if m in DOTS:
        return "dot"
    if m.startswith(("ld", "st")):
        return "mem"
    if re.search(r"\b[vqdshb]\d+\b|\bv\d+\.", ins):
        return "valu"
    return "scal"


def build(tmp, var, plugin):
    out = os.path.join(tmp, var)
    os.makedirs(out)
    flags = BASE + VARIANTS[var]
    objs = []
    for src in ("src/isa_neon.c", "src/pool.c", "src/repack.c", "tests/neon_icount.c"):
        o = os.path.join(out, os.path.basename(src) + ".o")
        sh([CROSS] + flags + ["-c", os.path.join(NATIVE, src), "-o", o])
        objs.append(o)
    exe = os.path.join(out, "drv")
    sh([CROSS] + flags + objs + ["-o", exe, "-lm", "-pthread"])
    probe = os.path.join(out, "probe.c")
    with open(probe, "w") as f:
        f.write('#include "%s"\n' % os.path.join(NATIVE, "simd", "neon_p.h"))
    mr = int(re.search(r"#define P16_MR (\d+)", sh([CROSS] + flags + ["-E", "-dM", probe])).group(1))
    syms = {}
    for l in sh([PREFIX + "nm", "-S", "--defined-only", exe]).splitlines():
        p = l.split()
        if len(p) == 4 and re.match(r"p16_(1|mr)_Q\w+__neon$", p[3]):
            syms[p[3][: -len("__neon")]] = (int(p[0], 16), int(p[1], 16))
    lo = min(a for a, _ in syms.values())
    hi = max(a + s for a, s in syms.values())
    ins = {}
    for l in sh([PREFIX + "objdump", "-d", "--no-show-raw-insn", f"--start-address={lo:#x}",
                 f"--stop-address={hi:#x}", exe]).splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+(\S.*)", l)
        if m:
            ins[int(m.group(1), 16)] = m.group(2)
    rows = []
    for name in TYPES:
        for kind, r in (("1", 1), ("mr", 2 * mr)):
            cnt_file = os.path.join(out, f"cnt_{name}_{kind}.txt")
            run = sh([QEMU, "-plugin", f"{plugin},lo={lo:x},hi={hi:x},out={cnt_file}", exe, name, str(r), str(K), str(N)])
            blk = int(re.search(r"\bblk (\d+)", run).group(1))
            a0, size = syms[f"p16_{kind}_{name}"]
            c = collections.Counter()
            for l in open(cnt_file):
                addr, n = (int(v, 16) if i == 0 else int(v) for i, v in enumerate(l.split()))
                if a0 <= addr < a0 + size:
                    cat = category(ins.get(addr, "?"))
                    c["all"] += n
                    c[cat] += n
                    if cat == "dot":
                        c["valu"] += n
            tile_rows = 1 if kind == "1" else mr
            blocks = (r // tile_rows) * (N // 16) * (K // blk)
            rows.append((name, tile_rows, {k: v / blocks for k, v in c.items()}))
    return mr, rows


def main():
    variants = sys.argv[1:] or list(VARIANTS)
    for tool in (CROSS, QEMU, PREFIX + "objdump", PREFIX + "nm", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"neon_icount: {tool} not found")
    with tempfile.TemporaryDirectory(prefix="cf_icount.") as tmp:
        plugin = os.path.join(tmp, "libicount.so")
        sh(["cc", "-O2", "-shared", "-fPIC", os.path.join(HERE, "neon_icount_plugin.c"), "-o", plugin])
        for var in variants:
            mr, rows = build(tmp, var, plugin)
            print(f"\n{var} ({' '.join(VARIANTS[var]) or 'armv8-a'}), P16_MR = {mr}: instructions per panel block")
            print("| type | tile rows | all | valu | dot | mem | scal | all / row | valu / row |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for name, tr, p in rows:
                g = lambda k: p.get(k, 0.0)
                print(f"| {name} | {tr} | {g('all'):.0f} | {g('valu'):.0f} | {g('dot'):.0f} | {g('mem'):.0f} | "
                      f"{g('scal'):.0f} | {g('all') / tr:.1f} | {g('valu') / tr:.1f} |")


if __name__ == "__main__":
    main()
