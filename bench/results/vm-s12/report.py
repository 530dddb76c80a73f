"""Markdown of session 12's runs (issue 42): `python bench/results/vm-s12/report.py` reads the JSON of
bench.e2e.kvfidelity (kvfidelity-cpufuse-*.json), llama.cpp's llama-perplexity --kl-divergence logs
(llamacpp-kld-*.log) and depth_ab.py's JSON (depth-*.json) in this folder and writes fidelity.md and
depth-*.md beside them."""
import glob
import json
import os
import re
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))


def table(head, rows):
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |"
                                                                           for r in rows]


def llama_kld(path):
    """{kl, kl_unc, same_top, same_top_unc, ppl, ppl_base, user_s, wall} of one llama-perplexity --kl-divergence log"""
    text = open(path, encoding="utf-8", errors="replace").read()

    def num(pat):
        m = re.search(pat, text)
        return [float(x) for x in m.groups()] if m else None
    out = {}
    if (v := num(r"Mean\s+KLD:\s+([\d.]+)\s+±\s+([\d.]+)")):
        out["kl"], out["kl_unc"] = v
    if (v := num(r"Same top p:\s+([\d.]+)\s+±\s+([\d.]+)")):
        out["same_top"], out["same_top_unc"] = v[0] / 100, v[1] / 100
    if (v := num(r"Mean PPL\(Q\)\s+:\s+([\d.]+)")):
        out["ppl"] = v[0]
    if (v := num(r"Mean PPL\(base\)\s+:\s+([\d.]+)")):
        out["ppl_base"] = v[0]
    if (v := num(r"User time \(seconds\): ([\d.]+)")):
        out["user_s"] = v[0]
    if (m := re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)):
        parts = [float(x) for x in m.group(1).split(":")]
        out["wall_s"] = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
    return out


def fidelity():
    L = ["# Fidelity of the quantized KV cache on Qwen2.5-Coder-1.5B-Instruct Q4_K_M (issue 42, session 12)", ""]
    rows = []
    llama = {}
    for p in sorted(glob.glob(os.path.join(HERE, "llamacpp-kld-*.log"))):
        t, ctx = re.match(r"llamacpp-kld-(.+)-(\d+)k\.log", os.path.basename(p)).groups()
        llama[(int(ctx) * 1024, t)] = llama_kld(p)
    runs = []
    for p in sorted(glob.glob(os.path.join(HERE, "kvfidelity-cpufuse-*.json"))):
        R = json.load(open(p))
        runs.append((os.path.basename(p), R))
        for r in R["rows"]:
            lk = llama.get((r["ctx"], r["type"]), {})
            lc = (f"{lk['same_top']:.4f} ± {lk['same_top_unc']:.4f}" if "same_top" in lk else
                  ("1" if r["type"] == "f16" and (r["ctx"], "q8_0") in llama else "not run"))
            lkl = (f"{lk['kl']:.5f} ± {lk['kl_unc']:.5f}" if "kl" in lk else
                   ("0" if r["type"] == "f16" and (r["ctx"], "q8_0") in llama else ""))
            rows.append([f"{r['type']}/{r['type']}" if "/" not in r["type"] else r["type"], r["ctx"], R["n_eval"],
                         f"{r['top1_agree']:.4f}", f"{r['kl']:.5f}", lc, lkl, f"{r['top1_acc']:.4f}",
                         f"{r['kv_bytes'] / 2**20:.1f}" if r.get("kv_bytes") else "-",
                         f"{r.get('cpu_s', float('nan')):.0f} / {r['s']:.0f}"])
    for p in sorted(glob.glob(os.path.join(HERE, "fidpass-*.json"))):     # fid_pass.py --compare (16k)
        r = json.load(open(p))
        t = r["other_type"]
        rows.append([f"{t}/{t}", r["ctx"], r["n_eval"], f"{r['top1_agree']:.4f}", f"{r['kl']:.5f}", "not run", "",
                     f"{r['top1_acc_other']:.4f} (f16 {r['top1_acc_base']:.4f})", f"{r['kv_bytes_other'] / 2**20:.1f}",
                     f"{r['cpu_s_other']:.0f} / {r['wall_s_other']:.0f} (f16 {r['cpu_s_base']:.0f} / "
                     f"{r['wall_s_base']:.0f})"])
    L += ["Teacher-forced on the same token ids (the repository's cpufuse/**/*.py joined, as "
          "bench.e2e.kvfidelity's default text; cpufuse's and llama.cpp's tokenizers give the same first 4096 ids, "
          "checked), each engine's q8_0 / q4_0 cache against the SAME engine's f16 cache. cpufuse: "
          "`python -m bench.e2e.kvfidelity --ctx C --n-eval N -t 1`, the last N positions of the C-token context "
          "scored (top-1 agreement, mean KL(P_f16 || P_type) in nats in float64). llama.cpp: llama-perplexity "
          "(built from /work/peers/llamacpp-src/full) `-c 4096 --chunks 1 -t 1 -fa on`, first "
          "`--kl-divergence-base` with an f16 cache, then `--kl-divergence -ctk T -ctv T`: it scores the second half "
          "of the chunk (positions 2048-4094, 2047 positions; cpufuse with N = 2048: 2048-4095), "
          "'Same top p' and 'Mean KLD' with their ± (one standard error).", "",
          "One thread, each pass pinned to one core, nice 10, on the 2-vCPU AMD EPYC (Zen 4) VM shared with "
          "other work (load average 8-10): the last column is one pass's CPU seconds / wall seconds up to that "
          "context (cpufuse; the f16 row includes nothing of the other types).", ""]
    L += table(["K/V", "context", "positions", "cpufuse top-1 agreement", "cpufuse mean KL",
                "llama.cpp same top-1", "llama.cpp mean KL", "cpufuse top-1 accuracy", "KV MiB (cpufuse)",
                "CPU s / wall s (cpufuse pass)"], rows)
    if llama:
        L += ["", "llama.cpp's passes (llama-perplexity, 1 thread):", ""]
        L += table(["K/V", "context", "PPL(Q)", "PPL(f16)", "user CPU s", "wall s"],
                   [[f"{t}/{t}", c, lk.get("ppl", "-"), lk.get("ppl_base", "-"), lk.get("user_s", "-"),
                     f"{lk.get('wall_s', float('nan')):.0f}"] for (c, t), lk in sorted(llama.items())])
    with open(os.path.join(HERE, "fidelity.md"), "w") as f:
        f.write("\n".join(L) + "\n")


