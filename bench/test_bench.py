"""The kernel tables' own tests (`python -m pytest bench --ignore=bench/e2e`): the few pieces of real
logic (the numpy oracle, the probes, the ggml peer where it is built, the headline and chart data)
and a smoke run of every entry point at the smallest settings (CPUFUSE_BENCH_SMOKE=0 skips those)."""
import json
import math
import os

import numpy as np
import pytest

from bench import attn, cases, plot, quant, report, run, threads, timing
from cpufuse import reference as ref

SMOKE = pytest.mark.skipif(os.environ.get("CPUFUSE_BENCH_SMOKE", "1") == "0", reason="CPUFUSE_BENCH_SMOKE=0")


def test_numpy_attention_and_flop_count():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 5, 16), dtype=np.float32)
    k, v = (rng.standard_normal((1, 2, 7, 16), dtype=np.float32).astype(np.float16) for _ in range(2))
    mask = np.where(np.arange(7)[None, :] > np.arange(5)[:, None] + 2, -np.inf, 0).astype(np.float16)[None, None]
    for m in (mask, None):
        assert ref.nmse(ref.flash_attn(q, k, v, m, scale=0.25), attn.np_attention(q, k, v, m, 0.25)) < 1e-12
    assert attn.visible_pairs(cases.att("x", 4, 4, causal=True)) == 10 and attn.visible_pairs(cases.att("y", 1, 9)) == 9


def test_case_table():
    names = [c.name for c in cases.CASES]
    assert len(names) == len(set(names)) and set(c.section for c in cases.CASES) == set(run.SECTIONS)
    mm = [c for c in cases.CASES if c.section == "quant" and c.kind == "matmul"]
    assert {(c.qtype, c.model) for c in mm} == {(t, "SmolLM2-135M") for t in cases.SMOL_TYPES} | {
        (t, "Llama-7B") for t in cases.LLAMA_TYPES}
    # --quick and --no-big leave out the Llama-7B prefill rows only
    assert all(c.quick != (c.model == "Llama-7B" and c.rows == 128) for c in mm)
    counts, skipped = run.thread_counts()
    assert counts[0] == 1 and counts[-1] == threads.n_all and all(n > threads.n_all for n in skipped)


def test_thread_modes_and_probes():
    for n in (1, 2):
        c = timing.CopyBandwidth(1 << 20, 64 << 10, n, sample_s=2e-6, per_sample_s=1e-4, warm_s=0.0,
                                 pre=lambda: threads.enter(n if n == 1 else threads.ALL))
        if threads.ALL_CORES:
            assert os.sched_getaffinity(0) == ({threads.pin_core()} if n == 1 else set(threads.ALL_CORES))
        c.sample(2)
        r = c.result()
        assert r["samples"] >= 16 and r["counted_bytes"] == 2 * n * (64 << 10) and np.array_equal(c.dst, c.src)
        assert r["worst_gbps"] <= r["p10_gbps"] <= r["gbps"] <= r["p90_gbps"] <= r["best_gbps"]
        c.release()
    threads.enter(1)
    st = threads.fma_peak_stats(threads.best_isa() or "numba", 1, seconds=0.005, run_s=0.001)
    assert st is None or st["runs"] >= 5 and st["best"] >= st["median"] >= st["p10"] > 0
    assert threads.read_bw_stats(2, nbytes=1 << 20, passes=2)["gbps"] > 0 and quant.read_probe(1)() == 1.0


def test_probe_check():
    cb = lambda g, lo, hi: {"gbps": g, "p10_gbps": lo, "p90_gbps": hi}  # noqa: E731
    ok = {"copy_bw": {"dram": cb(20.0, 18.0, 21.0), "l2": cb(100.0, 95.0, 104.0)},
          "fma_peak": {"gflops_1": 100.0, "gflops_all": 195.0, "runs_1": [{"best": 100.0, "median": 97.0}]},
          "machine": {"threads": {"n_all": 2}}, "busy_cores_start": 0.02}
    assert run.probe_check(ok) == []
    pk = dict(ok["fma_peak"], gflops_all=110.0, runs_1=[{"best": 100.0, "median": 50.0}])
    cbs = {"dram": cb(21.8, 20.0, 23.0), "l2": cb(5.1, 4.0, 60.0)}
    w = run.probe_check(dict(ok, copy_bw=cbs, fma_peak=pk, busy_cores_start=1.4))
    starts = ("the L2 copy probe (5.1", "l2 copy probe: median 5.1", "FMA peak probe (1 thread): median run",
              "all-core FMA peak 110.0", "other work kept 1.40 cores busy at the start")
    assert len(w) == len(starts) and all(x.startswith(st) for x, st in zip(w, starts))


