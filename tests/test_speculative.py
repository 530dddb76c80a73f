"""Speculative decoding (cpufuse.llama.speculative): the same tokens as plain decoding on every
architecture, greedy and seeded sampling; the rejection rule's probabilities; the drafts; bad
arguments."""
import collections
import math

import numpy as np
import pytest

pytest.importorskip("gguf")

from cpufuse.llama import Llama, LlamaPromptLookupDecoding, Model  # noqa: E402
from cpufuse.llama.decoder import ARCHS  # noqa: E402
from cpufuse.llama.sampling import Sampler  # noqa: E402
from cpufuse.llama import speculative  # noqa: E402
from cpufuse.llama.speculative import DraftModel, speculate  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402

PROMPT = list(range(5, 40)) * 3          # a lookup-friendly prompt: the random models loop on it
N = 60


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return {a: write_tiny_gguf(d / f"{a}.gguf", qtype="Q8_0", arch=a) for a in ARCHS}


def _oracle(ref, n_prompt, wrong_at=3):
    """a draft that proposes the true continuation `ref`, with one wrong id per step (a rejection)"""
    def draft(ctx):
        nxt = ref[len(ctx) - n_prompt:len(ctx) - n_prompt + 6]
        return [(t + 1) % 200 if j == wrong_at else t for j, t in enumerate(nxt)]
    return draft


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_and_seeded_tokens_unchanged(models, arch):
    # n_batch 32: gemma's sliding-window layers keep rings of window + 32 cells, overwritten by drafts
    m = Model.load(models[arch], n_ctx=256, n_batch=32, n_threads=1)
    plain = m.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False)
    n_past = m.n_past
    look = m.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False,
                      draft=LlamaPromptLookupDecoding(num_pred_tokens=5))
    assert look.tokens == plain.tokens and look.stop_reason == plain.stop_reason
    assert look.draft_accepted > 0 and look.draft_tokens >= look.draft_accepted
    assert m.n_past == n_past            # the cache holds what plain decoding leaves
    ora = m.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False, draft=_oracle(plain.tokens, len(PROMPT)))
    assert ora.tokens == plain.tokens and 0 < ora.draft_accepted < ora.draft_tokens
    # the next call reuses the cached prefix after a speculative one: the same logits
    assert np.array_equal(m.generate(PROMPT, max_tokens=4, temperature=0).tokens, plain.tokens[:4])
    kw = dict(max_tokens=N, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, reuse_cache=False)
    s_plain = m.generate(PROMPT, **kw)
    s_spec = m.generate(PROMPT, draft=_oracle(s_plain.tokens, len(PROMPT)), **kw)
    assert s_spec.tokens == s_plain.tokens and s_spec.draft_accepted > 0
    assert m.generate(PROMPT, draft=_oracle(s_plain.tokens, len(PROMPT)), **kw).tokens == s_plain.tokens


class _Recording(Sampler):
    """a Sampler that keeps a copy of every logits row it samples from"""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rows = []

    def sample(self, logits):
        self.rows.append(np.array(logits, copy=True))
        return super().sample(logits)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_bit_identical_past_512_cells(models, arch):
    """every token is sampled from bit-identical logits with exact f32 activations, past the cells where a
    decode step's attention switches to split-KV (128; 512 before) and past 512 (a multi-row group would not)"""
    m = Model.load(models[arch], n_ctx=1024, n_batch=64, act="f32", n_threads=1)
    prompt = list(range(5, 250)) * 3
    a = _Recording(temperature=0)
    plain = m.generate(prompt, max_tokens=24, sampler=a, reuse_cache=False)
    b = _Recording(temperature=0)
    spec = m.generate(prompt, max_tokens=24, sampler=b, reuse_cache=False, draft=_oracle(plain.tokens, len(prompt)))
    assert spec.tokens == plain.tokens and spec.draft_accepted > 10
    assert all(np.array_equal(x, y) for x, y in zip(a.rows, b.rows)) and len(b.rows) >= len(a.rows)


