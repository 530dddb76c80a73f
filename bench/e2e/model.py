"""End to end: cpufuse.llama against llama.cpp (llama-cpp-python) on the same GGUF, same run:
speed, or with --fidelity the logits and greedy generations (bench/README.md, "bench.e2e.model")."""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

from ..report import save, table
from . import HERE, RESULTS, fmt, footer, header, model_path, peer_status, ratio, run_job, spread_line
from .big import LABEL, N_CTX, TEXT, TG, run, run_args

ENGINES = ("cpufuse", "cpufuse-unfused", "llamacpp-fa-off", "llamacpp-fa-on")
KEYS = ("pp128", "pp512", f"tg{TG}")
MARGIN = 1.0   # a top-1 flip counts as a near-tie when llama.cpp's top-1 margin is below this

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Give me three tips for learning to cook."}],
]


def speed(args):
    path = model_path(args.model)
    run(args, [{"path": path, "bytes": os.path.getsize(path)}], ENGINES, KEYS,
        {"pp128": args.reps_pp128, "pp512": args.reps_pp512, f"tg{TG}": 1}, lambda out, final: write_md(args))


# ================================================================================================
# fidelity

def _margin(lg):
    o = np.argsort(lg)[::-1][:2]
    return float(lg[o[0]] - lg[o[1]])


def agreement(a, b, n):
    """top-1 agreement of two logit arrays and where they disagree"""
    dis = np.nonzero(a.argmax(1) != b.argmax(1))[0]
    return dis, {"agree": int(n - len(dis)), "n": n, "max_abs_logit_diff": float(np.abs(a - b).max()),
                 "mean_abs_logit_diff": float(np.abs(a - b).mean())}


def fidelity(args):
    out = {"model": model_path(args.model), "load_avg_start": os.getloadavg(), "skipped": peer_status(args.peer_python)}
    if out["skipped"]:
        print(f"bench.e2e --fidelity: skipped: {out['skipped']}")
    else:
        compare(out, args)
    out["load_avg_end"] = os.getloadavg()
    save(args.fidelity_json, out)
    write_md(args)
    print(f"bench.e2e --fidelity: wrote {args.fidelity_json} and {args.md}")


def compare(out, args):
    """tokenization, teacher-forced logits (llama.cpp FA off and on), greedy generations and the margin rule"""
    from cpufuse.llama import Model
    from cpufuse.llama.chat import chat_prompt
    path, nthr = out["model"], len(os.sched_getaffinity(0))

    def peer(job):
        res, err = run_job({"model": path, "threads": nthr, "n_ctx": N_CTX, **job}, args.peer_python,
                           [os.path.join(HERE, "peer.py")], False, nthr)
        return res or sys.exit(f"peer {job['job']} failed: {err}")
    m = Model.load(path, n_ctx=N_CTX, n_threads=nthr)
    chat_texts = [chat_prompt(m.tokenizer, p, add_generation_prompt=True) for p in CHAT_PROMPTS]
    ours = [m.tokenize(t, add_bos=False, special=True) for t in [TEXT] + chat_texts]
    out["tokenizer_identical"] = [a == b for a, b in zip(ours, peer({"job": "tokenize", "texts": [TEXT] + chat_texts})
                                                         ["tokens"])]
    ids = m.tokenize(TEXT, add_bos=None)
    out["n_positions"], n = len(ids), len(ids)
    print(f"fidelity: {n} positions, tokenization identical: {out['tokenizer_identical']}", flush=True)
    lc, refs, tf = m.logits(ids), {}, {}
    with tempfile.TemporaryDirectory() as td:
        for fa in (False, True):
            peer({"job": "logits", "tokens": ids, "out": os.path.join(td, "ref.npy"), "flash_attn": fa})
            lr = refs[fa] = np.load(os.path.join(td, "ref.npy"))
            dis, d = agreement(lc, lr, n)
            d["disagreements"] = [{"pos": int(i), "llamacpp_margin": _margin(lr[i])} for i in dis]
            d.update(all_disagreements_margin_lt_1=all(x["llamacpp_margin"] < 1.0 for x in d["disagreements"]),
                     rms_diff_over_rms_logits=float(np.sqrt(((lc - lr) ** 2).mean() / (lr ** 2).mean())),
                     max_abs_logit_diff_pos0=float(np.abs(lc[0] - lr[0]).max()))
            tf["fa_on" if fa else "fa_off"] = d
            print(f"  teacher-forced FA {'on' if fa else 'off'}: top-1 agree {d['agree']}/{n}, "
                  f"max |dlogit| {d['max_abs_logit_diff']:.4f}", flush=True)
    dis, d = agreement(refs[False], refs[True], n)     # the noise floor: llama.cpp FA off vs on
    d["max_disagreement_margin"] = float(max([_margin(refs[False][i]) for i in dis], default=0.0))
    out.update(llamacpp_fa_off_vs_on=d, teacher_forced=tf)
    if args.reference:
        out["reference"] = reference_agreement(path, ids, lc, refs[False])
    out["greedy"] = greedy(m, ours[1:], peer({"job": "greedy", "prompts": ours[1:], "n": 64}))
    ms = [x["llamacpp_margin"] for d in tf.values() for x in d["disagreements"]]
    ms += [x for g in out["greedy"] for x in g["lockstep_flip_margins"] + [g.get("llamacpp_margin_at_divergence", 0)]]
    out["margin_rule"] = all(x < MARGIN for x in ms)
    print(f"  margin rule (every disagreement at a llama.cpp top-1 margin < {MARGIN}): {out['margin_rule']}")


