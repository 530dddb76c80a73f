"""The tests' tiny GGUF models: cpufuse.llama.tiny (random weights, a small byte-level vocab; no
downloads), under the name the tests import."""
from cpufuse.llama.tiny import DEFAULT_DIMS, MERGES, SPECIALS, kquant_dims, tiny_vocab, write_tiny_gguf  # noqa: F401
