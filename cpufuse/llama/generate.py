"""Generation on a Model: the sample/evaluate loop behind `Model.generate`, its result and the
stream iterator. The arguments were checked by Model.generate (the API edge): the prompt ids are
in range, the sampler is built.

    gen = decode(model, ids, max_tokens, sampler, stop_at_eog, reuse_cache, stops)
    for piece in gen: ...                  # text pieces; StopIteration.value: GenerationResult
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

__all__ = ["GenerationResult", "Streamer", "decode"]


@dataclass
class GenerationResult:
    """What `Model.generate(..., stream=False)` returns."""
    tokens: List[int]                 # generated ids (without the stopping EOG token)
    text: str
    prompt_tokens: int                # prompt length
    prompt_eval_tokens: int           # prompt tokens actually evaluated (after cache reuse)
    prompt_time: float                # seconds
    decode_tokens: int                # single-token decode steps
    decode_time: float
    stop_reason: str                  # "eog" | "length" | "context" | "stop" (a stop string)
    stop_token: Optional[int] = None
    prompt_ids: List[int] = field(default_factory=list)
    tool_calls: Optional[List[dict]] = None    # generate(tools=...): the calls parsed from the text
    draft_tokens: int = 0             # speculative decoding (generate(draft=...)): ids drafted ...
    draft_accepted: int = 0           # ... and how many of them the target kept
    draft_steps: int = 0              # ... in how many decoder calls (one verification each)

    @property
    def prompt_tps(self):
        return self.prompt_eval_tokens / self.prompt_time if self.prompt_time > 0 else float("nan")

    @property
    def decode_tps(self):
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else float("nan")

    def timings(self):
        return {"prompt_tokens": self.prompt_eval_tokens, "prompt_s": self.prompt_time,
                "prompt_tps": self.prompt_tps, "decode_tokens": self.decode_tokens,
                "decode_s": self.decode_time, "decode_tps": self.decode_tps}

    def __str__(self):
        return self.text


class Streamer:
    """Iterator of text pieces; `.result` holds the GenerationResult once exhausted."""

    def __init__(self, gen):
        self._gen = gen
        self.result = None
        self.tool_spec = None          # generate(tools=...): the ToolSpec (cpufuse.llama.tools)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._gen)
        except StopIteration as e:
            self.result = e.value
            raise StopIteration from None

    def close(self):
        self._gen.close()


def decode(model, ids, max_tokens, sampler, stop_at_eog, reuse_cache, stops=(), draft=None, shift=None):
    """The generation loop. Every step that touches the cache runs under the lock, bumps the
    model's epoch and remembers it; a step that finds another epoch was interrupted.
    draft: None, or a draft (cpufuse.llama.speculative): each step then verifies the drafted ids
    in one batch and queues the ids it sampled; the same ids come out (see speculative.py), and
    the cache is rewound at the end to what plain decoding leaves. A full cache stops it ("context"),
    or, without a draft, shift (a callable: Model.shift_context, returning the positions it
    dropped) shifts the context."""
    from collections import deque
    from .stops import StopMatcher
    from .tokenizer import StreamDecoder
    eog = model.eog_ids if stop_at_eog else frozenset()
    sm = StopMatcher(stops)
    dec = StreamDecoder(model.tokenizer) if model._tokenizer is not None else None
    with model._lock:
        model._epoch += 1
        epoch = model._epoch
        # prefix reuse (llama-cpp-python style): keep the cached cells that match, re-evaluate >= 1
        keep = 0
        if reuse_cache:
            c = model._cached
            m = min(len(c), len(ids) - 1)
            while keep < m and c[keep] == ids[keep]:
                keep += 1
            keep = model.kv.reusable(keep, max(len(c), getattr(model, "_spec_written", 0)))   # speculative.written
        model._n_past = keep
        del model._cached[keep:]
        sampler.accept_prompt(ids)
        t0 = time.perf_counter()
        logits = model._eval(ids[keep:])
        t_prompt = time.perf_counter() - t0
        tok = sampler.sample(logits) if max_tokens else None
    out, t_dec, n_dec = [], 0.0, 0
    queued, n_draft, n_acc, n_ver, cap = deque(), 0, 0, 0, 1 << 30
    stop, stop_tok = "length", None
    shifted = 0                             # positions context shifts dropped
    text_parts = []
    for i in range(max_tokens):
        if tok in eog:
            stop, stop_tok = "eog", tok
            break
        out.append(tok)
        if dec is not None:
            s, hit = sm.push(dec.push(tok))
            if s:
                text_parts.append(s)
                yield s                     # no lock is held here
            if hit:
                stop = "stop"
                break
        if i == max_tokens - 1:
            break
        with model._lock:
            if model._epoch != epoch:
                raise RuntimeError("this stream was interrupted by another generate(), eval(), logits() or "
                                   "reset() call on the same Model, which changed its KV cache; start a new "
                                   "generate() (a Model holds one sequence)")
            if len(ids) + n_dec - shifted >= model.n_ctx:     # the tokens plain decoding has evaluated
                if shift is None or draft is not None or model.kv.ring_cells:
                    stop = "context"
                    break
                shifted += shift()
            t0 = time.perf_counter()
            if draft is None:
                tok = sampler.sample(model._eval([tok]))
            else:
                if not queued:
                    from .speculative import next_cap, speculate
                    got, nd, na = speculate(model, tok, sampler, draft, ids + out, min(cap, max_tokens - 2 - i))
                    queued.extend(got)
                    n_draft, n_acc, n_ver = n_draft + nd, n_acc + na, n_ver + (nd > 0)
                    cap = next_cap(cap, nd, na)     # fewer drafts after a rejection, more after none
                tok = queued.popleft()
            t_dec += time.perf_counter() - t0
            n_dec += 1
            model._epoch += 1
            epoch = model._epoch
    if queued:
        with model._lock:          # ids sampled ahead of a stop: forget them, as plain decoding never saw them
            if model._epoch == epoch:
                from .speculative import rewind
                rewind(model, min(model._n_past, len(ids) + n_dec))
    if dec is not None and stop != "stop":
        s, hit = sm.push(dec.flush())
        if hit:
            stop = "stop"
        else:
            s += sm.flush()
        if s:
            text_parts.append(s)
            yield s
    return GenerationResult(tokens=out, text="".join(text_parts), prompt_tokens=len(ids),
                            prompt_eval_tokens=len(ids) - keep, prompt_time=t_prompt,
                            decode_tokens=n_dec, decode_time=t_dec, stop_reason=stop, stop_token=stop_tok,
                            prompt_ids=list(ids), draft_tokens=n_draft, draft_accepted=n_acc,
                            draft_steps=n_ver)

