"""Context beyond the cache (issue 42 item 4): a generation that fills n_ctx stops with stop_reason
"context" (the API's finish_reason "length"), or with context_shift=True shifts the context as
llama.cpp's --context-shift does: the first n_keep positions stay, half of the rest is dropped and
the later K rows are re-rotated by the position delta."""
import numpy as np
import pytest

from _tiny_gguf import write_tiny_gguf
from cpufuse.llama.model import Model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("cs") / "m.gguf", qtype="Q8_0")


def test_full_cache_stops_with_a_reason(path):
    m = Model.load(path, n_ctx=24)
    r = m.generate([5, 6, 7, 8], max_tokens=60, temperature=0, stop_at_eog=False)
    assert r.stop_reason == "context" and len(r.tokens) == 24 - 4 + 1


def test_context_shift_keeps_going_and_rerotates_k(path):
    m = Model.load(path, n_ctx=24)
    r = m.generate([5, 6, 7, 8], max_tokens=60, temperature=0, stop_at_eog=False, context_shift=True, n_keep=3)
    assert r.stop_reason == "length" and len(r.tokens) == 60
    # layer 0's K depends on the token and its position only: after the shifts, the cells must
    # hold what a fresh evaluation of the kept tokens at their new positions writes
    n = m.n_past
    assert m._cached[:3] == [5, 6, 7] and len(m._cached) == n
    fresh = Model.load(path, n_ctx=24)
    fresh.eval(m._cached)
    got, want = m.kv.k[0][:n].astype(np.float64), fresh.kv.k[0][:n].astype(np.float64)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert not np.array_equal(m.kv.k[0][3:n], m.kv.k[0][3:n][::-1])   # (not trivially equal)


def test_shift_context_bad_input(path):
    m = Model.load(path, n_ctx=24)
    m.eval([1, 2, 3])
    with pytest.raises(ValueError, match="nothing to drop"):
        m.shift_context(n_keep=3)
    with pytest.raises(TypeError, match="context_shift must be a bool"):
        m.generate([1, 2], max_tokens=2, context_shift="yes")
    with pytest.raises(ValueError, match="n_keep"):
        m.generate([1, 2], max_tokens=2, n_keep=-1)
