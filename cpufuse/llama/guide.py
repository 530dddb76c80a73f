"""The guided sampler of a request, built in one place for the library (Model.generate, Llama)
and the server: the constraint (response_format, grammar, json_schema, regex, lark), the tools
(cpufuse.llama.tools) and the logit bias, with the rule between them.

    g = build_guide(tokenizer, n_vocab, chat_template=tpl, response_format=..., grammar=...,
                    tools=..., tool_choice=..., parallel_tool_calls=..., logit_bias=...)
    g.constraint, g.spec, g.bias          # Constraint or None, ToolSpec or None, ((id, bias), ...)
    sampler = g.wrap(sampler)             # a GuidedSampler when anything guides, else sampler

Rules (llama-server's): tools with a tool_choice other than "none" constrain the output by
themselves, so they cannot be combined with another constraint; tool_choice and
parallel_tool_calls need tools; at most one constraint. A bad argument raises GuideError (a
ValueError) whose `param` names the request field.

`grammar` is a GBNF string, or an object as llama-cpp-python passes it: a `LlamaGrammar`
(cpufuse.llama.LlamaGrammar, or llama-cpp-python's, whose text is in `_grammar`), or any object
with a string `grammar` attribute.
"""
from __future__ import annotations

import json
from typing import Optional

__all__ = ["Guide", "GuideError", "build_guide", "LlamaGrammar", "grammar_text", "guide_generate"]

_CONSTRAINTS = ("response_format", "grammar", "json_schema", "regex", "lark")


class GuideError(ValueError):
    """a request's constraint, tools or bias is invalid: `param` names the field"""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class LlamaGrammar:
    """llama-cpp-python's LlamaGrammar: a GBNF grammar (from_string / from_file) or a JSON schema
    (from_json_schema), for `grammar=` of Llama's calls and Model.generate."""

    def __init__(self, *, _grammar: str, _schema=None):
        self._grammar = _grammar
        self._schema = _schema

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> "LlamaGrammar":
        if not isinstance(grammar, str):
            raise TypeError(f"grammar must be a str (GBNF), got {type(grammar).__name__}")
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file, verbose: bool = True) -> "LlamaGrammar":
        with open(file, encoding="utf-8") as f:
            return cls.from_string(f.read(), verbose)

    @classmethod
    def from_json_schema(cls, json_schema: str, verbose: bool = True) -> "LlamaGrammar":
        try:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON schema object, got {type(schema).__name__}")
        return cls(_grammar=json.dumps(schema), _schema=schema)

    def __repr__(self):
        return f"LlamaGrammar({'schema' if self._schema is not None else 'gbnf'}: {self._grammar[:40]!r}...)"


def grammar_text(grammar):
    """(GBNF text or None, JSON schema or None) of a grammar argument (module docstring)"""
    if grammar is None or isinstance(grammar, str):
        return grammar, None
    schema = getattr(grammar, "_schema", None)
    if schema is not None:
        return None, schema
    for attr in ("_grammar", "grammar"):
        g = getattr(grammar, attr, None)
        if isinstance(g, str):
            return g, None
    raise GuideError(f"grammar must be a GBNF string or a LlamaGrammar, got {type(grammar).__name__}", "grammar")


def _response_format(rf):
    if rf is None or isinstance(rf, dict):
        return rf
    if hasattr(rf, "model_dump"):
        return rf.model_dump(exclude_none=True)
    raise GuideError(f"response_format must be an object such as {{\"type\": \"json_object\"}}, got "
                     f"{type(rf).__name__}", "response_format")


class Guide:
    """What guides one request's sampling (see the module docstring)."""

    def __init__(self, constraint=None, spec=None, bias=()):
        self.constraint = constraint
        self.spec = spec
        self.bias = bias

    @property
    def tools(self):
        """the ToolSpec whose calls are parsed from the reply, or None (no tools, or "none")"""
        return self.spec if (self.spec is not None and self.spec.choice != "none") else None

    def wrap(self, sampler):
        """sampler behind the bias and the constraint (a GuidedSampler), or sampler itself"""
        if self.constraint is None and not self.bias:
            return sampler
        import numpy as np
        from .constrain import GuidedSampler
        if isinstance(sampler, GuidedSampler):
            raise ValueError("sampler is already a GuidedSampler: pass the constraint there, not both")
        if not hasattr(sampler, "sample"):
            raise TypeError(f"sampler must be a Sampler, got {type(sampler).__name__}")
        bias = ()
        if self.bias:
            bias = (np.asarray([t for t, _ in self.bias], np.int64), np.asarray([b for _, b in self.bias], np.float32))
        return GuidedSampler(sampler, self.constraint, bias)


