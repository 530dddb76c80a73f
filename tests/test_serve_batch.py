"""BatchEngine (continuous batching on the multi-sequence decoder graph): a request's tokens are
identical alone, beside others, joining mid-way and after a prompt-cache hit; cancellation frees
the slot within a step; the prompt cache reuses whole chunks."""
import threading
import time

import numpy as np
import pytest

from _serving import collect as _collect
from _tiny_gguf import write_tiny_gguf

from cpufuse.llama import Model
from cpufuse.serve.batch import BatchEngine
from cpufuse.serve.engine import EngineRequest, FinishEvent, SamplingParams, TokenEvent


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("batch") / "tiny.gguf"
    write_tiny_gguf(p, qtype="Q4_0")
    return str(p)


def _engine(path, parallel=4, chunk=8, n_ctx=160, step_tokens=None):
    eng = BatchEngine(Model.load(path, n_ctx=n_ctx, n_seq=parallel), chunk=chunk, step_tokens=step_tokens)
    eng.start()
    return eng




def _requests(rng, n):
    reqs = []
    for i in range(n):
        L = int(rng.integers(3, 40))
        prompt = [int(t) for t in rng.integers(5, 250, L)]
        sp = SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i)
        reqs.append(EngineRequest(prompt, int(rng.integers(4, 20)), sp))
    return reqs


def _copy(r):
    return EngineRequest(list(r.prompt_ids), r.max_tokens, r.sampling, r.logprobs, r.stop_ids)


def test_tokens_do_not_depend_on_the_batch(gguf_path):
    rng = np.random.default_rng(0)
    reqs = _requests(rng, 10)
    reqs.append(EngineRequest(reqs[0].prompt_ids + [7, 8, 9] * 6, 9, SamplingParams(temperature=0.0)))  # shared prefix
    eng = _engine(gguf_path)
    try:
        alone = [_collect(eng.submit(_copy(r))) for r in reqs]      # one at a time
        hs = [eng.submit(_copy(r)) for r in reqs]                     # all at once (more than the slots)
        together = [_collect(h) for h in hs]
        # joining mid-way: start half, then the rest once the first tokens are out
        hs1 = [eng.submit(_copy(r)) for r in reqs[:5]]
        first = next(iter(hs1[0]))
        hs2 = [eng.submit(_copy(r)) for r in reqs[5:]]
        t0 = [first.token] + _collect(hs1[0])[0] if isinstance(first, TokenEvent) else []
        mid = [(t0, None)] + [_collect(h) for h in hs1[1:] + hs2]
        assert eng.stats().steps > 0
    finally:
        eng.stop()
    for i, r in enumerate(reqs):
        assert alone[i][0] == together[i][0] == mid[i][0], i
        assert alone[i][1].finish_reason in ("stop", "length")
    assert len(together[3][0]) > 0
    # and they are the library's: Model.generate with micro-batches of the engine's chunk
    from cpufuse.serve.engine import make_sampler
    m = Model.load(gguf_path, n_ctx=160, n_batch=8)
    for i, r in enumerate(reqs):
        ref = m.generate(list(r.prompt_ids), max_tokens=r.max_tokens, sampler=make_sampler(r.sampling),
                         stop_at_eog=False, reuse_cache=False).tokens
        assert alone[i][0] == ref[:len(alone[i][0])] and len(alone[i][0]) == len(ref), i


def test_a_bigger_step_budget_changes_no_token(gguf_path):
    """--batch-tokens: several prompts' chunks in one step; each request's tokens stay its own"""
    reqs = _requests(np.random.default_rng(1), 8)
    eng = _engine(gguf_path)
    try:
        alone = [_collect(eng.submit(_copy(r)))[0] for r in reqs]
    finally:
        eng.stop()
    eng = _engine(gguf_path, step_tokens=40)
    try:
        assert eng.step_tokens == 40 and eng.cap[0] == 40 + 4
        hs = [eng.submit(_copy(r)) for r in reqs]
        together = [_collect(h)[0] for h in hs]
        peak = eng.stats()
    finally:
        eng.stop()
    assert together == alone
    assert peak.steps > 0