def test_stops_stream_and_penalties(models):
    m = Model.load(models["llama"], n_ctx=256, n_threads=1)
    plain = m.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False)
    text = m.detokenize(plain.tokens)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    for kw in (dict(stop=[stop]), dict(repeat_penalty=1.3), dict(max_tokens=7), dict(max_tokens=1)):
        args = dict(dict(max_tokens=N, temperature=0, reuse_cache=False), **kw)
        a = m.generate(PROMPT, **args)
        n_past = m.n_past
        b = m.generate(PROMPT, draft=4, **args)
        assert (a.tokens, a.text, a.stop_reason) == (b.tokens, b.text, b.stop_reason), kw
        assert m.n_past == n_past, kw
    it = m.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False, stream=True, draft=4)
    assert "".join(it) == plain.text and it.result.tokens == plain.tokens
    # near the end of the context: drafts are cut to the cells left
    m2 = Model.load(models["llama"], n_ctx=len(PROMPT) + 9, n_threads=1)
    a = m2.generate(PROMPT, max_tokens=N, temperature=0)
    b = m2.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False, draft=8)
    assert a.tokens == b.tokens and b.stop_reason == a.stop_reason == "context"


def test_bad_drafts_are_cut_or_refused(models):
    m = Model.load(models["llama"], n_ctx=256, n_threads=1)
    plain = m.generate(PROMPT, max_tokens=20, temperature=0, reuse_cache=False)
    got = m.generate(PROMPT, max_tokens=20, temperature=0, reuse_cache=False,
                     draft=lambda ctx: [plain.tokens[len(ctx) - len(PROMPT)] if len(ctx) - len(PROMPT) < 20 else 0,
                                        10 ** 9, -1])
    assert got.tokens == plain.tokens           # out-of-range ids end the draft where they start
    with pytest.raises(TypeError, match="draft_model must be"):
        m.generate(PROMPT, draft="lookup")
    with pytest.raises(ValueError, match="num_pred_tokens"):
        m.generate(PROMPT, draft=0)
    with pytest.raises(ValueError, match="num_pred_tokens"):
        LlamaPromptLookupDecoding(num_pred_tokens=0)
    with pytest.raises(TypeError, match="max_ngram_size"):
        LlamaPromptLookupDecoding(max_ngram_size=1.5)
    with pytest.raises(ValueError, match="p_min"):
        DraftModel(m, p_min=2)
    with pytest.raises(ValueError, match="different Model"):
        m.generate(PROMPT, draft=DraftModel(m))


def test_prompt_lookup():
    d = LlamaPromptLookupDecoding(num_pred_tokens=3)
    assert list(d(np.array([1, 2, 3, 4, 5, 9, 2, 3]))) == [4]             # (2, 3) matches: L = 2, 1 token
    assert list(d(np.array([1, 2, 3, 4, 7, 3]))) == []                     # only the last token matches
    assert list(d(np.array([1, 2, 3]))) == []
    assert list(d(np.array([5]))) == []
    assert list(d(np.array([], np.int64))) == []
    assert list(LlamaPromptLookupDecoding(num_pred_tokens=10)(np.array([1, 2, 1, 2]))) == [1]
    assert list(d(np.array([1, 2, 5, 1, 2, 6, 1, 2]))) == [6]              # equal matches: the most recent
    assert list(d(np.array([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2]))) == [5, 8, 1]   # the longer match, L = 3
    copy = list(range(10, 40)) + [99] + list(range(10, 20))              # a copy in progress: L = 10
    for n in (1, 3, 10, 15, 30):
        assert list(LlamaPromptLookupDecoding(num_pred_tokens=n)(np.array(copy))) == copy[10:10 + n]
    assert [len(LlamaPromptLookupDecoding(num_pred_tokens=99)(np.array(copy[:31 + L]))) for L in range(1, 7)] == \
        [0, 1, 3, 7, 15, 31]                                               # 2 ** (L - 1) - 1 tokens


def test_draft_model(models):
    target = Model.load(models["llama"], n_ctx=256, n_threads=1)
    plain = target.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False)
    same = DraftModel(models["llama"], num_pred_tokens=6, p_min=0.0, n_ctx=256, n_threads=1)
    r = target.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False, draft=same)
    assert r.tokens == plain.tokens and r.draft_accepted == r.draft_tokens > 0   # the same weights: all kept
    other = DraftModel(models["qwen2"], num_pred_tokens=6, p_min=0.0, n_ctx=256, n_threads=1)
    r = target.generate(PROMPT, max_tokens=N, temperature=0, reuse_cache=False, draft=other)
    assert r.tokens == plain.tokens and r.draft_tokens > 0
    other.model._tokenizer.tokens = ["x"] + list(other.model.tokenizer.tokens[1:])
    with pytest.raises(ValueError, match="vocabulary differs"):
        target.generate(PROMPT, draft=other)


