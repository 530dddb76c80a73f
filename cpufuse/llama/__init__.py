"""Run GGUF llama-architecture models on CPU (tokenizer, chat template, model, sampling).

`Model` (cpufuse.llama.model) is the engine; `Llama` (cpufuse.llama.api) is llama-cpp-python's
high-level API on top of it; `hub` resolves model names and Hugging Face repositories."""
from cpufuse._extras import require as _require

_require("llama", "cpufuse.llama")   # tokenizers, jinja2: one clear error if one is missing


def __getattr__(name):  # lazy: `cpufuse.llama.Model` without importing the model engine eagerly
    if name in ("Model", "GenerationResult"):
        from . import model
        return getattr(model, name)
    if name == "Llama":         # llama-cpp-python's high-level API (cpufuse.llama.api)
        from .api import Llama
        return Llama
    if name in ("LlamaPromptLookupDecoding", "LlamaDraftModel", "DraftModel"):   # speculative decoding
        from . import speculative
        return getattr(speculative, name)
    if name == "LlamaGrammar":  # llama-cpp-python's grammar object (cpufuse.llama.guide)
        from .guide import LlamaGrammar
        return LlamaGrammar
    if name == "Sampler":
        from .sampling import Sampler
        return Sampler
    raise AttributeError(f"module 'cpufuse.llama' has no attribute {name!r}")
