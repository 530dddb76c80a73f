"""Request models (pydantic) for the OpenAI-compatible endpoints, and OpenAI's error object.

Unknown fields are accepted and ignored (clients send `user`, `metadata`, `store`...); every
optional field accepts null. Values OpenAI rejects are rejected here with a 400.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ChatRequest", "CompletionRequest", "APIError", "error_body", "validation_message",
           "ValidationError"]


class APIError(Exception):
    """An error answered as OpenAI's {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, extra: Optional[dict] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.extra = extra or {}
        self.headers = headers or {}         # e.g. Retry-After of a 503

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code, self.extra)


def error_body(message, type="invalid_request_error", param=None, code=None, extra=None) -> dict:
    err = {"message": message, "type": type, "param": param, "code": code}
    err.update(extra or {})
    return {"error": err}


def validation_message(e: ValidationError) -> tuple:
    """(message, param) from a pydantic ValidationError: its first error, located."""
    errs = e.errors(include_url=False)
    if not errs:
        return str(e), None
    first = errs[0]
    loc = [str(x) for x in first.get("loc", ()) if not str(x).startswith(("function-", "union["))]
    # drop pydantic's union branch names ('str', 'list[str]', ...) from the location
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "list")]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


MAX_N = 16   # the most choices (n) one request may ask for


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: Optional[bool] = False


class _Sampling(_Lenient):
    model: Optional[str] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    stop: Optional[Union[str, List[str]]] = Field(None, validate_default=True)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repeat_penalty: Optional[float] = Field(None, gt=0.0, le=100.0)   # llama.cpp's (1.0: off)
    max_tokens: Optional[int] = Field(None, ge=1)
    n: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[bool] = False
    logit_bias: Optional[Union[Dict[str, float], List[List[float]]]] = None
    # constraints (cpufuse.llama.constrain): OpenAI's response_format; llama.cpp's grammar (GBNF)
    # and json_schema; regex and lark (cpufuse's own: a regular expression / a Lark grammar)
    response_format: Optional[Dict[str, Any]] = None
    grammar: Optional[str] = None
    json_schema: Optional[Any] = None
    regex: Optional[str] = None
    lark: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else list(v)
        if len(v) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    def check_common(self) -> None:
        if self.n is not None and self.n > MAX_N:
            raise APIError(f"n must be <= {MAX_N}, got n = {self.n}", param="n")

    def constraint_options(self) -> dict:
        return dict(response_format=self.response_format, grammar=self.grammar, json_schema=self.json_schema,
                    regex=self.regex, lark=self.lark)


class ContentPart(_Lenient):
    type: str
    text: Optional[str] = None


class ToolCallFunction(_Lenient):
    name: str
    arguments: Optional[Union[str, Dict[str, Any]]] = None


class ToolCall(_Lenient):
    id: Optional[str] = None
    type: Optional[Literal["function"]] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise APIError(f"message content parts of type {p.type!r} are not supported "
                               "(text only)", param="messages")
            parts.append(p.text)
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs = true", param="top_logprobs")
        if self.tool_choice is not None and not self.tools:
            raise APIError("tool_choice needs tools", param="tool_choice")
        if self.parallel_tool_calls is not None and not self.tools:
            raise APIError("parallel_tool_calls needs tools", param="parallel_tool_calls")
        if self.tools is not None and not self.tools:
            raise APIError("tools must not be empty", param="tools")

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def messages_for_template(self) -> list:
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            d = {"role": role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError("best_of is not supported", param="best_of")

    def limit(self) -> Optional[int]:
        return self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return self.logprobs

    def single_prompt(self):
        """The one prompt: a str or a list of token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"only one prompt per request is supported, got {len(p)}", param="prompt")
            p = p[0]
        return p
