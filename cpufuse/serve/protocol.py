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
                 param: Optional[str] = None, code: Optional[str] = None, extra: Optional[dict] = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.extra = extra or {}

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
    logit_bias: Optional[Dict[str, float]] = None

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
        if self.n not in (None, 1):
            raise APIError(f"only one choice per request is supported (n = 1), got n = {self.n}", param="n")
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")


class ContentPart(_Lenient):
    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None

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
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs = true", param="top_logprobs")
        rf = self.response_format
        if rf and rf.get("type", "text") != "text":
            raise APIError(f"response_format type {rf.get('type')!r} is not supported (only 'text')",
                           param="response_format")
        if self.tools and self.tool_choice != "none":
            raise APIError("tools are not supported", param="tools")

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def messages_for_template(self) -> list:
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text()})
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
