"""`Llama`: llama-cpp-python's high-level API on cpufuse.llama.Model, for scripts and libraries
written against it (LangChain's and LlamaIndex's LlamaCpp wrappers call these methods).

    from cpufuse.llama import Llama                 # instead of: from llama_cpp import Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048, n_threads=4, seed=0, verbose=False)
    llm = Llama.from_pretrained("org/repo-GGUF", filename="*Q4_K_M.gguf")
    out = llm("Q: Name the planets. A:", max_tokens=32, stop=["Q:", "\\n"])
    out = llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}])
    print(out["choices"][0]["message"]["content"])
    for chunk in llm.create_chat_completion(messages=..., stream=True): ...

Signatures, defaults and return shapes follow llama-cpp-python 0.3 (the OpenAI-shaped dicts:
id, object, created, model, choices, usage, finish_reason; chunks when stream=True), with
response_format (json_object, json_schema), grammar (GBNF text or a LlamaGrammar), tools /
tool_choice (also functions / function_call; streamed or not) and logit_bias, built as the
server builds them (cpufuse.llama.guide). Where cpufuse differs, it says so instead of guessing:
- `model_path` may also be a model name (`python -m cpufuse models`) or a Hugging Face
  repository `org/repo[:QUANT]`;
- `embedding=True` enables `embed`/`create_embedding` (pooling from the file or `pooling_type`;
  cpufuse.llama.embedding); generation still works on such a Llama;
- `draft_model` (LlamaPromptLookupDecoding, or cpufuse's DraftModel: a smaller model) changes no
  token: greedy or seeded output is the same as without it (cpufuse.llama.speculative);
- the RNG is numpy's, so a seed reproduces cpufuse's own output, not llama.cpp's;
- with stream=True, a chunk's logprobs are those of the tokens sampled since the previous chunk
  (a token whose text is still held back, e.g. as the start of a possible stop string, comes with
  a later chunk);
- constructor options that change nothing on a CPU (n_gpu_layers, use_mmap, flash_attn, ...)
  are accepted; options for what cpufuse does not have (lora_path, rope and yarn overrides,
  chat_format, a chat_handler, ...) raise NotImplementedError when set; an
  unknown keyword is a TypeError. Per call, samplers cpufuse does not have (mirostat, typical_p
  < 1, tfs_z < 1) and suffix raise NotImplementedError naming the argument;
- logits_processor gets the row after logit_bias and a grammar's mask (llama-cpp-python: before);
  stopping_criteria with a grammar, response_format or tools is NotImplementedError.
"""
from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Union

import numpy as np

from .sampling import top_ids

__all__ = ["Llama", "LLAMA_DEFAULT_SEED"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF          # llama-cpp-python's "random seed"
PENALTY_LAST_N = 64                      # llama-cpp-python's last_n_tokens_size

# constructor keywords of llama-cpp-python that do not change results on a CPU: accepted, unused
_CTOR_NEUTRAL = {"n_gpu_layers", "split_mode", "main_gpu", "tensor_split", "rpc_servers", "vocab_only",
                 "use_mmap", "use_mlock", "n_ubatch", "n_threads_batch", "offload_kqv",
                 "flash_attn", "op_offload", "swa_full", "numa", "no_perf",
                 "spm_infill", "logits_all", "mul_mat_q", "cache", "draft_model_num_pred_tokens",
                 "n_parts", "f16_kv"}   # the last two: older releases' options, which LangChain still passes
# ... and those that would change them: refused unless left at their default
_CTOR_REFUSED = {"lora_base": None, "lora_path": None, "lora_scale": 1.0, "rope_scaling_type": -1,
                 "yarn_ext_factor": -1.0,
                 "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0,
                 "chat_format": None, "chat_handler": None,
                 "tokenizer": None, "type_k": None, "type_v": None,
                 "kv_overrides": None,                              # would change the model's metadata
                 "last_n_tokens_size": PENALTY_LAST_N}             # the repeat penalty's window
# per-call sampling options cpufuse does not implement: refused unless left at llama-cpp-python's default
_CALL_REFUSED = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0}


