"""cpufuse.serve below HTTP: the engine contract (SerialEngine against Model.generate and an
independent log-softmax), cancellation, shutdown, the asyncio bridge; the text layer (stop strings
across token boundaries, logprob release); the Sampler's OpenAI penalties."""
import asyncio
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("starlette", reason="the serve extra (pip install cpufuse[serve]) is not installed")

from _tiny_gguf import write_tiny_gguf  # noqa: E402
from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.sampling import Sampler  # noqa: E402
from cpufuse.serve.batch import SerialEngine  # noqa: E402
from cpufuse.serve.engine import (EngineRequest, EngineStopped, FinishEvent, SamplingParams,  # noqa: E402
                                  TokenEvent, make_sampler)
from cpufuse.serve.text import StopMatcher, TextAssembler  # noqa: E402

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, min_p=0.02, seed=11,
                        presence_penalty=0.6, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    p = write_tiny_gguf(tmp_path_factory.mktemp("serve_engine") / "tiny.gguf", tied=False, n_ctx_train=2048)
    return Model.load(p, n_ctx=2048)


@pytest.fixture
def engine(model):
    e = SerialEngine(model)
    e.start()
    yield e
    e.stop()


def run_all(engine, req):
    evs = list(engine.submit(req))
    toks = [e for e in evs if isinstance(e, TokenEvent)]
    assert isinstance(evs[-1], FinishEvent) and all(isinstance(e, TokenEvent) for e in evs[:-1])
    return toks, evs[-1]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_serial_engine_equals_model_generate(model, params):
    ids = model.tokenize("hello world, the", special=True)
    e = SerialEngine(model)
    e.start()
    try:
        toks, fin = run_all(e, EngineRequest(ids, 40, params, stop_ids=frozenset()))
        toks2, _ = run_all(e, EngineRequest(ids, 40, params, stop_ids=frozenset()))
    finally:
        e.stop()
    got = [t.token for t in toks]
    assert [t.token for t in toks2] == got                 # the same request, the same tokens
    ref = model.generate(ids, max_tokens=40, sampler=make_sampler(params), reuse_cache=False, stop_at_eog=False)
    assert got == ref.tokens
    assert (fin.finish_reason, fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens) == \
        ("length", len(ids), 40, 0)


def test_stop_ids_end_the_sequence_unreported(model, engine):
    ids = model.tokenize("hello", special=True)
    toks, _ = run_all(engine, EngineRequest(ids, 12, GREEDY))
    stop = toks[5].token                                    # the 6th greedy token as a stop id
    first = next(i for i, t in enumerate(toks) if t.token == stop)
    toks2, fin = run_all(engine, EngineRequest(ids, 12, GREEDY, stop_ids=frozenset([stop])))
    assert [t.token for t in toks2] == [t.token for t in toks[:first]]
    assert (fin.finish_reason, fin.completion_tokens) == ("stop", first)


def test_logprobs_against_float64_log_softmax(model, engine):
    ids = model.tokenize("the world", special=True)
    toks, _ = run_all(engine, EngineRequest(ids, 6, SEEDED, logprobs=3, stop_ids=frozenset()))
    engine.stop()                                           # the model is ours again
    model.reset()                                           # the same logits, step by step
    rows = [model.eval(ids).astype(np.float64)]
    rows += [model.eval([t.token]).astype(np.float64) for t in toks[:-1]]
    lg = np.array(rows)
    ls = lg - lg.max(1, keepdims=True)
    ls = ls - np.log(np.exp(ls).sum(1, keepdims=True))
    for row, t in zip(ls, toks):
        assert t.logprob == pytest.approx(row[t.token], abs=1e-9)
        order = np.argsort(-row, kind="stable")[:3]
        assert [i for i, _ in t.top_logprobs] == order.tolist()
        assert [v for _, v in t.top_logprobs] == pytest.approx(row[order].tolist(), abs=1e-9)


def test_cancel_running_and_queued(model, engine):
    ids = model.tokenize("hello", special=True)
    long = engine.submit(EngineRequest(ids, 2000, GREEDY, stop_ids=frozenset()))
    queued = engine.submit(EngineRequest(ids, 5, GREEDY))
    queued.cancel()                                        # dropped from the queue at once
    assert list(queued) == [FinishEvent("cancelled", len(ids), 0)]
    it = iter(long)
    for _ in range(3):
        assert isinstance(next(it), TokenEvent)
    long.cancel()
    rest = list(it)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].completion_tokens < 2000
    assert len(rest) - 1 == rest[-1].completion_tokens - 3  # every generated token was delivered
    s = engine.stats()
    assert (s.active, s.queue_depth, s.requests_finished["cancelled"]) == (0, 0, 2)
    long.cancel()                                          # idempotent after the end