def build_guide(tokenizer, n_vocab: int, *, chat_template: Optional[str] = None, response_format=None,
                grammar=None, json_schema=None, regex=None, lark=None, tools=None, tool_choice=None,
                parallel_tool_calls=None, logit_bias=None, chat: bool = True) -> Guide:
    """The Guide of one request (module docstring); GuideError naming the field when one is bad.
    chat=False (a text completion): tools are refused."""
    from .constrain import Constraint, parse_logit_bias
    try:
        b = parse_logit_bias(logit_bias, n_vocab)
    except ValueError as e:
        raise GuideError(str(e), "logit_bias") from None
    bias = tuple(zip(b[0].tolist(), b[1].tolist())) if b else ()
    gbnf, schema = grammar_text(grammar)
    if schema is not None:
        if json_schema is not None:
            raise GuideError('only one constraint may be given: got "grammar", "json_schema"', "grammar")
        json_schema = schema
    opts = dict(response_format=_response_format(response_format), grammar=gbnf, json_schema=json_schema,
                regex=regex, lark=lark)
    spec = None
    if tools is not None:
        if not chat:
            raise GuideError("tools are for chat completions (messages), not text prompts", "tools")
        from .tools import ToolSpec
        try:
            spec = ToolSpec(tools, tool_choice, parallel_tool_calls, template=chat_template, tokenizer=tokenizer)
        except (ValueError, TypeError) as e:
            msg = str(e)
            p = next((k for k in ("tool_choice", "parallel_tool_calls") if msg.startswith(k)), "tools")
            raise GuideError(msg, p) from None
        if spec.choice != "none" and any(v is not None and not (k == "response_format" and v.get("type", "text") == "text")
                                         for k, v in opts.items()):
            raise GuideError("response_format, grammar, json_schema, regex and lark cannot be combined with tools "
                             "unless tool_choice is \"none\"", "tools")
    elif tool_choice is not None:
        raise GuideError("tool_choice needs tools", "tool_choice")
    elif parallel_tool_calls is not None:
        raise GuideError("parallel_tool_calls needs tools", "parallel_tool_calls")
    try:
        if spec is not None and spec.choice != "none":
            c = spec.constraint()
        else:
            c = Constraint.from_options(tokenizer, **opts)
    except ValueError as e:
        msg = str(e)
        param = next((k for k in _CONSTRAINTS + ("tools",) if msg.startswith(k)), None)
        if param is None:
            param = next((k for k, v in opts.items() if v is not None), "tools")
        raise GuideError(msg, param) from None
    return Guide(c, spec, bias)


def guide_generate(model, prompt, sampler, **options):
    """Model.generate's guide arguments -> (prompt, sampler, ToolSpec or None): chat messages
    rendered with the tools, the sampler wrapped (build_guide's rules and errors)."""
    tok = model.tokenizer
    g = build_guide(tok, model.n_vocab, chat_template=tok.chat_template, **options)
    spec = g.tools
    if g.spec is not None and isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        from .chat import chat_prompt
        msgs, extra = g.spec.messages(list(prompt))
        text = chat_prompt(tok, msgs, add_generation_prompt=True, **extra)
        prompt = model.tokenize(text, add_bos=False, special=True)
    return prompt, g.wrap(sampler), spec


def with_tool_calls(gen, spec, tokenizer):
    """a generate() loop whose GenerationResult gets .tool_calls (and .text the content) parsed"""
    res = yield from gen
    content, calls = spec.parse(tokenizer.detokenize(res.tokens, special=True))
    if calls is not None:
        res.tool_calls = calls
        res.text = content or ""
    return res