def depth(path):
    R = json.load(open(path))
    pp, tg = R["pp"], R["tg"]
    cells = {}
    for r in R["runs"]:
        c = cells.setdefault((r["type"], r["engine"]), {"pp_w": [], "pp_c": [], "tg_w": [], "tg_c": [], "rss": [],
                                                        "peak": [], "fill": None, "version": r["version"]})
        c["pp_w"] += [pp / w for w, _ in r["pp"]]
        c["pp_c"] += [pp / cpu for _, cpu in r["pp"]]
        c["tg_w"].append(tg / r["tg"][0])
        c["tg_c"].append(tg / r["tg"][1])
        c["rss"].append(r["rss_at_depth_kb"] / 1024)
        c["peak"].append(r["maxrss_kb"] / 1024)
        if "fill_cpu_s" in r:
            c["fill"] = (r["fill_cpu_s"], r["fill_wall_s"])
    med = statistics.median
    L = [f"# Qwen2.5-Coder-1.5B-Instruct Q4_K_M at depth {R['depth']}, 1 thread: cpufuse vs llama.cpp "
         "(issue 42, session 12)", "",
         f"`bench/results/vm-s12/depth_ab.py` ({os.path.basename(path)}): each (round, cache type, engine) its own "
         f"process under `taskset -c {R['core']}` and nice 10, engine order rotated per round; "
         f"{max(r['round'] for r in R['runs'])} rounds. pp{pp}: {pp} tokens appended to a cache at depth "
         f"{R['depth']} ({R['reps_pp']} timed evals per process, the cache rewound to the depth between them); "
         f"tg{tg}: {tg} one-token evals after the depth. llama.cpp: llama-cpp-python "
         f"({next((c['version'] for (t, e), c in cells.items() if e != 'cpufuse'), 'not run yet')}), flash attention on, type_k = "
         "type_v = the cache type, n_batch 512. The token ids are cpufuse's tokenization of the repository's "
         "Python sources, the same for both engines. Load average at start "
         f"{R['load_avg_start'][0]:.1f}, at end {R.get('load_avg_end', [float('nan')])[0]:.1f}: the 2 vCPUs "
         "were shared with other work, so wall time counts waiting for the core; tok/s per CPU second "
         "(this process's process_time, one thread) is the engines' own speed. Medians over every timed eval "
         "(pp) and every round (tg).", ""]
    rows = []
    for t in sorted({t for t, _ in cells}, key=lambda t: ["f16", "q8_0", "q4_0"].index(t)):
        a, b = cells.get((t, "cpufuse")), cells.get((t, "llama.cpp"))
        for key, name in (("pp", f"pp{pp}"), ("tg", f"tg{tg}")):
            row = [t, name]
            for c in (a, b):
                row += [f"{med(c[key + '_c']):.2f}" if c else "-", f"{med(c[key + '_w']):.2f}" if c else "-"]
            row += [f"**{med(a[key + '_c']) / med(b[key + '_c']):.2f}x**" if a and b else "-",
                    f"{med(a[key + '_w']) / med(b[key + '_w']):.2f}x" if a and b else "-"]
            rows.append(row)
    L += table(["K/V", "test", "cpufuse tok/CPU s", "cpufuse tok/s wall", "llama.cpp tok/CPU s",
                "llama.cpp tok/s wall", "ratio (CPU)", "ratio (wall)"], rows)
    L += ["", "Memory and the depth fill (the first round's fill of the cache from empty; later rounds load "
          "the saved state):", ""]
    L += table(["K/V", "engine", "RSS at depth MiB", "peak RSS MiB", "cpufuse KV cache MiB (n_ctx = depth + pp + 16)",
                "fill: tok/CPU s", "fill: CPU s / wall s"],
               [[t, e, f"{med(c['rss']):.0f}", f"{med(c['peak']):.0f}",
                 next((f"{r['kv_bytes'] / 2**20:.1f}" for r in R["runs"] if r["type"] == t and r["engine"] == e
                       and r.get("kv_bytes")), "-"),
                 f"{R['depth'] / c['fill'][0]:.1f}" if c["fill"] else "-",
                 f"{c['fill'][0]:.0f} / {c['fill'][1]:.0f}" if c["fill"] else "-"]
                for (t, e), c in sorted(cells.items())])
    L += ["", "Per process (round, type, engine: pp tok/CPU s of each eval; tg tok/CPU s; load average):", ""]
    L += [f"- round {r['round']} {r['type']} {r['engine']}: pp " + ", ".join(f"{pp / cpu:.2f}" for _, cpu in r["pp"])
          + f"; tg {tg / r['tg'][1]:.2f}; load {r['load_avg'][0]:.1f}" for r in R["runs"]]
    with open(path[:-5] + ".md", "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    fidelity()
    for p in sorted(glob.glob(os.path.join(HERE, "depth-*.json"))):
        depth(p)
