"""Print the README's benchmark tables from what the harness wrote (no hand-copied numbers):

    python -m bench.readme_tables --summary bench/results/latest.json   # the README's kernel table
    python -m bench.readme_tables LOCAL.md ATTN.md XEON.md SCALING_LOCAL.md SCALING_XEON.md
"""
import json
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


def summary(path):
    """one row per ops-section case: scalar, Numba, unfused SIMD, fused SIMD (best ISA), the best peer
    and, for softmax, the exp floor; 1-thread medians of one run"""
    rep = json.load(open(path, encoding="utf-8"))
    print("| case (1 thread, µs) | scalar | Numba | SIMD unfused | **SIMD fused** | best peer | peer ÷ fused | "
          "exp floor | fused ÷ floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    f = lambda v: "–" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"  # noqa: E731
    for c in rep["cases"]:
        if c.get("section", "ops") != "ops" or c["case"].get("mode", "kernel") != "kernel" or "derived" not in c:
            continue
        r, d = c["results"], c["derived"]
        t = lambda k: r[k]["median_us"] if k in r and r[k].get("status") == "ok" else None  # noqa: E731
        isa = d.get("best_simd")
        peers = [(t(k), k) for k, v in r.items() if v.get("kind") == "peer" and t(k)]
        best = min(peers) if peers else (None, "")
        fused = t(isa)
        floor = d.get("exp_floor_us")
        unf = [(t(k), k.split()[0]) for k in r if k.endswith(" unfused") and t(k)]
        unf = unf[0] if unf else (None, "")
        print(f"| {c['case']['name']} | {f(t('scalar'))} | {f(t('numba'))} | {f(unf[0])} ({unf[1]}) | "
              f"**{f(fused)}** ({isa}) | {f(best[0])} {best[1]} | "
              f"{'–' if best[0] is None else f'{best[0] / fused:.2f}×'} | {f(floor)} | "
              f"{'–' if floor is None else f'{fused / floor:.2f}×'} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summary"]:
        summary(sys.argv[2])
    else:
        main(*sys.argv[1:7])