def greedy(m, prompts, ref):
    """cpufuse's argmax generation from the chat prompts against llama.cpp's (ref), up to its end of
    generation or 64 tokens; and cpufuse fed llama.cpp's tokens (lock-step), its argmax at every step"""
    eog, rows = set(ref["eog"]) | set(m.eog_ids), []
    for i, (p, r) in enumerate(zip(prompts, ref["results"])):
        m.reset()
        lg, ours = m.eval(p), []
        while len(ours) < 64 and (not ours or ours[-1] not in eog):
            ours.append(int(np.argmax(lg)))
            lg = m.eval([ours[-1]]) if ours[-1] not in eog else lg
        rt = r["tokens"]
        first = next((j for j in range(min(len(ours), len(rt))) if ours[j] != rt[j]),
                     None if len(ours) == len(rt) else min(len(ours), len(rt)))
        lf = m.logits(list(p) + rt[:-1])[len(p) - 1:].argmax(1)
        flips = [j for j in range(len(rt)) if int(lf[j]) != rt[j]]
        g = {"prompt": CHAT_PROMPTS[i][-1]["content"], "prompt_tokens": len(p), "n_cpufuse": len(ours),
             "n_llamacpp": len(rt), "identical": first is None, "first_divergence": first,
             "cpufuse_text": m.detokenize(ours), "llamacpp_text": m.detokenize(rt), "cpufuse_tokens": ours,
             "llamacpp_tokens": rt, "llamacpp_margins": r["margins"], "lockstep_agree": len(rt) - len(flips),
             "lockstep_flip_margins": [r["margins"][j] for j in flips]}
        if first is not None and first < len(rt):
            g["llamacpp_margin_at_divergence"] = r["margins"][first]
        rows.append(g)
        print(f"  greedy {i}: identical={g['identical']} first divergence={first}", flush=True)
    return rows


def reference_agreement(path, ids, lc, lr):
    """What llama.cpp's f16 GELU table (and cpufuse's q8 activations) cost: the float64 reference forward
    (cpufuse/reference/archs.py) with the tanh GELU and with llama.cpp's f16 table, against cpufuse (defaults,
    and act=f32 with f32 K/V) and llama.cpp (FA off): top-1 agreement, the largest B margin at a flip"""
    from cpufuse.llama import Model
    from cpufuse.reference.archs import ref_logits
    lg = {"cpufuse": lc, "llama.cpp": lr,
          "cpufuse f32": Model.load(path, n_ctx=N_CTX, act="f32", kv_dtype="f32").logits(ids)}
    for g in ("tanh", "f16_table"):
        lg[f"reference {g}"] = ref_logits(path, ids, n_ctx=N_CTX, gelu=g, keep=g == "tanh")
    rows = []
    for a, b in (("cpufuse f32", "reference tanh"), ("cpufuse", "reference tanh"), ("reference f16_table",
                 "reference tanh"), ("reference tanh", "llama.cpp"), ("reference f16_table", "llama.cpp"),
                 ("cpufuse", "llama.cpp")):
        dis, d = agreement(lg[a], lg[b], len(ids))
        rows.append({"a": a, "b": b, **d, "max_margin_b": float(max((_margin(lg[b][i]) for i in dis), default=0.0))})
        print(f"  {a} vs {b}: top-1 agree {d['agree']}/{len(ids)}", flush=True)
    return rows


