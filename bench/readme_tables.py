"""Print the README's benchmark section from the markdown the harness wrote (no hand-copied
numbers): python -m bench.readme_tables LOCAL.md ATTN.md XEON.md SCALING_LOCAL.md SCALING_XEON.md"""
import re
import sys


def tables(path):
    """[(preceding paragraph line, table lines)] in file order"""
    lines = open(path, encoding="utf-8").read().splitlines()
    out, cur, last_text = [], [], ""
    for ln in lines + [""]:
        if ln.startswith("|"):
            cur.append(ln)
        else:
            if cur:
                out.append((last_text, cur))
                cur = []
            if ln.strip():
                last_text = ln.strip()
    return out


def pick(path, starts, first_col=None, drop_cols=()):
    for head, tab in tables(path):
        if head.startswith(starts) and (first_col is None or tab[0].startswith(first_col)):
            if drop_cols:
                hdr = [c.strip() for c in tab[0].strip("|").split("|")]
                keep = [i for i, c in enumerate(hdr) if c not in drop_cols]
                tab = ["| " + " | ".join(r.strip("|").split("|")[i].strip() for i in keep) + " |" for r in tab]
            return "\n".join(tab)
    return f"(table '{starts}' not found in {path})"


def header(path):
    for ln in open(path, encoding="utf-8"):
        if re.match(r"^\d{4}-\d\d-\d\dT", ln):
            return ln.strip()
    return ""


def section_header(path, heading):
    """the run header inside a section (a section re-measured after the rest of the file), if any"""
    inside = False
    for ln in open(path, encoding="utf-8"):
        if ln.startswith("## "):
            inside = ln.strip() == heading
        elif inside and re.match(r"^\d{4}-\d\d-\d\dT", ln):
            return ln.strip()
    return None


def main(local, attn, xeon, sc_local, sc_xeon, peers=None):
    p = print
    p(f"Machine A (this project's machines and CI: 2-core AMD EPYC VM, AVX2): {header(local)}\n")
    p("softmax / rms_norm, median µs per call (1 thread unless ×N):\n")
    p(pick(local, "Median time per call, µs", "| case | numpy"))
    p("\nDerived (same run):\n")
    p(pick(local, "Derived (best cpufuse", "| case | MB moved", drop_cols=("all-core GB/s", "% all-core DRAM copy")))
    p(f"\nflash attention, median µs (q (1,32,N,128), K/V (1,8,T,128), GQA 4; prefill causal): {header(attn)}\n")
    p(pick(attn, "Median time per call, µs", "| case | numpy"))
    p("\n")
    p(pick(attn, "Derived. Decode:", "| case | K+V MB",
           drop_cols=("K+V MB", "GFLOP", "auto / fastest", "torch / best", "ggml / best", "% all-core peak")))
    p("\nllama decoder block as a graph plan, ms per block, and the share of time outside matmul:\n")
    p(pick(local, "Median time per block, ms", "| case | numpy"))
    p("\n")
    p(pick(local, "Share of the block's time outside matmul", "| case | weights MB"))
    p("\nPer-node dispatch overhead of a compiled plan, ns per node:\n")
    p(pick(local, "A chain of tiny nodes", "| case | plan fused"))
    p(f"\nMachine B (lent 16-core Intel Xeon, AVX-512): {header(xeon)}\n")
    p(pick(xeon, "Median time per call, µs", "| case | numpy"))
    p("\n")
    ah = section_header(xeon, "## flash attention")
    if ah:
        p(f"flash attention on machine B, a later run: {ah}\n")
    p(pick(xeon, "Median time per call, µs", "| case | numpy | numba | scalar | avx512 unfused | avx512 | avx2 | avx512 rows"))
    p("\n")
    p(pick(xeon, "Derived. Decode:", "| case | K+V MB",
           drop_cols=("K+V MB", "GFLOP", "auto / fastest", "torch / best", "ggml / best", "% all-core peak")))
    if peers:
        p(f"\nPeers in one run on machine A (`make bench-peers`; an earlier commit, see its header): {header(peers)}\n")
        p(pick(peers, "Median time per call, µs", "| case | numpy"))
        p("\n")
        p(pick(peers, "Median time per call, µs", "| case | numpy | numba | scalar | avx2 unfused | avx2 | avx2 rows"))
    for name, path in (("Machine A, 2 cores", sc_local), ("Machine B, 16 cores", sc_xeon)):
        p(f"\nThread scaling, {name} ({header(path)}), speedup vs 1 thread:\n")
        p(pick(path, "Speedup vs 1 thread", "| op"))
        p("\nThroughput and the machine's copy bandwidth / FMA peak in the same run:\n")
        p(pick(path, "Throughput", "| op"))


if __name__ == "__main__":
    main(*sys.argv[1:7])
