"""The benchmark harness's own tests (not part of `pytest tests`; run `python -m pytest bench`): the
case table, the probes, the reporter and chart, the ggml peer where it is built, and a smoke run of
every kernel-table entry point at the smallest settings (CPUFUSE_BENCH_SMOKE=0 skips those)."""
import json
import math
import os

import numpy as np
import pytest

from bench import attn, cases, graphbench, ops, report, run, threads, timing
from cpufuse import reference as ref

SMOKE = os.environ.get("CPUFUSE_BENCH_SMOKE", "1") != "0"


# ------------------------------------------------------------------------------------------------
# the harness itself

def test_harness_numpy_attention_matches_reference():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 5, 16), dtype=np.float32)
    k = rng.standard_normal((1, 2, 7, 16), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal((1, 2, 7, 16), dtype=np.float32).astype(np.float16)
    mask = np.where(np.arange(7)[None, :] > np.arange(5)[:, None] + 2, -np.inf, 0).astype(np.float16)[None, None]
    want = ref.flash_attn(q, k, v, mask, scale=0.25)
    assert ref.nmse(want, attn.np_attention(q, k, v, mask, 0.25)) < 1e-12
    assert ref.nmse(ref.flash_attn(q, k, v, None, scale=0.25), attn.np_attention(q, k, v, None, 0.25)) < 1e-12


def test_harness_flop_count():
    assert attn.visible_pairs(cases.att("x", 4, 4, causal=True)) == 10
    assert attn.visible_pairs(cases.att("y", 1, 9)) == 9


def test_harness_case_table():
    names = [c.name for c in cases.CASES]
    assert len(names) == len(set(names)) and set(c.section for c in cases.CASES) == set(run.SECTIONS)
    for key, sec in run.SECTIONS.items():
        assert sec.key == key and sec.cases is not None
    assert {c.name for c in cases.CASES if c.scaling} >= {"softmax 32×4096 +mask f32", "prefill 512 causal f16"}


def test_harness_dispatch_cases_check():
    for case in (c for c in cases.CASES if c.section == "dispatch"):
        d = graphbench.dispatch_inputs(case)
        want = graphbench.dispatch_reference(case, d)
        for v in run.DispatchSection(False, False).vlist:
            fn, get = graphbench.dispatch_build(case, v, d, 1)
            assert ref.nmse(want, get()) < 1e-10, (case.name, v.name)


def test_harness_threads_modes():
    threads.enter(1)
    if threads.ALL_CORES:
        assert os.sched_getaffinity(0) == {threads.pin_core()}
    threads.enter(threads.ALL)
    if threads.ALL_CORES:
        assert sorted(os.sched_getaffinity(0)) == threads.ALL_CORES
    threads.enter(1)


def test_harness_scaling_thread_counts():
    counts, skipped = run.thread_counts()
    assert counts[0] == 1 and counts[-1] == threads.n_all
    assert all(n > threads.n_all for n in skipped)


def test_harness_fma_probe_and_adjacent_peak():
    import cpufuse
    isa = cpufuse.available_isas()[0]
    fn, flops = threads.fma_probe(isa, seconds=0.001)
    if fn is None:
        pytest.skip(f"no cf_fma_peak for {isa} (native extension not loaded)")
    assert flops > 0 and fn() == flops  # the same work every call
    # % adjacent peak = the kernel's GFLOP/s over the probe's, both from the case's own medians
    case = next(c for c in cases.CASES if c.section == "attention" and c.kind == "prefill")
    res = {"FMA peak probe": {"kind": "baseline", "status": "ok", "median_ns": 1e6, "gflops": 100.0},
           "k": {"kind": "cpufuse", "status": "ok", "median_ns": 2e6, "gbps": 1.0, "gflops": 40.0, "n_threads": 1}}
    env = {"copy_bw": {"dram": {"gbps": 10.0}}, "fma_peak": {"gflops_1": 80.0}}
    d = attn.AttnSection(False, False).derived(case, res, dict(env, work={"bytes": 1}))
    assert d["pct_probe_peak"] == pytest.approx(40.0) and d["pct_fma_peak"] == pytest.approx(50.0)


# ------------------------------------------------------------------------------------------------
# the quantized-matmul section (bench/quant.py) and its ggml peer (bench/peers.py ggml_mul_mat_build)

def test_harness_quant_cases():
    mm = [c for c in cases.CASES if c.section == "quant" and c.kind == "matmul"]
    assert {(c.qtype, c.n_in, c.n_out) for c in mm if c.model == "SmolLM2-135M"} == {
        (t, k, n) for t in ("Q4_1", "Q8_0") for k, n, _ in cases.SMOL_SHAPES}
    assert {(c.qtype, c.n_in, c.n_out) for c in mm if c.model == "Llama-7B"} == {
        (t, k, n) for t in cases.LLAMA_TYPES for k, n, _ in cases.LLAMA_SHAPES}
    assert all({c.rows for c in mm if (c.qtype, c.n_in, c.n_out) == (x.qtype, x.n_in, x.n_out)} == {1, 128} for x in mm)
    # --quick and --no-big leave out the Llama-7B prefill rows only
    assert all(c.quick for c in mm if c.model != "Llama-7B" or c.rows == 1)
    assert not any(c.quick or not c.big for c in mm if c.model == "Llama-7B" and c.rows == 128)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])