# ================================================================================================
# report

def write_md(args):
    """the markdown of the speed JSON and the fidelity JSON, those that exist"""
    S, F = (json.load(open(p)) if os.path.exists(p) else None for p in (args.json, args.fidelity_json))
    L = ["# cpufuse.llama vs llama.cpp, end to end (generated by `make bench-e2e`)", ""]
    if S:
        L += speed_md(S)
    if F and F.get("skipped"):
        L += ["## Fidelity against llama.cpp (`python -m bench.e2e --fidelity`)", "", f"Skipped: {F['skipped']}", ""]
    elif F:
        L += fidelity_md(F)
    save(args.md, "\n".join(L))


def speed_md(R):
    from .big import fname
    f, peer = R["files"][0], R.get("peer") or {}
    S, threads = R["summary"][fname(f)], R["threads"]
    eng = [e for e in ENGINES if any(e in S[str(t)] for t in threads)]
    SD = {fd.get("depth", 0): R["summary"][fname(fd)] for fd in R["files"]}   # --depth: a summary per depth
    L = [f"Model: `{os.path.basename(f['path'])}` ({f['bytes'] / 2**20:.0f} MiB).", ""]
    L += header(R, f"{R['peer_kind']} {peer.get('version', '')}")
    if R.get("peer_skipped"):
        L += [f"**llama.cpp columns skipped:** {R['peer_skipped']}", ""]
    L += ["## Speed (tokens/s, median over rounds; higher is better)", "",
          "pp N = prompt of N tokens from an empty cache, one eval call; tg 128 = 128 single-token decodes after a "
          "1-token prompt (next token given, all engines do identical work). 1 thread: every engine under "
          f"`taskset -c 0`, n_threads = 1; {threads[-1]} threads: unpinned, n_threads = n_threads_batch = "
          f"{threads[-1]}. Wall time around the Python eval calls.", ""]
    cell = lambda e, t, k, d=0: SD[d][str(t)].get(e, {}).get(k) or {}   # noqa: E731
    peers = [e for e in eng[1:] if e.startswith("llamacpp") and "cpufuse" in eng]
    unf = ["cpufuse-unfused"] if {"cpufuse", "cpufuse-unfused"} <= set(eng) else []
    rows = [[k.replace("pp", "pp ").replace("tg", "tg ") + (f" @{d}" if d else ""), t]
            + [fmt(cell(e, t, k, d).get("median")) for e in eng]
            + [f"**{ratio(cell('cpufuse', t, k, d).get('median'), cell(e, t, k, d).get('median'))}**" for e in peers]
            + [ratio(cell("cpufuse", t, k, d).get("median"), cell(e, t, k, d).get("median")) for e in unf]
            for d in SD for k in KEYS for t in threads]
    L += table(["test", "threads"] + [LABEL[e] for e in eng] + [f"cpufuse / {LABEL[e]}" for e in peers]
               + ["fused / unfused"] * len(unf), rows) + [""]
    L += spread_line([cell(e, t, k) for e in eng for t in threads for k in KEYS])
    notes = [f"- {LABEL[e]}, llama.cpp's own perf counters (no Python): " + ", ".join(
        f"{k}@{t}: {cell(e, t, k)['internal_median']:.1f}" for t in threads for k in KEYS
        if cell(e, t, k).get("internal_median")) for e in peers]
    notes = [n for n in notes if not n.endswith(": ")]  # llama-bench reports no internal timings
    if notes:
        L += ["llama.cpp's internal timings (`llama_perf_context`, tokens/s), for comparison with the wall-clock "
              "columns:", ""] + notes + [""]
    L += ["## Peak resident memory (MiB, VmHWM of the engine's own process)", ""]
    L += table(["engine", "threads", "RSS after imports", "RSS after load", "peak RSS"],
               [[LABEL[e], t] + [fmt(S[str(t)][e].get(k), 0) for k in ("rss_after_import_mib", "rss_after_load_mib",
                                                                        "maxrss_mib")]
                for e in eng for t in threads if e in S[str(t)]])
    L += ["", "Both engines memory-map the GGUF (the touched pages count in RSS).", "", "## Engines and settings", "",
          "- **cpufuse**: `Model.load(path, n_ctx=1024, n_threads=k)`: the fused plans, q8 activations, f16 K/V, n_batch "
          "512; **cpufuse fusion=False**: `Model.load(..., fusion=False)`, every graph node its own kernel.",
          f"- **llama.cpp**: `{R.get('llama_bench')} -m FILE -p 128,512 -n 128 -t k -fa 0|1 -o json` (its own "
          "timings, no Python)." if R.get("peer_kind") == "llama-bench" else
          f"- **llama.cpp**: llama-cpp-python {peer.get('version', '')} in its own venv and process; `Llama(n_ctx=1024, "
          "n_batch=512, n_ubatch=512, n_threads=k, n_threads_batch=k, flash_attn=…)`, f16 K/V, mmap, repack on. **FA "
          "off** is llama-cpp-python's default, **FA on** what llama-cli's `auto` resolves to on a CPU build.", ""]
    return L + footer(R)


