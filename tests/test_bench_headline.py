"""bench.run's headline: per peer, the cases where cpufuse's fastest 1-thread variant is faster, the
geometric mean of peer ÷ cpufuse and the two ends, from a synthetic report."""
import math

from bench import run as R


def _res(**t):
    kinds = {"numpy": "user", "numpy unfused": "user", "avx2": "cpufuse", "scalar": "cpufuse", "ggml": "peer",
             "ggml repack": "peer", "avx2 ×2": "cpufuse", "floor": "baseline"}
    return {k: {"kind": kinds[k], "status": "ok", "median_ns": v, "n_threads": 2 if "×2" in k else 1}
            for k, v in t.items()}


def test_headline_counts_ratios_and_names_the_ends():
    report = {"sections": {"ops": {"cases": [
        {"case": {"name": "a"}, "results": _res(numpy=400, avx2=100, scalar=300, floor=1)},       # 4x
        {"case": {"name": "b"}, "results": _res(numpy=50, **{"numpy unfused": 80}, avx2=100,       # 0.5x
                                                  **{"avx2 ×2": 10})},                             # all-core ignored
    ]}, "quant": {"cases": [
        {"case": {"name": "c"}, "results": _res(numpy=200, avx2=100, ggml=300, **{"ggml repack": 150})},   # 2x, 1.5x
    ]}}}
    lines = R.headline(report)
    text = "\n".join(lines)
    assert lines[0] == "## Headline"
    gm = math.exp((math.log(4) + math.log(0.5) + math.log(2)) / 3)
    assert f"- **numpy**: cpufuse is faster in 2 of 3 cases, faster by {gm:.1f}× on geometric mean " \
           "(from 0.50× on b to 4.0× on a)." in text
    assert "- **ggml**: cpufuse is faster in 1 of 1 cases, faster by 1.5× on geometric mean (from 1.50× on c to 1.5× on c)." in text
    assert "- onnxruntime, torch: not in this run" in text