def test_harness_quant_weights(qtype):
    from bench import quant
    gguf = pytest.importorskip("gguf")
    T = gguf.GGMLQuantizationType[qtype]
    block, tsize = gguf.GGML_QUANT_SIZES[T]
    raw = quant.make_raw(qtype, 16, 512, np.random.default_rng(0))
    assert raw.dtype == np.uint8 and raw.shape == (16, 512 // block * tsize)
    wf = quant.dequantize(raw, qtype, 512)
    assert wf.shape == (16, 512) and np.all(np.isfinite(wf))
    if qtype not in ("Q4_0", "Q4_1", "Q8_0"):  # random blocks: f16 d (and dmin) in [1e-4, 1e-3]
        b = raw.reshape(-1, tsize)
        d = b[:, -2:] if qtype in ("Q6_K", "Q3_K") else b[:, -4:-2] if qtype == "Q2_K" else b[:, 0:2]
        d = d.copy().view("<f2").astype(np.float32).ravel()
        assert d.min() >= 9.9e-5 and d.max() <= 1.001e-3
        assert 0 < np.abs(wf).max() < 1e-3 * 128 * 32 * 1.01   # Q6_K: d * int8 scale * 6-bit code
    else:  # quantized N(0, 0.02^2)
        assert 0.015 < wf.std() < 0.025


def _ggml_or_skip():
    from bench import peers
    gb, why = peers._load_ggml_backend()
    if gb is None:
        pytest.skip(why)
    return peers, gb


@pytest.mark.parametrize("qtype,n_out,rows", [("Q4_0", 64, 1), ("Q4_0", 64, 5), ("Q8_0", 40, 4), ("Q4_1", 32, 1),
                                               ("Q4_K", 32, 4), ("Q6_K", 16, 1)])
def test_harness_ggml_mul_mat(qtype, n_out, rows):
    """ggml's MUL_MAT (plain and repacked weights, 1 and 2 threads) computes x . dequant(W)^T to the
    activation quantization's error, the same on every thread count"""
    from bench import quant
    peers, gb = _ggml_or_skip()
    n_in = 512
    raw = quant.make_raw(qtype, n_out, n_in, np.random.default_rng(1))
    x = np.random.default_rng(2).standard_normal((rows, n_in), dtype=np.float32)
    want = quant.ref_matmul64(x, quant.dequantize(raw, qtype, n_in))
    outs = {}
    for repack in (False, True):
        for nth in (1, 2):
            res, why = peers.ggml_mul_mat_build(raw, qtype, n_out, n_in, x, nth, repack=repack)
            if res is None:
                assert repack, why
                assert peers.ggml_repack_layout(qtype, n_out) is None
                continue
            fn, get, info = res
            y = get()
            assert y.shape == (rows, n_out)
            assert ref.nmse(want, y) < 1e-3, (qtype, repack, nth, info)
            if repack:
                assert info["path"] == "repack" and info["buffer_type"] == "CPU_REPACK"
            else:
                assert info["path"] == ("sgemm" if rows >= 2 and qtype in ("Q4_0", "Q8_0") and gb.has_llamafile
                                        and gb.has_avx2 else "vec_dot")
            outs[(repack, nth)] = y
    for (repack, nth), y in outs.items():
        assert np.array_equal(y, outs[(repack, 1)])   # x86: independent of the thread count (docs/quant-design.md)
    if gb.has_avx2 and qtype in ("Q4_0", "Q4_K"):
        assert (True, 1) in outs   # llama.cpp's default path on AVX2: repacked


def test_harness_ggml_mul_mat_agrees_with_q8_reference():
    """ggml's vec_dot and cpufuse.reference.quant's float64 of the block arithmetic compute the same thing"""
    from bench import quant
    peers, gb = _ggml_or_skip()
    cf = pytest.importorskip("cpufuse")
    qref = pytest.importorskip("cpufuse.reference.quant")
    if not hasattr(cf, "QTensor"):
        pytest.skip("cpufuse.QTensor not available")
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"):
        raw = quant.make_raw(qtype, 16, 256, np.random.default_rng(3))
        x = np.random.default_rng(4).standard_normal((3, 256), dtype=np.float32)
        want = qref.ref_matmul_q8(x, cf.QTensor(raw, qtype, (16, 256)))
        (fn, get, info), _ = peers.ggml_mul_mat_build(raw, qtype, 16, 256, x, 1)
        assert ref.nmse(want, get()) < 1e-10, qtype


def test_harness_quant_read_probe():
    from bench import quant
    fn = quant.read_probe(1)
    assert fn() == 1.0
    if threads.n_all > 1:
        threads.enter(threads.ALL)
        assert quant.read_probe(threads.n_all)() == 1.0
        threads.enter(1)
    quant.release()


# ------------------------------------------------------------------------------------------------
# the probes, the exp floor column, progress and the chart

def _copy_result(gbps, p10, p90):
    return {"gbps": gbps, "p10_gbps": p10, "p90_gbps": p90}


def test_harness_probe_check():
    ok = {"copy_bw": {"dram": _copy_result(20.0, 18.0, 21.0), "l2": _copy_result(100.0, 95.0, 104.0)},
          "fma_peak": {"gflops_1": 100.0, "gflops_all": 195.0,
                       "runs_1": [{"best": 100.0, "median": 97.0}], "runs_all": [{"best": 195.0, "median": 190.0}]},
          "machine": {"threads": {"n_all": 2}}, "busy_cores_start": 0.02, "busy_cores_end": 0.1}
    assert run.probe_check(ok) == []
    bad = dict(ok, copy_bw={"dram": _copy_result(21.8, 20.0, 23.0), "l2": _copy_result(5.1, 4.0, 60.0)})
    w = run.probe_check(bad)
    assert any("does not exceed the DRAM" in x for x in w)           # L2 must beat DRAM
    assert any(x.startswith("l2 copy probe: median 5.1") for x in w)  # and its spread is shown
    busy = dict(ok, fma_peak=dict(ok["fma_peak"], gflops_all=110.0, runs_1=[{"best": 100.0, "median": 50.0}]),
                busy_cores_start=1.4)
    w = run.probe_check(busy)
    assert any("median run 50.0" in x for x in w) and any("only 1.10×" in x for x in w)
    assert any("kept 1.40 cores busy at the start" in x for x in w)
    b = threads.busy_cores(0.05)
    assert b is None or 0 <= b <= threads.n_all + 0.01


def test_harness_copy_probes_sample_and_report():
    c = timing.CopyBandwidth(64 << 10, chunk=16 << 10, sample_s=2e-6, per_sample_s=1e-4, warm_s=0.0)
    assert len(c.calls) == 4 and c.k >= 1
    c.sample(2)
    r = c.result()
    assert r["samples"] >= 16 and r["counted_bytes"] == 2 * (16 << 10) and r["call_overhead_ns"] >= 0
    assert r["worst_gbps"] <= r["p10_gbps"] <= r["gbps"] <= r["p90_gbps"] <= r["best_gbps"]
    assert np.array_equal(c.dst, c.src)  # every chunk was copied
    c.release()
    p = threads.ParallelCopyBandwidth(1 << 20, 2, per_sample_s=1e-4, chunk=64 << 10)
    p.sample(1)
    r = p.result()
    assert r["samples"] >= 8 and r["gbps"] > 0 and np.array_equal(p.dst, p.src)
    p.release()
    threads.enter(1)


def test_harness_fma_peak_stats():
    import cpufuse
    st = threads.fma_peak_stats(cpufuse.available_isas()[0], 1, seconds=0.005, run_s=0.001)
    if st is None:
        pytest.skip("no cf_fma_peak (native extension not loaded)")
    assert st["runs"] >= 5 and st["best"] >= st["median"] >= st["p10"] > 0


def test_harness_exp_floor_column():
    case = cases.ops("softmax 3×37", "softmax", (3, 37), scale=0.125)
    inp = ops.make_inputs(case)
    isa = ops.best_simd()
    if isa is None:
        pytest.skip("no SIMD ISA here: no exp floor column")
    fn, get = ops.build_exp_floor(case, inp, isa)
    z = ops.exp_floor_input(case, inp)
    assert z.shape == (3, 37) and z.max() == 0 and np.all(np.isfinite(z))
    assert ref.nmse(np.exp(z.astype(np.float64)), get()) < 1e-10
    with pytest.raises(cases.Unavailable) as e:
        ops.build_exp_floor(cases.ops("r", "rms_norm", (1, 8)), inp, isa)
    assert e.value.quiet
    ok = {"status": "ok", "n_threads": 1, "gbps": 1.0}
    res = {isa: dict(ok, kind="cpufuse", median_ns=3000.0), "scalar": dict(ok, kind="cpufuse", median_ns=9000.0),
           ops.EXP_FLOOR: dict(ok, kind="baseline", isa=isa, median_ns=2000.0)}
    env = {"copy_bw": {"dram": {"gbps": 10.0}, "l2": {"gbps": 50.0}}}
    sec = ops.OpsSection(False, False)
    env["work"] = {"bytes": 1}
    d = sec.derived(case, res, env)
    assert d["softmax_over_exp_floor"] == pytest.approx(1.5) and d["exp_floor_us"] == pytest.approx(2.0)
    assert "softmax_over_exp_floor" not in sec.derived(cases.ops("r", "rms_norm", (1, 8)), res, env)
    assert sec.vlist[-1].name == ops.EXP_FLOOR and sec.vlist[-1].isa == isa
    entry = {"case": case.asdict(), "work": {"bytes": 1}, "results": res, "derived": d}
    md = "\n".join(report.section_md(sec, {"cases": [entry], "variants": [run.asdict(v) for v in sec.vlist]}))
    assert "softmax ÷ exp floor" in md and "| 1.50× |" in md and "cf_exp_f32" in md


def test_harness_progress():
    logs = []
    p = run.Progress([(2, ["a"], 0.1), (2, ["b", "c"], 0.1)], logs.append)
    p.start("ops", [cases.ops("a", "softmax", (1, 8))])
    p.done()
    p.start("ops", [cases.ops("b", "softmax", (1, 8)), cases.ops("c", "softmax", (1, 8))])
    assert logs[0].startswith("[1/2] ops: a ·") and "left" in logs[0]
    assert logs[1].startswith("[2/2] ops: b, c ·")


def _fake_report():
    def res(kind, ns, **kw):
        return dict({"kind": kind, "status": "ok", "median_ns": ns, "n_threads": 1}, **kw)
    ops = {"title": "softmax / rms_norm",
           "variants": [{"name": "numpy", "kind": "user", "nth": 1}, {"name": "scalar", "kind": "cpufuse", "nth": 1},
                        {"name": "avx2", "kind": "cpufuse", "nth": 1}, {"name": "avx2 ×4", "kind": "cpufuse", "nth": 0},
                        {"name": "exp floor", "kind": "baseline", "nth": 1}],
           "cases": [{"case": {"name": "softmax 1×32000"},
                      "results": {"numpy": res("user", 3e4), "scalar": res("cpufuse", 1.6e5), "avx2": res("cpufuse", 1.7e4),
                                  "avx2 ×4": res("cpufuse", 5e3), "exp floor": res("baseline", 7e3)}},
                     {"case": {"name": "rms_norm×w 1×576"},
                      "results": {"numpy": res("user", 1.3e4), "scalar": {"kind": "cpufuse", "status": "failed"},
                                  "avx2": res("cpufuse", 2e3), "exp floor": {"kind": "baseline", "status": "skipped"}}}]}
    attn_sec = {"title": "flash attention",
                "variants": [{"name": "avx2", "kind": "cpufuse", "nth": 1},
                             {"name": "avx2 rows", "kind": "cpufuse", "nth": 1, "strategy": "rows"}],
                "cases": [{"case": {"name": "decode T=512 f16"},
                           "results": {"avx2": res("cpufuse", 4e4), "avx2 rows": res("cpufuse", 5e4)}}]}
    return {"quick": True, "machine": {"cpu_model": "test CPU", "git_commit": "abc1234", "date": "2026-01-01"},
            "sections": {"ops": ops, "attention": attn_sec}}


def test_harness_plot_panels():
    from bench import plot
    ps = plot.panels(_fake_report())
    (t1, cases1, names1, times1, floor1), (t2, _, names2, _, _) = ps
    assert names1 == ["numpy", "scalar", "avx2"]              # no all-core column, no baseline
    assert times1["scalar"] == [pytest.approx(1.6e-4), None]    # a failed column leaves a gap
    assert floor1 == [pytest.approx(7e-6), None] and names2 == ["avx2"]  # no forced strategy
    assert plot.eng(88.5e-6) == "88.5µs" and plot.eng(1.21e-3) == "1.21ms"


def test_harness_plot_writes_png(tmp_path, monkeypatch):
    import json
    from bench import plot
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_fake_report()))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
        assert "matplotlib is not available" in plot.write(_fake_report(), str(tmp_path / "x.png"))
        pytest.skip("matplotlib is not installed in this venv (make bench installs it): the skip path was checked")
    out = tmp_path / "r.png"
    assert plot.main([str(path), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert "matplotlib is not available" in plot.write(_fake_report(), str(tmp_path / "x.png"))


# ------------------------------------------------------------------------------------------------
# the headline: per peer, the cases where cpufuse's fastest 1-thread variant is faster

def _res(**t):
    kinds = {"numpy": "user", "numpy unfused": "user", "avx2": "cpufuse", "scalar": "cpufuse", "ggml": "peer",
             "ggml repack": "peer", "avx2 ×2": "cpufuse", "floor": "baseline"}
    return {k: {"kind": kinds[k], "status": "ok", "median_ns": v, "n_threads": 2 if "×2" in k else 1}
            for k, v in t.items()}


def test_headline_counts_ratios_and_names_the_ends():
    rep = {"sections": {"ops": {"cases": [
        {"case": {"name": "a"}, "results": _res(numpy=400, avx2=100, scalar=300, floor=1)},       # 4x
        {"case": {"name": "b"}, "results": _res(numpy=50, **{"numpy unfused": 80}, avx2=100,       # 0.5x
                                                  **{"avx2 ×2": 10})},                             # all-core ignored
    ]}, "quant": {"cases": [
        {"case": {"name": "c"}, "results": _res(numpy=200, avx2=100, ggml=300, **{"ggml repack": 150})},   # 2x, 1.5x
    ]}}}
    lines = report.headline(rep)
    text = "\n".join(lines)
    assert lines[0] == "## Headline"
    gm = math.exp((math.log(4) + math.log(0.5) + math.log(2)) / 3)
    assert f"- **numpy**: cpufuse is faster in 2 of 3 cases, faster by {gm:.1f}× on geometric mean " \
           "(from 0.50× on b to 4.0× on a)." in text
    assert "- **ggml**: cpufuse is faster in 1 of 1 cases, faster by 1.5× on geometric mean (from 1.50× on c to 1.5× on c)." in text
    assert "- torch: not in this run" in text


# ------------------------------------------------------------------------------------------------
# smoke runs: every entry point of the kernel tables at the smallest settings writes its tables

SMOKE_ROWS = ("rms_norm×w 1×576", "decode T=512 f16", "SmolLM2 block n_tok=1", "200 nodes", "SmolLM2 q/o 576→576 Q8_0 ×1",
              "SmolLM2 QKV 576→576+192+192 Q8_0 ×1", "softmax 1×64")


_bench = threads.run_module   # the harness tests above pin this process to one core


@pytest.mark.skipif(not SMOKE, reason="CPUFUSE_BENCH_SMOKE=0")
def test_smoke_every_section_and_the_chart(tmp_path):
    only = [x for r in SMOKE_ROWS for x in ("--only", r)]
    _bench("bench.run", "--quick", "--no-big", "--target", "0.002", "--rounds", "1", *only, "--json",
           str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md"))
    md = (tmp_path / "r.md").read_text()
    rep = json.loads((tmp_path / "r.json").read_text())
    assert set(rep["sections"]) == set(run.SECTIONS)
    for key, sec in run.SECTIONS.items():
        assert f"## {sec.title}" in md and rep["sections"][key]["cases"], key
    assert md.startswith("## Headline") and "Derived" in md and "| rms_norm×w 1×576 |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("no matplotlib here: the chart is skipped by design")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    _bench("bench.plot", str(tmp_path / "r.json"), "-o", str(tmp_path / "again.png"))
    assert (tmp_path / "again.png").stat().st_size > 1000


@pytest.mark.skipif(not SMOKE, reason="CPUFUSE_BENCH_SMOKE=0")
def test_smoke_scaling(tmp_path):
    _bench("bench.run", "--scaling", "--quick", "--max-threads", "2", "--only", "softmax 1×32000", "--target", "0.002",
           "--rounds", "1", "--json", str(tmp_path / "s.json"), "--md", str(tmp_path / "s.md"))
    md = (tmp_path / "s.md").read_text()
    assert "## thread scaling" in md and "| softmax 1×32000 (vocab) |" in md and "×1" in md
    if threads.n_all > 1:
        assert "speedup ×2" in md and "bit-identical" in md and "**NO**" not in md
