"""The model's forward pass as it ran before the decoder graph, one public cpufuse op per step: the
decoder graph must give exactly these numbers (tests/test_llama_model.py): it is the reference for
"the single-sequence logits stay bit-identical". It lives in bench/opbyop.py, which
bench/profile_big.py also drives (timing each op)."""
from bench.opbyop import forward  # noqa: F401