def _refuse(name, value, default):
    if value is not None and value != default:
        raise NotImplementedError(f"{name}={value!r} is not supported by cpufuse's Llama (leave it at its default "
                                  f"{default!r})")


def _logsoftmax(x):
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


class _RecordingSampler:
    """Wraps a Sampler; records, for each token sampled, (token, logprob, top n alternatives) from
    the raw logits (llama-cpp-python's logprobs are of the raw scores)."""

    def __init__(self, sampler, n_top):
        self._s, self.n_top, self.records = sampler, n_top, []

    def __getattr__(self, name):
        return getattr(self._s, name)

    def accept_prompt(self, ids):
        self._s.accept_prompt(ids)

    def sample(self, logits):
        tok = self._s.sample(logits)
        lp = _logsoftmax(logits)
        top = []
        if self.n_top > 0:
            k = min(self.n_top, lp.shape[0])
            idx = top_ids(lp, k)
            top = [(int(i), float(lp[i])) for i in idx]
        self.records.append((int(tok), float(lp[tok]), top))
        return tok


class Llama:
    """llama-cpp-python's `Llama` on cpufuse (see the module docstring)."""

    def __init__(self, model_path: str, *, seed: int = LLAMA_DEFAULT_SEED, n_ctx: int = 512, n_batch: int = 512,
                 n_threads: Optional[int] = None, verbose: bool = True, **kwargs):
        from . import hub
        from .model import Model
        rope = {k: kwargs.pop(k) for k in ("rope_freq_base", "rope_freq_scale") if k in kwargs}
        draft = kwargs.pop("draft_model", None)   # speculative decoding (cpufuse.llama.speculative)
        self._embedding = bool(kwargs.pop("embedding", False))    # embeddings (cpufuse.llama.embedding)
        self._pooling = kwargs.pop("pooling_type", -1)
        for k, v in kwargs.items():
            if k in _CTOR_REFUSED:
                _refuse(k, v, _CTOR_REFUSED[k])
            elif k not in _CTOR_NEUTRAL:
                raise TypeError(f"Llama() got an unexpected keyword argument {k!r}")
        if n_threads is not None and n_threads <= 0:   # llama-cpp-python: <= 0 or None = its default
            n_threads = None
        self.verbose = bool(verbose)
        self.model_path = hub.resolve(model_path)
        t0 = time.perf_counter()
        self._model = Model.load(self.model_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
        hp = self._model.hparams
        for k, own in (("rope_freq_base", hp.freq_base), ("rope_freq_scale", hp.freq_scale)):
            v = rope.get(k)      # 0 (llama-cpp-python's default) or the model's own value: accepted
            if v is not None and v != 0 and not np.isclose(v, own, rtol=1e-6):
                raise NotImplementedError(f"{k}={v!r} differs from the model's own {own!r}; cpufuse's Llama does not "
                                          f"override RoPE (leave it at 0, the model's)")
        if self.verbose:
            print(f"cpufuse.llama.Llama: {os.path.basename(self.model_path)} ({self._model.hparams.arch}, "
                  f"n_ctx {self._model.n_ctx}) loaded in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
        self.n_batch = self._model.n_batch
        self.n_threads = n_threads
        self._seed = seed
        self._rng = None if seed is None or seed == LLAMA_DEFAULT_SEED else np.random.default_rng(seed)
        from .speculative import check_draft
        self.draft_model = check_draft(draft, self._model)
        if self._embedding:
            from .embedding import pooling_name
            pooling_name(self._pooling, self._model)      # a bad pooling_type fails here

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, repo_id: str, filename: Optional[str], additional_files=None, local_dir=None,
                        local_dir_use_symlinks="auto", cache_dir=None, **kwargs) -> "Llama":
        """Download `filename` (a name or a glob: exactly one file must match, or the parts of one
        split GGUF, which are all downloaded) and the files `additional_files` matches from the
        Hugging Face repository `repo_id` into huggingface_hub's cache, and load it."""
        from . import hub
        if local_dir is not None or cache_dir is not None:
            raise NotImplementedError("local_dir and cache_dir are not supported: files go to huggingface_hub's "
                                      "cache (HF_HUB_CACHE moves it)")
        if filename is None:
            raise ValueError("filename: expected a file name or glob pattern of a .gguf in the repository, got None")
        return cls(model_path=hub.hf_file(repo_id, filename, additional_files), **kwargs)

    # ----------------------------------------------------------------------------------- basics
    @property
    def model(self):
        """the cpufuse.llama.Model underneath"""
        return self._model

    @property
    def metadata(self) -> Dict[str, str]:
        hp = self._model.hparams
        return {"general.architecture": hp.arch, f"{hp.arch}.context_length": str(hp.n_ctx_train),
                f"{hp.arch}.block_count": str(hp.n_layer), f"{hp.arch}.embedding_length": str(hp.n_embd)}

    def n_ctx(self) -> int:
        return self._model.n_ctx

    def n_vocab(self) -> int:
        return self._model.n_vocab

    def n_embd(self) -> int:
        return self._model.hparams.n_embd

    def token_bos(self) -> int:
        b = self._model.tokenizer.bos_id
        return -1 if b is None else b

    def token_eos(self) -> int:
        e = self._model.tokenizer.eos_id
        return -1 if e is None else e

    def reset(self) -> None:
        self._model.reset()

    def set_seed(self, seed: int) -> None:
        self._seed = seed
        self._rng = None if seed == LLAMA_DEFAULT_SEED else np.random.default_rng(seed)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        """token ids of `text` (bytes, as llama-cpp-python takes it); add_bos=True adds the tokens the
        model's file asks for (llama.cpp's add_special), False none"""
        if not isinstance(text, (bytes, bytearray)):
            raise TypeError(f"text must be bytes (e.g. 'Hello'.encode('utf-8')), got {type(text).__name__}")
        return self._model.tokenize(bytes(text), add_bos=None if add_bos else False, special=bool(special))

    def detokenize(self, tokens: List[int], prev_tokens: Optional[List[int]] = None, special: bool = False) -> bytes:
        """the bytes of `tokens` (their pieces concatenated)"""
        tok = self._model.tokenizer
        ids = self._model.token_ids(tokens, "tokens")
        return b"".join(tok.token_to_piece(t, special=special) for t in ids)

    # ------------------------------------------------ low level and saved state (cpufuse.llama.state)
    @property
    def n_tokens(self) -> int:
        """tokens in the context (evaluated)"""
        return self._model.n_past

    @property
    def input_ids(self) -> np.ndarray:
        return np.array(self._model._cached[:self._model.n_past], np.intc)

    def eval(self, tokens) -> None:
        """Evaluate `tokens` after those in the context (n_tokens grows by len(tokens))."""
        self._last = self._model.eval(tokens)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None, grammar=None,
               idx=None) -> int:
        """A token from the last eval's logits (cpufuse's sampler chain; penalties over the last 64
        input ids). grammar, logits_processor and idx are not supported here (NotImplementedError)."""
        from .state import llama_sample
        for k, v in (("typical_p", typical_p), ("tfs_z", tfs_z), ("mirostat_mode", mirostat_mode)):
            _refuse(k, v, _CALL_REFUSED[k])
        for k, v in (("logits_processor", logits_processor), ("grammar", grammar), ("idx", idx)):
            if v is not None:
                raise NotImplementedError(f"sample({k}=...) is not supported by cpufuse's Llama")
        return llama_sample(self, getattr(self, "_last", None), temp, top_k, top_p, min_p, repeat_penalty,
                            frequency_penalty, presence_penalty, self._call_seed(None))

    def save_state(self):
        """llama-cpp-python's LlamaState of the context: its tokens and KV cells (llama_state bytes)"""
        from .state import llama_save
        return llama_save(self, getattr(self, "_last", None), self._seed)

    def load_state(self, state) -> None:
        """Restore a save_state() of this model (checked: ValueError on another model's); the
        context continues bit for bit"""
        from .state import llama_load
        self._last, seed = llama_load(self, state)
        self.set_seed(seed)

    def pooling_type(self) -> int:
        """llama.cpp's LLAMA_POOLING_TYPE_* of the embeddings (the model's unless pooling_type was given)"""
        from .embedding import POOLING, pooling_name
        return POOLING[pooling_name(self._pooling, self._model)]

    def embed(self, input: Union[str, List[str]], normalize: bool = False, truncate: bool = True,
              return_count: bool = False):
        """The embedding of a str (a list of floats; with pooling none, one list per token), or a
        list of them for a list of str; normalize=True: L2 (cpufuse.llama.embedding)."""
        from .embedding import llama_embed
        if not self._embedding:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        out, n = llama_embed(self._model, self._pooling, input, 2 if normalize else -1, truncate,
                             lambda b: self.tokenize(b))
        return (out, n) if return_count else out

    def create_embedding(self, input: Union[str, List[str]], model: Optional[str] = None) -> Dict[str, Any]:
        """OpenAI's embeddings response for a str or a list of str (not normalized, as
        llama-cpp-python's)"""
        embeds, n = self.embed(input if isinstance(input, list) else [input], return_count=True)
        return {"object": "list", "data": [{"object": "embedding", "embedding": e, "index": i}
                                           for i, e in enumerate(embeds)],
                "model": model or self.model_path, "usage": {"prompt_tokens": n, "total_tokens": n}}

    # ---------------------------------------------------------------------------- completions
    def __call__(self, prompt, *args, **kwargs):
        return self.create_completion(prompt, *args, **kwargs)

    def create_completion(self, prompt: Union[str, List[int]], suffix: Optional[str] = None,
                          max_tokens: Optional[int] = 16, temperature: float = 0.8, top_p: float = 0.95,
                          min_p: float = 0.05, typical_p: float = 1.0, logprobs: Optional[int] = None,
                          echo: bool = False, stop: Optional[Union[str, List[str]]] = None,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                          repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False,
                          seed: Optional[int] = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: Optional[str] = None,
                          stopping_criteria=None, logits_processor=None, grammar=None, logit_bias=None):
        """A text completion: a dict shaped as OpenAI's text_completion, or with stream=True an
        iterator of its chunks."""
        if suffix is not None:
            raise NotImplementedError("suffix (fill-in-the-middle) is not supported by cpufuse's Llama")
        for k, v in (("typical_p", typical_p), ("tfs_z", tfs_z), ("mirostat_mode", mirostat_mode)):
            _refuse(k, v, _CALL_REFUSED[k])
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
        if echo and logprobs is not None:
            raise NotImplementedError("echo=True with logprobs (the prompt's logprobs) is not supported")
        extra = {k: v for k, v in (("grammar", grammar), ("logit_bias", logit_bias)) if v is not None}
        ids = self._prompt(prompt)
        text_prompt = prompt if isinstance(prompt, str) else self.detokenize(ids).decode("utf-8", "replace")
        run = self._run(ids, max_tokens, temperature, top_p, min_p, top_k, stop, frequency_penalty,
                        presence_penalty, repeat_penalty, seed, logprobs, stream, extra,
                        hooks=(logits_processor, stopping_criteria))
        cid, created, name = f"cmpl-{uuid.uuid4()}", int(time.time()), model or self.model_path
        if stream:
            return self._completion_chunks(run, cid, created, name, text_prompt if echo else "",
                                           len(text_prompt) if logprobs is not None else None)
        res, recs = run
        text = (text_prompt if echo else "") + res.text
        lp = None if logprobs is None else self._completion_logprobs(res, recs, len(text_prompt))
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": _finish(res)}],
                "usage": _usage(len(ids), res)}

    def _completion_chunks(self, it, cid, created, name, head, offset=None) -> Iterator[dict]:
        """the chunks; offset (the prompt's length) not None: each with the logprobs of its tokens"""
        recs, done = getattr(it, "records", None), [0]

        def lp():
            if offset is None or recs is None:
                return None
            new, done[0] = recs[done[0]:], len(recs)
            out = self._completion_logprobs_of(new, offset + lp.sent)
            lp.sent += sum(len(t) for t in out["tokens"])
            return out
        lp.sent = 0

        def chunk(text, finish=None, logprobs=None):
            return {"id": cid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}
        try:
            if head:
                yield chunk(head)
            for piece in it:
                yield chunk(piece, logprobs=lp())
            yield chunk("", _finish(it.result))
        finally:
            it.close()

    # ----------------------------------------------------------------------------------- chat
    def create_chat_completion(self, messages: List[Dict[str, Any]], functions=None, function_call=None,
                               tools=None, tool_choice=None, temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                               stop: Optional[Union[str, List[str]]] = None, seed: Optional[int] = None,
                               response_format=None, max_tokens: Optional[int] = None,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model: Optional[str] = None,
                               logits_processor=None, grammar=None, logit_bias=None,
                               logprobs: Optional[bool] = None, top_logprobs: Optional[int] = None,
                               parallel_tool_calls: Optional[bool] = None):
        """A chat completion: the messages rendered with the model's chat template; a dict shaped as
        OpenAI's chat.completion, or with stream=True an iterator of chat.completion.chunk dicts.
        parallel_tool_calls (OpenAI's field; not in llama-cpp-python): False allows one call."""
        for k, v in (("typical_p", typical_p), ("tfs_z", tfs_z), ("mirostat_mode", mirostat_mode)):
            _refuse(k, v, _CALL_REFUSED[k])
        if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                         or not 0 <= top_logprobs <= 20):
            raise ValueError(f"top_logprobs must be None or an integer in [0, 20], got {top_logprobs!r}")
        from .chatcalls import guide_options
        extra = guide_options(functions, function_call, tools, tool_choice, parallel_tool_calls,
                              response_format=response_format, grammar=grammar, logit_bias=logit_bias)
        msgs = _messages(messages)
        ids = self._model.prompt_ids(msgs)
        n_lp = (top_logprobs or 0) if logprobs else None
        with_tools = extra.get("tools") is not None
        run = self._run(ids, max_tokens, temperature, top_p, min_p, top_k, stop, frequency_penalty,
                        presence_penalty, repeat_penalty, seed, n_lp, stream, extra,
                        prompt=msgs if with_tools else None, hooks=(logits_processor, None))
        cid, created, name = f"chatcmpl-{uuid.uuid4()}", int(time.time()), model or self.model_path
        if stream:
            from .chatcalls import chat_chunks
            recs = getattr(run, "records", None)
            return chat_chunks(run, cid, created, name, None if n_lp is None else (
                lambda k: {"content": [self._chat_lp(t, p, top) for t, p, top in recs[k:]], "refusal": None}))
        res, recs = run
        lp = None
        if n_lp is not None:
            lp = {"content": [self._chat_lp(t, p, top) for t, p, top in self._kept(res, recs)], "refusal": None}
        message = {"role": "assistant", "content": res.text}
        finish = _finish(res)
        if res.tool_calls:   # OpenAI's shape, as llama-cpp-python returns it: content None, the calls
            message = {"role": "assistant", "content": res.text or None, "tool_calls": res.tool_calls}
            finish = "tool_calls"
        return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}],
                "usage": _usage(res.prompt_tokens or len(ids), res)}

    # -------------------------------------------------------------------------------- helpers
    def _prompt(self, prompt):
        if isinstance(prompt, str):
            return self._model.prompt_ids(prompt)
        if isinstance(prompt, (bytes, bytearray)):
            return self._model.prompt_ids(bytes(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                     for t in prompt):
            ids = [int(t) for t in prompt]      # their range is checked once, by Model.generate
            if not ids:
                raise ValueError("prompt: empty")
            return ids
        raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def _call_seed(self, seed):
        if seed is not None:
            return int(seed)
        if self._rng is not None:
            return int(self._rng.integers(0, 2 ** 63))
        return None

    def _run(self, ids, max_tokens, temperature, top_p, min_p, top_k, stop, frequency_penalty,
             presence_penalty, repeat_penalty, seed, n_logprobs, stream, extra, prompt=None, hooks=(None, None)):
        """(GenerationResult, logprob records) or, with stream, the Model's text stream. prompt: what
        Model.generate renders (chat messages, so that tools reach the template), else ids"""
        from .sampling import Sampler
        room = self._model.n_ctx - len(ids)
        if room < 0:
            raise ValueError(f"Requested tokens ({len(ids)}) exceed context window of {self._model.n_ctx}")
        if max_tokens is None or max_tokens <= 0:      # llama-cpp-python: up to the end of the context
            max_tokens = room
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, penalty_last_n=PENALTY_LAST_N,
                          frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                          seed=self._call_seed(seed))
        from .chatcalls import hooked
        tok = self._model.tokenizer
        eog = tok.eos_id if tok.eos_id in self._model.eog_ids else min(self._model.eog_ids, default=None)
        sampler = hooked(sampler, hooks[0], hooks[1], eog,
                         guided=any(extra.get(k) is not None for k in ("grammar", "response_format", "tools")))
        rec = None
        if n_logprobs is not None:
            sampler = rec = _RecordingSampler(sampler, n_logprobs)
        out = self._model.generate(ids if prompt is None else prompt, max_tokens=int(max_tokens), stream=stream,
                                   stop=stop, sampler=sampler, draft=self.draft_model, **extra)
        if stream:
            out.records = rec.records if rec is not None else None
            return out
        return out, (rec.records if rec is not None else None)

    def _kept(self, res, recs):
        """the records of the tokens whose text was kept (all but those cut by a stop string)"""
        recs = recs[:len(res.tokens)]
        if res.stop_reason != "stop":
            return recs
        tok = self._model.tokenizer
        kept, n = [], 0
        for r in recs:
            if n >= len(res.text.encode("utf-8")):
                break
            kept.append(r)
            n += len(tok.token_to_piece(r[0]))
        return kept

    def _piece(self, t):
        b = self._model.tokenizer.token_to_piece(int(t), special=True)
        return b.decode("utf-8", errors="replace"), list(b)

    def _chat_lp(self, t, p, top):
        s, b = self._piece(t)
        return {"token": s, "logprob": p, "bytes": b,
                "top_logprobs": [{"token": self._piece(i)[0], "logprob": v, "bytes": self._piece(i)[1]}
                                 for i, v in top]}

    def _completion_logprobs(self, res, recs, offset):
        return self._completion_logprobs_of(self._kept(res, recs), offset)

    def _completion_logprobs_of(self, recs, offset):
        lp = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        for t, p, top in recs:
            s = self._piece(t)[0]
            lp["tokens"].append(s)
            lp["text_offset"].append(offset)
            lp["token_logprobs"].append(p)
            lp["top_logprobs"].append({self._piece(i)[0]: v for i, v in top} if top else None)
            offset += len(s)
        return lp


def _finish(res):
    """llama-cpp-python's finish_reason: "stop" (end of generation or a stop string), else "length"
    (max_tokens, or the context is full)"""
    return "stop" if res.stop_reason in ("eog", "stop") else "length"


def _usage(n_prompt, res):
    c = len(res.tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": c, "total_tokens": n_prompt + c}


def _messages(messages):
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role', got {m!r}")
        c = m.get("content")
        if isinstance(c, list):
            parts = []
            for p in c:
                if isinstance(p, str):
                    parts.append(p)
                elif isinstance(p, dict) and p.get("type") == "text":
                    parts.append(p.get("text") or "")
                else:
                    raise NotImplementedError(f"messages[{i}]: content parts of type "
                                              f"{p.get('type') if isinstance(p, dict) else type(p).__name__!r} "
                                              "are not supported (text only)")
            m = dict(m, content="".join(parts))
        elif c is None:
            m = dict(m, content="")
        out.append(m)
    return out
