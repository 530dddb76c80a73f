"""Llama's per-call helpers, kept out of cpufuse.llama.api: create_chat_completion's guide
arguments, its stream of chunks (tool calls included), and the logits_processor /
stopping_criteria hooks of both completion calls.

    extra = guide_options(functions, function_call, tools, tool_choice, parallel_tool_calls,
                          response_format=..., grammar=..., logit_bias=...)   # for Model.generate
    for chunk in chat_chunks(stream, cid, created, name): ...
    sampler = hooked(sampler, logits_processor, stopping_criteria, eog_id)
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

__all__ = ["guide_options", "chat_chunks", "hooked", "HookedSampler"]


def _callables(x, name):
    """llama-cpp-python's LogitsProcessorList / StoppingCriteriaList, a list of callables or one"""
    if x is None:
        return []
    fs = list(x) if isinstance(x, (list, tuple)) else [x]
    for f in fs:
        if not callable(f):
            raise TypeError(f"{name} must be a callable or a list of callables, got {type(f).__name__}")
    return fs


class HookedSampler:
    """A sampler behind llama-cpp-python's hooks. Each step, with the ids so far (prompt and
    generated, an int32 array) and the step's float32 logits row: every stopping criterion is
    asked first (any True: the end-of-generation token is returned, so the completion stops with
    finish_reason "stop" after the tokens it has); then the logits processors rewrite the row in
    order (each gets the previous one's result) and the wrapped sampler samples it. Under a
    grammar (grammar, response_format, tools) the row the processors get is already masked."""

    def __init__(self, sampler, processors, criteria, eog_id):
        self._s, self.processors, self.criteria, self.eog_id = sampler, processors, criteria, eog_id
        self.ids = []

    def __getattr__(self, name):
        if name == "_s":
            raise AttributeError(name)
        return getattr(self._s, name)

    def accept_prompt(self, ids):
        self.ids = [int(t) for t in ids]
        self._s.accept_prompt(ids)

    def accept(self, token):
        self._s.accept(token)

    def sample(self, logits):
        ids = np.asarray(self.ids, np.intc)
        row = np.asarray(logits, np.float32).reshape(-1)
        if any(bool(c(ids, row)) for c in self.criteria):
            return self.eog_id
        if self.processors:
            row = row.copy()
            for p in self.processors:
                out = p(ids, row)
                row = np.asarray(out, np.float32).reshape(-1)
                if row.shape != (np.asarray(logits).size,):
                    raise ValueError(f"logits_processor returned {row.shape[0]} scores for a row of "
                                     f"{np.asarray(logits).size}")
        tok = self._s.sample(row)
        self.ids.append(int(tok))
        return tok


def hooked(sampler, logits_processor, stopping_criteria, eog_id, guided: bool):
    """sampler behind the hooks (HookedSampler), or sampler itself without any; TypeError for a
    hook that is not callable; stopping_criteria under a grammar is NotImplementedError (the
    grammar decides where the end may come)"""
    ps = _callables(logits_processor, "logits_processor")
    cs = _callables(stopping_criteria, "stopping_criteria")
    if not ps and not cs:
        return sampler
    if cs and guided:
        raise NotImplementedError("stopping_criteria together with grammar, response_format or tools is not "
                                  "supported by cpufuse's Llama")
    if cs and eog_id is None:
        raise NotImplementedError("stopping_criteria needs a model with an end-of-generation token")
    return HookedSampler(sampler, ps, cs, eog_id)


def guide_options(functions, function_call, tools, tool_choice, parallel_tool_calls, **constraints) -> dict:
    """Model.generate keywords of a chat call. The legacy `functions` / `function_call` become
    `tools` / `tool_choice` (as llama-cpp-python and OpenAI map them); giving both forms is a
    ValueError, and so is any argument of the wrong type."""
    if functions is not None:
        if tools is not None:
            raise ValueError("give tools or functions (the legacy form), not both")
        if not isinstance(functions, list):
            raise TypeError(f"functions must be a list of function objects, got {type(functions).__name__}")
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None:
        if tool_choice is not None:
            raise ValueError("give tool_choice or function_call (the legacy form), not both")
        if isinstance(function_call, dict):
            tool_choice = {"type": "function", "function": {"name": function_call.get("name")}}
        elif function_call in ("none", "auto"):
            tool_choice = function_call
        else:
            raise ValueError(f'function_call must be "none", "auto" or {{"name": ...}}, got {function_call!r:.80}')
    if tools is not None and not isinstance(tools, list):
        raise TypeError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
        raise TypeError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", ...}}, got '
                        f"{type(tool_choice).__name__}")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise TypeError(f"parallel_tool_calls must be a bool, got {type(parallel_tool_calls).__name__}")
    rf = constraints.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise TypeError(f"response_format must be a dict such as {{'type': 'json_object'}}, got {type(rf).__name__}")
    lb = constraints.get("logit_bias")
    if lb is not None and not isinstance(lb, (dict, list, tuple)):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(lb).__name__}")
    out = dict(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **constraints)
    return {k: v for k, v in out.items() if v is not None}


def chat_chunks(it, cid, created, name, logprobs=None) -> Iterator[dict]:
    """chat.completion.chunk dicts of a Model.generate stream; with tools, content is sent until a
    call may begin, then the calls come at the end as OpenAI streams them (per call: id, name and
    empty arguments, then the arguments), with finish_reason "tool_calls". logprobs: a function
    of k giving the logprobs of the tokens recorded from the k-th on (each content chunk gets
    those of the tokens sampled since the previous one)."""
    from .tools import ToolStream

    def chunk(delta, finish=None, lp=None):
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
    recs, done = getattr(it, "records", None), [0]

    def lp():
        if logprobs is None or recs is None:
            return None
        out, done[0] = logprobs(done[0]), len(recs)
        return out
    spec = getattr(it, "tool_spec", None)
    ts = ToolStream(spec) if spec is not None else None
    try:
        yield chunk({"role": "assistant"})
        for piece in it:
            if ts is not None:
                piece = ts.push(piece)
            if piece:
                yield chunk({"content": piece}, lp=lp())
        res = it.result
        finish = "stop" if res.stop_reason in ("eog", "stop") else "length"
        if ts is not None:
            rest, calls = ts.finish()
            if rest:
                yield chunk({"content": rest})
            for k, c in enumerate(calls or ()):
                yield chunk({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                             "function": {"name": c["function"]["name"], "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": k, "function": {"arguments": c["function"]["arguments"]}}]})
            if calls:
                finish = "tool_calls"
        yield chunk({}, finish)
    finally:
        it.close()