def fidelity_md(F):
    tf, ti, sf = F["teacher_forced"], F["tokenizer_identical"], F["llamacpp_fa_off_vs_on"]
    L = ["## Fidelity against llama.cpp (`python -m bench.e2e --fidelity`)", "",
         f"Tokenization of the text and the 3 chat prompts identical to llama.cpp's: {'yes' if all(ti) else ti}.", "",
         f"**Teacher-forced top-1 agreement** over {F['n_positions']} positions of English prose (cpufuse "
         "`Model.logits`, defaults: q8 activations, f16 K/V; llama.cpp `logits_all=True`):", ""]
    pct = lambda d: f"{d['agree']}/{d['n']} ({100 * d['agree'] / d['n']:.1f} %)"   # noqa: E731
    rows = [[lab, pct(d), ", ".join(f"{x['pos']}: {x['llamacpp_margin']:.3f}" for x in d["disagreements"]) or "none",
             "yes" if d["all_disagreements_margin_lt_1"] else "**no**", f"{d['max_abs_logit_diff']:.4f}",
             f"{d['mean_abs_logit_diff']:.5f}", f"{d['rms_diff_over_rms_logits']:.2e}"]
            for lab, d in (("FA off", tf["fa_off"]), ("FA on", tf["fa_on"]))]
    rows.append(["*llama.cpp FA off vs llama.cpp FA on* (noise floor)", pct(sf), f"{sf['n'] - sf['agree']} (largest "
                 f"FA-off margin {sf['max_disagreement_margin']:.3f})", "–", f"{sf['max_abs_logit_diff']:.4f}",
                 f"{sf['mean_abs_logit_diff']:.5f}", "–"])
    L += table(["llama.cpp", "top-1 agree", "disagreements (pos: llama.cpp margin)", "all at margin < 1.0",
                "max abs Δlogit", "mean abs Δlogit", "RMS Δ / RMS logits"], rows)
    L += ["", f"Position 0 alone (attention over a single key, so no mixing): max abs Δlogit "
          f"{tf['fa_off']['max_abs_logit_diff_pos0']:.4f}. llama.cpp against itself with flash attention toggled (last "
          "row) differs about as much as cpufuse differs from either: a deep model with q8 activation rounding turns "
          "last-bit differences into logit differences of O(0.1-1), and the top-1 flips only at near-ties.", "",
          "**Greedy generation**, 64 tokens (or to end-of-generation), chat template, same prompt ids to both, "
          "argmax each step (llama.cpp FA off):", ""]
    L += table(["prompt", "tokens (cpufuse / llama.cpp)", "identical", "first divergence", "llama.cpp top-1 margin "
                "there", "lock-step top-1 agree (fed llama.cpp's tokens)", "llama.cpp margins at lock-step flips"],
               [[g["prompt"], f"{g['n_cpufuse']} / {g['n_llamacpp']}", "yes" if g["identical"] else "no",
                 "–" if g["first_divergence"] is None else g["first_divergence"],
                 fmt(g.get("llamacpp_margin_at_divergence"), 3), f"{g['lockstep_agree']}/{g['n_llamacpp']}",
                 ", ".join(f"{x:.3f}" for x in g["lockstep_flip_margins"]) or "–"] for g in F["greedy"]]) + [""]
    for g in F["greedy"]:
        L += [f"- *{g['prompt']}*", f"  - cpufuse: {json.dumps(g['cpufuse_text'][:160])}",
              f"  - llama.cpp: {json.dumps(g['llamacpp_text'][:160])}"]
    L += ["", f"Margin rule (every teacher-forced disagreement, greedy divergence and lock-step flip at a llama.cpp "
          f"top-1 margin < {MARGIN}, i.e. agreement up to near-ties): **{'met' if F['margin_rule'] else 'NOT met'}**.", ""]
    if F.get("reference"):
        L += ["**Against the float64 reference forward** (`cpufuse/reference/archs.py`, every step in float64, GELU "
              "by the tanh formula or through llama.cpp's f16 table), teacher-forced top-1:", ""]
        L += table(["A", "B", "top-1 agree", "largest B margin at a flip", "max abs Δlogit"],
                   [[r["a"], r["b"], f"{r['agree']}/{r['n']}", f"{r['max_margin_b']:.3f}",
                     f"{r['max_abs_logit_diff']:.4f}"] for r in F["reference"]]) + [""]
    return L


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fidelity", action="store_true", help="logit and greedy-generation fidelity vs llama.cpp")
    ap.add_argument("--reference", action="store_true", help="with --fidelity: also the float64 reference forward "
                    "with the tanh GELU and llama.cpp's f16 GELU table (gemma: what the table costs)")
    ap.add_argument("--model", help="GGUF or a model name, e.g. gemma3-270m (default: SmolLM2-135M-Instruct Q4_1)")
    run_args(ap, ENGINES, 900)
    ap.add_argument("--reps-pp128", type=int, default=3)
    ap.add_argument("--reps-pp512", type=int, default=2)
    g = ap.add_argument_group("the contended case (bench/e2e/contended.py)")
    g.add_argument("--contended", action="store_true", help="decode at each engine's default thread count, quiet "
                   "and beside one busy-loop process per two cores, alternating; each engine's contended/quiet ratio")
    g.add_argument("--tg", type=int, default=32, help="with --contended: tokens decoded per timed run (default 32)")
    g.add_argument("--tg-reps", type=int, default=1, help="with --contended: timed runs per process (default 1)")
    g.add_argument("--settle", type=float, default=5.0,
                   help="with --contended: seconds the competitors run before a contended phase (default 5)")
    for name, default in (("json", "e2e.json"), ("fidelity-json", "e2e-fidelity.json"), ("md", "e2e.md")):
        ap.add_argument(f"--{name}", default=None, help=f"default bench/results/{default} "
                        f"({default.replace('.', '-contended.')} with --contended)" if name != "fidelity-json" else None)
    ap.set_defaults(ik_llama_src=None, dir=None, pp_warm=None, read_mib=0)
    args = ap.parse_args(argv)
    for name, default in (("json", "e2e.json"), ("fidelity_json", "e2e-fidelity.json"), ("md", "e2e.md")):
        if getattr(args, name) is None:
            setattr(args, name, os.path.join(RESULTS, default.replace(".", "-contended.") if args.contended
                                             and name != "fidelity_json" else default))
    args.reps_pp = args.reps_pp512
    if args.contended:
        from .contended import run as contended
        if args.tg < 1 or args.tg_reps < 1 or args.settle < 0:
            ap.error("--tg and --tg-reps must be >= 1, --settle >= 0")
        return contended(args)
    (fidelity if args.fidelity else speed)(args)