@pytest.mark.parametrize("qtype,n_out,rows", [("Q4_0", 64, 1), ("Q4_0", 64, 5), ("Q8_0", 40, 4), ("Q4_K", 32, 4),
                                               ("Q6_K", 16, 1), ("IQ4_XS", 16, 1), ("Q3_K", 16, 2)])
def test_ggml_mul_mat(qtype, n_out, rows):
    """ggml's MUL_MAT, plain and repacked, on 1 and 2 threads: x . dequant(W)^T to its q8 rounding"""
    from bench import peers
    g, why = peers._load_ggml()
    if g is None:
        pytest.skip(why)
    from cpufuse.reference.quant import ref_matmul_q8
    w = quant.Weight(qtype, n_out, 512)
    x = np.random.default_rng(2).standard_normal((rows, 512), dtype=np.float32)
    want, raw = quant.ref_matmul64(x, w.wf), w.raw
    outs = {}
    for repack, nth in ((False, 1), (False, 2), (True, 1), (True, 2)):
        res, why = peers.ggml_mul_mat_build(raw, qtype, n_out, 512, x, nth, repack=repack)
        if res is None:
            assert repack and peers.ggml_repack_layout(qtype, n_out) is None, why
            continue
        y, info = res[1](), res[2]
        assert y.shape == (rows, n_out) and ref.nmse(want, y) < 1e-3, (repack, nth, info)
        sgemm = rows >= 2 and qtype in ("Q4_0", "Q8_0") and g.has_llamafile and g.has_avx2
        assert info["path"] == ("repack" if repack else "sgemm" if sgemm else "vec_dot")
        assert np.array_equal(y, outs.setdefault(repack, y))   # x86: independent of the thread count
    if rows == 1 or not g.has_llamafile:
        assert ref.nmse(ref_matmul_q8(x, w.qt), outs[False]) < 1e-10
    assert True in outs or not (g.has_avx2 and qtype in ("Q4_0", "Q4_K"))   # llama.cpp's default on AVX2


def test_headline_counts_ratios_and_names_the_ends():
    kinds = {"numpy": "user", "avx2": "cpufuse", "scalar": "cpufuse", "ggml": "peer", "ggml repack": "peer",
             "avx2 ×2": "cpufuse", "floor": "baseline"}
    res = lambda **t: {k: {"kind": kinds[k], "status": "ok", "median_ns": v, "n_threads": 2 if "×2" in k else 1}  # noqa
                       for k, v in t.items()}
    rep = {"sections": {"ops": {"cases": [
        {"case": {"name": "a"}, "results": res(numpy=400, avx2=100, scalar=300, floor=1)},      # 4x
        {"case": {"name": "b"}, "results": res(numpy=50, avx2=100, **{"avx2 ×2": 10})},         # 0.5x, all-core ignored
    ]}, "quant": {"cases": [{"case": {"name": "c"},
                              "results": res(numpy=200, avx2=100, ggml=300, **{"ggml repack": 150})}]}}}
    text = "\n".join(report.headline(rep))
    gm = math.exp((math.log(4) + math.log(0.5) + math.log(2)) / 3)
    assert f"- **numpy**: cpufuse is faster in 2 of 3 cases, faster by {gm:.1f}× on geometric mean " \
           "(from 0.50× on b to 4.0× on a)." in text
    assert "- **ggml**: cpufuse is faster in 1 of 1 cases, faster by 1.5× on geometric mean" in text
    assert "- torch: not in this run" in text


def test_plot_panels():
    r = lambda kind, ns=None: {"kind": kind, "status": "ok" if ns else "failed", "median_ns": ns}  # noqa: E731
    sec = {"title": "t", "variants": [{"name": n, "kind": k, "nth": t} for n, k, t in (
        ("numpy", "user", 1), ("scalar", "cpufuse", 1), ("avx2 ×4", "cpufuse", 0), ("exp floor", "baseline", 1))],
           "cases": [{"case": {"name": "a"}, "results": {"numpy": r("user", 3e4), "scalar": r("cpufuse", 1.6e5),
                                                         "avx2 ×4": r("cpufuse", 5e3), "exp floor": r("baseline", 7e3)}},
                     {"case": {"name": "b"}, "results": {"numpy": r("user", 1e4), "scalar": r("cpufuse")}}]}
    (title, names, series, times, floor), = plot.panels({"sections": {"ops": sec}})
    assert series == ["numpy", "scalar"] and times["scalar"] == [pytest.approx(1.6e-4), None]
    assert floor == [pytest.approx(7e-6), None] and plot.eng(88.5e-6) == "88.5µs" and plot.eng(1.21e-3) == "1.21ms"


# ------------------------------------------------------------------------------------------------
# smoke runs: every entry point of the kernel tables at the smallest settings writes its tables

