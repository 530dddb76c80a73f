"""Speculative decoding in the batch engine (per sequence, inside continuous batching): every
request's tokens, greedy and seeded, are those of the engine without a draft, alone and beside
others; drafts are accepted (the counters say so); constrained requests draft nothing."""
import numpy as np
import pytest

from _tiny_gguf import write_tiny_gguf

from cpufuse.llama import LlamaPromptLookupDecoding, Model
from cpufuse.serve.batch import BatchEngine, SerialEngine
from cpufuse.serve.engine import EngineRequest, SamplingParams, TokenEvent


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return {a: write_tiny_gguf(d / f"{a}.gguf", qtype="Q8_0", arch=a) for a in ("llama", "gemma3")}


def _run(engine, reqs, together):
    engine.start()
    try:
        if together:
            hs = [engine.submit(EngineRequest(list(p), n, sp)) for p, n, sp in reqs]
        out = []
        for i, (p, n, sp) in enumerate(reqs):
            h = hs[i] if together else engine.submit(EngineRequest(list(p), n, sp))
            out.append([ev.token for ev in h if isinstance(ev, TokenEvent)])
        return out, engine.stats()
    finally:
        engine.stop()


def _reqs():
    rng = np.random.default_rng(1)
    reqs = []
    for i in range(6):
        base = [int(t) for t in rng.integers(5, 250, int(rng.integers(4, 12)))]
        sp = SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.9, seed=50 + i)
        reqs.append((base * 4, int(rng.integers(20, 40)), sp))     # repeats: the lookup finds drafts
    return reqs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_engine_tokens_unchanged_by_drafts(paths, arch):
    reqs = _reqs()
    load = dict(n_ctx=256, n_seq=3, n_batch=32)
    plain, _ = _run(BatchEngine(Model.load(paths[arch], **load), chunk=16), reqs, together=True)
    for together in (False, True):
        got, st = _run(BatchEngine(Model.load(paths[arch], **load), chunk=16,
                                   draft=LlamaPromptLookupDecoding(num_pred_tokens=6)), reqs, together)
        assert got == plain
        assert st.draft_accepted > 0 and st.draft_tokens >= st.draft_accepted
    got, st = _run(SerialEngine(Model.load(paths[arch], n_ctx=256, n_batch=32), draft=4), reqs, together=True)
    assert got == plain and st.draft_accepted > 0


def test_engine_draft_errors(paths):
    m = Model.load(paths["llama"], n_ctx=64, n_seq=2)
    with pytest.raises(TypeError, match="draft_model must be"):
        BatchEngine(m, draft="lookup")
    with pytest.raises(ValueError, match="num_pred_tokens"):
        BatchEngine(m, draft=0)


def test_serve_cli_flags():
    from cpufuse.llama import cli as llama_cli
    from cpufuse.serve.cli import build_parser
    d = llama_cli.make_draft(build_parser().parse_args(["m.gguf", "--lookup", "5"]))
    assert isinstance(d, LlamaPromptLookupDecoding) and d.num_pred_tokens == 5
    assert llama_cli.make_draft(build_parser().parse_args(["m.gguf"])) is None
    with pytest.raises(llama_cli.CLIError, match="not both"):
        llama_cli.make_draft(build_parser().parse_args(["m.gguf", "--lookup", "5", "--draft", "x.gguf"]))