def test_prompt_cache_reuses_whole_chunks(gguf_path):
    eng = _engine(gguf_path, parallel=2, chunk=8)
    prompt = [int(t) for t in np.random.default_rng(1).integers(5, 250, 30)]
    try:
        a, fa = _collect(eng.submit(EngineRequest(prompt, 5, SamplingParams(temperature=0.0))))
        b, fb = _collect(eng.submit(EngineRequest(prompt + [11, 12], 5, SamplingParams(temperature=0.0))))
        c, fc = _collect(eng.submit(EngineRequest(prompt, 5, SamplingParams(temperature=0.0))))
    finally:
        eng.stop()
    assert fa.cached_tokens == 0
    assert fb.cached_tokens == 24      # 30 shared tokens, whole chunks of 8
    assert fc.cached_tokens % 8 == 0 and fc.cached_tokens >= 24
    assert a == c
    eng2 = _engine(gguf_path, parallel=2, chunk=8)
    try:
        b2, _ = _collect(eng2.submit(EngineRequest(prompt + [11, 12], 5, SamplingParams(temperature=0.0))))
    finally:
        eng2.stop()
    assert b == b2                      # a cache hit gives the tokens of a cold start


def test_cancel_frees_the_slot_within_a_step(gguf_path):
    eng = _engine(gguf_path, parallel=1, chunk=8)
    # The tiny model steps far faster than a loaded machine schedules this consumer, so the engine
    # runs in lock step with it: a step waits until the consumer has taken every event (or 10 s).
    handles = []
    step = eng._step

    def lockstep():
        for h in handles:
            t_end = time.monotonic() + 10
            while not h._q.empty() and not h.cancelled and time.monotonic() < t_end:
                time.sleep(0.0005)
        return step()
    eng._step = lockstep
    try:
        h = eng.submit(EngineRequest([5, 6, 7], 100, SamplingParams(temperature=0.0)))
        handles.append(h)
        got = []
        for ev in h:
            got.append(ev)
            if len(got) == 3:
                h.cancel()
        assert isinstance(got[-1], FinishEvent) and got[-1].finish_reason == "cancelled"
        assert len(got) <= 6
        # the one slot serves the next request
        toks, fin = _collect(eng.submit(EngineRequest([5, 6, 7], 4, SamplingParams(temperature=0.0))))
        assert fin.finish_reason == "length" and len(toks) == 4
        assert eng.stats().active == 0
    finally:
        eng.stop()


def test_many_threads_submit(gguf_path):
    eng = _engine(gguf_path, parallel=3)
    rng = np.random.default_rng(2)
    reqs = _requests(rng, 9)
    out = [None] * len(reqs)
    try:
        alone = [_collect(eng.submit(_copy(r)))[0] for r in reqs]

        def go(i):
            out[i] = _collect(eng.submit(_copy(reqs[i])))[0]
        ts = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    finally:
        eng.stop()
    assert out == alone


def test_same_prompt_requests_share_its_kv(gguf_path):
    """n choices of one prompt (submitted together): the first evaluates it, the others wait for
    its whole chunks and copy their KV; every token is what the request gives alone"""
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(5, 250, 45)]            # 5 whole chunks of 8 + 5
    reqs = [EngineRequest(list(prompt), 10, SamplingParams(temperature=0.9, seed=40 + i)) for i in range(4)]
    other = EngineRequest([int(t) for t in rng.integers(5, 250, 20)], 6, SamplingParams(temperature=0.0))
    eng = _engine(gguf_path, parallel=4)
    try:
        alone = [_collect(eng.submit(_copy(r))) for r in reqs + [other]]
    finally:
        eng.stop()
    eng = _engine(gguf_path, parallel=4)          # a fresh engine: nothing cached in free slots
    try:
        hs = [eng.submit(_copy(r)) for r in reqs + [other]]
        together = [_collect(h) for h in hs]
        cached = [h.cached_tokens for h in hs]
        st = eng.stats()
    finally:
        eng.stop()
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert cached[0] == 0 and cached[1:4] == [40, 40, 40]          # the other choices copied 5 chunks
    assert st.cached_prompt_tokens == 120
