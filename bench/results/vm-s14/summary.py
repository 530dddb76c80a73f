"""Per-round table of a vm-s12/depth_ab.py JSON (engines cpufuse and llama.cpp), session 14: tg and pp
tok/s per CPU second and per wall second, the ratio cpufuse / llama.cpp per round, RSS at depth, the
KV MiB of the cache, the load average after each child.

    python bench/results/vm-s14/summary.py depth-16384-f16.json [more.json]"""
import json
import statistics
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    rows = {}
    for r in d["runs"]:
        tg_c, tg_w = d["tg"] / r["tg"][1], d["tg"] / r["tg"][0]
        pp_c = max(d["pp"] / c for w, c in r["pp"])
        pp_w = max(d["pp"] / w for w, c in r["pp"])
        rows.setdefault((r["type"], r["round"]), {})[r["engine"]] = dict(
            tg_c=tg_c, tg_w=tg_w, pp_c=pp_c, pp_w=pp_w, rss=r["rss_at_depth_kb"] / 1024, peak=r["maxrss_kb"] / 1024,
            kv=r["kv_bytes"], load=r["load_avg"][0], src=r["depth_from"], s=r["seconds"])
    D = d["depth"]
    print(f"\n{path}: depth {D}, pp{d['pp']} (best of {d['reps_pp']}), tg{d['tg']}, core {d['core']}\n")
    print(f"| K/V | round | engine order | tg{d['tg']} cpufuse / llama.cpp tok/CPU s | ratio | tg wall tok/s | ratio wall "
          f"| pp{d['pp']} cpufuse / llama.cpp tok/CPU s | ratio | pp wall tok/s | ratio wall | RSS at depth MiB "
          f"(peak) cpufuse / llama.cpp | load avg (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for (t, rnd), e in sorted(rows.items()):
        if set(e) != {"cpufuse", "llama.cpp"}:
            continue
        c, ll = e["cpufuse"], e["llama.cpp"]
        order = " then ".join(r["engine"] for r in d["runs"] if r["type"] == t and r["round"] == rnd)
        for k in ("tg_c", "tg_w", "pp_c", "pp_w"):
            ratios.setdefault((t, k), []).append(c[k] / ll[k])
        print(f"| {t} | {rnd} | {order} | {c['tg_c']:.2f} / {ll['tg_c']:.2f} | **{c['tg_c'] / ll['tg_c']:.2f}x** | "
              f"{c['tg_w']:.2f} / {ll['tg_w']:.2f} | {c['tg_w'] / ll['tg_w']:.2f}x | "
              f"{c['pp_c']:.1f} / {ll['pp_c']:.1f} | **{c['pp_c'] / ll['pp_c']:.2f}x** | "
              f"{c['pp_w']:.1f} / {ll['pp_w']:.1f} | {c['pp_w'] / ll['pp_w']:.2f}x | "
              f"{c['rss']:.0f} ({c['peak']:.0f}) / {ll['rss']:.0f} ({ll['peak']:.0f}) | "
              f"{c['load']:.1f}, {ll['load']:.1f} |")
    for (t, k), v in sorted(ratios.items()):
        print(f"- {t} {k}: median ratio {statistics.median(v):.2f}x, range {min(v):.2f}-{max(v):.2f}x ({len(v)} rounds)")
    for r in d["runs"]:
        if "fill_cpu_s" in r:
            print(f"- fill 0 -> {D}: {r['engine']} {r['type']} {r['fill_cpu_s']:.0f} CPU s, {r['fill_wall_s']:.0f} s wall "
                  f"({D / r['fill_cpu_s']:.1f} tok/CPU s)")
    kv = {r["type"]: r["kv_bytes"] for r in d["runs"] if r.get("kv_bytes")}
    for t, b in kv.items():
        print(f"- cpufuse KV cache ({t}, n_ctx {D + max(d['pp'], d['tg']) + 16}): {b / 2**20:.1f} MiB")
