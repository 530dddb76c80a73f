"""cpufuse.llama.sampling.top_ids: the sampler's top-k (and the logprobs' top alternatives) without a
partition of the whole vocabulary. It must give exactly `np.argsort(-x, kind="stable")[:k]`: the k
largest values, largest first, equal values by lower index, NaN below every number."""
import numpy as np
import pytest

hyp = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cpufuse.llama.sampling import Sampler, top_ids, top_k  # noqa: E402


def reference(x, k):
    return np.argsort(-x, kind="stable")[:k]


VALUES = st.one_of(st.floats(-4, 4, width=32), st.sampled_from([0.0, -0.0, 1.0, -np.inf, np.inf, np.nan]))


@settings(max_examples=400, deadline=None)
@given(st.lists(VALUES, min_size=1, max_size=600), st.integers(1, 700), st.sampled_from([np.float32, np.float64]))
def test_top_ids_is_the_stable_argsort(vals, k, dt):
    x = np.array(vals, dt)
    assert np.array_equal(top_ids(x, k), reference(x, k))


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 49152, 151936])
@pytest.mark.parametrize("k", [1, 3, 40, 100])
@pytest.mark.parametrize("kind", ["normal", "ties", "masked", "nan", "sorted", "reversed"])
def test_top_ids_vocabulary_sizes(n, k, kind):
    rng = np.random.default_rng(n * 131 + k)
    x = rng.standard_normal(n).astype(np.float32) * 3
    if kind == "ties":
        x = np.round(x).astype(np.float32)              # a handful of distinct values, many ties
    elif kind == "masked":                              # a grammar mask: most of the vocabulary -inf
        x[rng.random(n) < 0.995] = -np.inf
    elif kind == "nan":
        x[rng.random(n) < 0.3] = np.nan
    elif kind == "sorted":
        x.sort()
    elif kind == "reversed":
        x = np.sort(x)[::-1].copy()
    assert np.array_equal(top_ids(x, k), reference(x, k))
    v, i = top_k(x, k)
    assert np.array_equal(i, reference(x, k)) and np.array_equal(v, x[i], equal_nan=True)


def test_top_k_zero_is_everything_sorted():
    x = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5], np.float32)
    assert list(top_k(x, 0)[1]) == [1, 3, 2, 0, 5, 4]
    assert top_ids(x, 0).shape == (0,)


def test_seeded_sampling_unchanged_by_the_fast_top_k(monkeypatch):
    """a seeded sampler draws the same tokens as with the full sort's top-k"""
    from cpufuse.llama import sampling
    rng = np.random.default_rng(5)
    logits = [rng.standard_normal(151936).astype(np.float32) * 4 for _ in range(20)]
    fast = Sampler(seed=11)
    got = [fast.sample(lg) for lg in logits]
    monkeypatch.setattr(sampling, "top_ids", reference)
    slow = Sampler(seed=11)
    assert got == [slow.sample(lg) for lg in logits]