SMOKE_ROWS = ("rms_norm×w 1×576", "decode T=512 f16", "SmolLM2 block n_tok=1", "200 nodes",
              "SmolLM2 q/o 576→576 Q8_0 ×1", "SmolLM2 QKV 576→576+192+192 Q8_0 ×1", "softmax 1×64")
FAST = ("--target", "0.002", "--rounds", "1")


@SMOKE
def test_smoke_every_section_and_the_chart(tmp_path):
    only = [x for r in SMOKE_ROWS for x in ("--only", r)]
    threads.run_module("bench.run", "--quick", "--no-big", *FAST, *only, "--json", str(tmp_path / "r.json"),
                       "--md", str(tmp_path / "r.md"))
    md, rep = (tmp_path / "r.md").read_text(), json.loads((tmp_path / "r.json").read_text())
    assert set(rep["sections"]) == set(run.SECTIONS) and all(s["cases"] for s in rep["sections"].values())
    assert all(f"## {sec.title}" in md for sec in run.SECTIONS.values())
    assert md.startswith("## Headline") and "Derived" in md and "| rms_norm×w 1×576 |" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    threads.run_module("bench.plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "again.png"))
    assert (tmp_path / "again.png").stat().st_size > 1000


@SMOKE
def test_smoke_scaling(tmp_path):
    threads.run_module("bench.run", "--scaling", "--quick", "--max-threads", "2", "--only", "softmax 1×32000", *FAST,
                       "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md"))
    md = (tmp_path / "s.md").read_text()
    assert "## thread scaling" in md and "| softmax 1×32000 (vocab) |" in md and "×1" in md
    assert threads.n_all == 1 or "speedup ×2" in md and "bit-identical" in md and "**NO**" not in md


@SMOKE
def test_smoke_ab():
    out = threads.run_module("bench.ab", ".", ".", "--rounds", "1", "--", "--section", "calls", "--only", "softmax 1×64",
                             *FAST)
    assert "| softmax 1×64 | call |" in out


def test_throttle_refuses_bad_reps():
    from bench import throttle
    for bad in (0, throttle.MAX_REPS + 1, 2.5):
        with pytest.raises(ValueError, match="reps"):
            throttle.measure(mib=8, reps=bad)
        with pytest.raises(ValueError, match="reps"):
            throttle.kernel_rates(["Q4_0"], ring_mib=8, reps=bad)
    with pytest.raises(SystemExit):
        throttle.main(["--chart-from", "x.json"])


@SMOKE
def test_smoke_throttle(tmp_path):
    from bench import throttle
    r = throttle.measure(mib=8, reps=1)
    d, ghz = throttle.derive(r)
    assert ghz > 0.1 and set(d) == {"4k", "thp"} and {x["mode"] for x in d["thp"]} == {"indep", "dep"}
    assert all(x["dram_ns"] > 0 and x["l2_ns"] > 0 for x in d["4k"] + d["thp"])
    md = throttle.markdown(r)
    assert "| 32 | dep |" in md and "## E8" in md and r["thp"]["pages"] == "thp"


@SMOKE
def test_smoke_throttle_types(tmp_path):
    from bench import throttle
    k = throttle.kernel_rates(["Q4_0", "Q4_K"], ring_mib=24, reps=1)
    assert set(k["types"]) == {"Q4_0", "Q4_K"} and all(r["dram_s"] > 0 and r["ring"] >= 2 for r in k["types"].values())
    md = throttle.kernel_markdown(k)
    assert "| Q4_K |" in md and "B/cycle" in md
    pytest.importorskip("matplotlib")
    assert throttle.kernel_chart([k, k], str(tmp_path / "e6.png")) is None and (tmp_path / "e6.png").stat().st_size > 1000


@SMOKE
def test_smoke_attndec(capsys):
    from bench import attndec
    attndec.main(["--depths", "96", "--types", "f16,q8_0", "--reps", "2", "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res) == {"f16@96", "q8_0@96"}
    assert all(r["cpu_ms"] >= 0 and r["bytes"] > 0 and r["probe_bpns"] > 0 for r in res.values())
    assert res["q8_0@96"]["bytes"] == 2 * 8 * 96 * 64 // 32 * 34


@SMOKE
def test_smoke_attndec_envs(capsys):
    from bench import attndec
    attndec.main(["--envs", "CPUFUSE_FA_CELLS_NTH=0,CPUFUSE_FA_SLICE=0", "--rounds", "1", "--core", "0", "--",
                  "--depths", "96", "--types", "f16", "--reps", "2"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| f16@96")]
    assert [r.split("|")[2].strip() for r in rows] == ["default", "CPUFUSE_FA_CELLS_NTH=0,CPUFUSE_FA_SLICE=0"]
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        attndec.main(["--envs", "CPUFUSE_FA_SLICE", "--", "--depths", "96"])