def test_llama_api_draft_model(models):
    a = Llama(models["qwen3"], n_ctx=256, verbose=False, seed=1)
    b = Llama(models["qwen3"], n_ctx=256, verbose=False, seed=1,
              draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4))
    for kw in (dict(temperature=0), dict(temperature=0.9, seed=5)):
        ra = a.create_completion(PROMPT, max_tokens=30, logprobs=2, **kw)
        rb = b.create_completion(PROMPT, max_tokens=30, logprobs=2, **kw)
        assert ra["choices"][0]["text"] == rb["choices"][0]["text"]
        assert ra["choices"][0]["logprobs"] == rb["choices"][0]["logprobs"]
    with pytest.raises(TypeError, match="draft_model must be"):
        Llama(models["qwen3"], n_ctx=256, verbose=False, draft_model="x")


class _FixedModel:
    """a stand-in for Model in speculate(): every position's logits are `logits`"""

    def __init__(self, logits):
        self.logits, self.n_ctx, self.n_batch, self.n_vocab = np.asarray(logits, np.float32), 100, 16, len(logits)
        self._n_past, self._cached = 0, []

    def _eval(self, toks):
        return self.verify(toks)[0]

    def verify(self, toks):
        self._n_past += len(toks)
        self._cached += list(toks)
        return np.tile(self.logits, (len(toks), 1))


def test_rejection_rule_probabilities(monkeypatch):
    """draft [d, d]: the first id is distributed as p, d is accepted with probability p(d), both
    with p(d)^2 (the standard rule with a point-mass draft); a chi-square check over 4000 runs"""
    lg = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    p = np.exp(lg) / np.exp(lg).sum()
    d, n = 2, 4000
    monkeypatch.setattr(speculative, "verify", lambda model, toks: model.verify(toks))
    s = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    first, accepted = collections.Counter(), collections.Counter()
    for _ in range(n):
        fm = _FixedModel(lg)
        out, k, acc = speculate(fm, 0, s, lambda ctx: [d, d], [0], 8)
        assert k == 2 and len(out) == acc + 1 and fm._n_past == 1 + acc
        first[out[0]] += 1
        accepted[acc] += 1
    chi = sum((first[i] - n * p[i]) ** 2 / (n * p[i]) for i in range(4))
    assert chi < 16.27, (chi, first)          # 3 degrees of freedom, p = 0.001
    want = [1 - p[d], p[d] * (1 - p[d]), p[d] ** 2]
    chi = sum((accepted[i] - n * want[i]) ** 2 / (n * want[i]) for i in range(3))
    assert chi < 13.82, (chi, accepted)       # 2 degrees of freedom
    assert math.isclose(first[d] / n, p[d], abs_tol=0.04)


def test_cli_lookup_and_draft(models, capsys):
    from cpufuse.llama import cli
    base = [models["llama"], "-p", "hello world hello world hello", "-n", "24", "--temp", "0", "-c", "128", "-t", "1"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out
    assert cli.main(base + ["--lookup", "4"]) == 0
    got = capsys.readouterr()
    assert got.out == plain and "accepted" in got.err
    assert cli.main(base + ["--draft", models["qwen2"], "--draft-p-min", "0"]) == 0
    assert capsys.readouterr().out == plain
    assert cli.main(base + ["--lookup", "0"]) == 2
    assert "--lookup must be >= 1" in capsys.readouterr().err
    assert cli.main(base + ["--lookup", "2", "--draft", models["qwen2"]]) == 2
    assert cli.main(base + ["--draft", "/nonexistent.gguf"]) == 2
    assert "--draft /nonexistent.gguf" in capsys.readouterr().err


def test_prompt_lookup_max_ngram_size_is_llama_cpp_pythons_rule():
    """an explicit max_ngram_size is applied: the most recent occurrence of the longest of the last
    1..max_ngram_size tokens, and num_pred_tokens after it (a one-token match drafts too)"""
    d = LlamaPromptLookupDecoding(max_ngram_size=2, num_pred_tokens=3)
    assert list(d(np.array([1, 2, 3, 4, 7, 3]))) == [4, 7, 3]
    assert list(d(np.array([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2]))) == [6, 7, 1]
    assert list(LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=3)(
        np.array([7, 1, 2, 5, 8, 1, 2, 6, 7, 1, 2]))) == [5, 8, 1]
    assert list(d(np.array([1, 2, 3]))) == []