def test_submit_checks_and_stop(model):
    e = SerialEngine(model)
    with pytest.raises(EngineStopped):
        e.submit(EngineRequest([1, 2], 4))                 # not started
    e.start()
    for bad, msg in [([], "empty"), ([1, model.n_vocab], "outside"), ([1, -1], "outside"),
                     ([1] * 2000, "exceeds the context")]:
        with pytest.raises(ValueError, match=msg):
            e.submit(EngineRequest(bad, 100))
    with pytest.raises(ValueError, match="max_tokens"):
        e.submit(EngineRequest([1], 0))
    running = e.submit(EngineRequest([1, 2], 2000, GREEDY, stop_ids=frozenset()))
    waiting = e.submit(EngineRequest([1, 2], 2000, GREEDY, stop_ids=frozenset()))
    next(iter(running))
    e.stop()                                               # cancels the queue and the running one
    assert list(waiting)[-1].finish_reason == "cancelled"
    assert list(running)[-1].finish_reason == "cancelled"
    with pytest.raises(EngineStopped):
        e.submit(EngineRequest([1, 2], 4))


def test_asyncio_delivery(model, engine):
    ids = model.tokenize("hello world", special=True)
    ref, _ = run_all(engine, EngineRequest(ids, 20, SEEDED, stop_ids=frozenset()))

    async def main():
        loop = asyncio.get_running_loop()
        hs = [engine.submit(EngineRequest(ids, 20, SEEDED, stop_ids=frozenset()), loop) for _ in range(3)]
        ticks = 0

        async def ticker():                                # the loop keeps running meanwhile
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        outs = []
        for h in hs:
            outs.append([ev async for ev in h])
        t.cancel()
        return outs, ticks

    outs, ticks = asyncio.run(main())
    for evs in outs:
        assert [e.token for e in evs[:-1]] == [t.token for t in ref]
        assert evs[-1].finish_reason == "length"
    assert ticks > 0


# ------------------------------------------------------------------------------- the text layer
def test_stop_matcher_holds_back_across_pieces():
    m = StopMatcher(["lo Wo", "xyz"])
    assert m.push("Hel") == ("He", False)                  # "l" may start "lo Wo"
    assert m.push("lo") == ("l", False)                    # now "lo" may
    assert m.push(" W") == ("", False)
    assert m.push("orld") == ("", True)                    # matched: nothing of it leaks
    m = StopMatcher(["ab"])
    assert m.push("xa") == ("x", False)
    assert m.push("c") == ("ac", False)                    # the hold-back released
    assert m.push("a") == ("", False) and m.flush() == "a"
    m = StopMatcher(["bc", "abcd"])
    assert m.push("zabc") == ("za", True)                  # the earliest match wins
    assert StopMatcher([]).push("abc") == ("abc", False)


class _Tok:
    """a tokenizer stand-in: token id i is the text PIECES[i]"""
    PIECES = [b"He", b"llo", b" Wo", b"rld", b"\xc3", b"\xa9", b"!"]

    def token_to_piece(self, i, special=False):
        return self.PIECES[i]


def test_text_assembler_stop_and_logprob_release():
    ev = [TokenEvent(i, -float(i)) for i in range(7)]
    a = TextAssembler(_Tok(), ["lo W"])
    assert a.push(ev[0])[:2] == ("He", [(0, ev[0])])
    assert a.push(ev[1])[:2] == ("l", [(2, ev[1])])        # "lo" held back, its token released
    text, rel, stopped = a.push(ev[2])
    assert (text, rel, stopped) == ("", [], True)          # the match: " Wo" starts inside it, dropped
    assert a.finish() == ("", [])
    a = TextAssembler(_Tok(), [])
    out = [a.push(e) for e in ev[3:]]
    assert [o[0] for o in out] == ["rld", "", "é", "!"]    # UTF-8 held back by the decoder
    assert [len(o[1]) for o in out] == [1, 0, 2, 1]        # the incomplete byte's token waits
    assert a.finish() == ("", [])


# ------------------------------------------------------------------------ OpenAI penalties
def test_sampler_openai_penalties_count_generated_tokens_only():
    logits = np.linspace(0.0, 1.0, 10).astype(np.float32)
    s = Sampler(temperature=0, frequency_penalty=0.25, presence_penalty=0.5, penalty_scope="generated")
    s.accept_prompt([9, 9, 9])                             # the prompt is not penalized
    assert s._penalized(logits) is logits
    assert s.sample(logits) == 9
    want = logits.astype(np.float64).copy()
    want[9] -= 0.25 + 0.5                                  # c * frequency + presence, c = 1
    assert np.allclose(s._penalized(logits), want, atol=1e-7)
    assert s.sample(logits) == 8                           # 9 fell to 0.25
    assert s.sample(logits) == 7
    want[[8, 7]] -= 0.25 + 0.5
    assert np.allclose(s._penalized(logits), want, atol=1e-7)
    win = Sampler(temperature=0, frequency_penalty=0.25, presence_penalty=0.5)
    win.accept_prompt([9, 9, 9])                           # llama.cpp's window includes it
    assert win._penalized(logits)[9] == pytest.approx(1.0 - 3 * 0.25 - 0.5)
    with pytest.raises(ValueError, match="penalty_scope"):
        Sampler(penalty_scope="all")
