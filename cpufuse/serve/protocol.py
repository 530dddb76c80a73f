"""Request models (pydantic) for the OpenAI-compatible endpoints, and OpenAI's error object.

No field is silently ignored: an unknown field is a 400 naming it (OpenAI's "Unrecognized request
argument supplied"), and a field OpenAI defines that cpufuse cannot honour is a 400 saying so unless
it is null. A few OpenAI fields are accepted with a documented meaning here (`user` and
`safety_identifier` are logged; `metadata`, `store: false`, `service_tier` "auto"/"default",
`prompt_cache_key`, `prompt_cache_retention: "in_memory"`, `modalities: ["text"]`: docs/serve.md).
Every optional field accepts null. Values OpenAI rejects are rejected here with a 400.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

__all__ = ["ChatRequest", "CompletionRequest", "APIError", "error_body", "validation_error",
           "ValidationError", "check_fields", "unrecognized"]


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


def unrecognized(names) -> APIError:
    """the 400 of unknown request fields: OpenAI's wording, `param` the (first) field"""
    names = list(names)
    word = "argument" if len(names) == 1 else "arguments"
    return APIError(f"Unrecognized request {word} supplied: {', '.join(names)}", param=names[0],
                    code="unknown_parameter")


def check_fields(obj: dict, allowed) -> None:
    """APIError(400) naming the keys of a JSON body that are not in `allowed` (routes without a
    pydantic model: /tokenize, /detokenize, /v1/embeddings, /slots)"""
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise unrecognized(unknown)


def _param(err) -> str:
    loc = [str(x) for x in err.get("loc", ()) if not str(x).startswith(("function-", "union["))]
    # drop pydantic's union branch names ('str', 'list[str]', ...) from the location
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "list")]
    return ".".join(loc)


def validation_error(e: ValidationError) -> APIError:
    """the 400 of a pydantic ValidationError: the unknown fields if there are any (a field unknown
    inside a union member is reported once), else its first error, located."""
    errs = e.errors(include_url=False)
    if not errs:
        return APIError(str(e))
    extra = list(dict.fromkeys(_param(x) for x in errs if x.get("type") == "extra_forbidden"))
    if extra:
        return unrecognized(extra)
    first = errs[0]
    param = _param(first) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return APIError(f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param)


MAX_N = 16   # the most choices (n) one request may ask for


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def refuse_set(self, reasons: Dict[str, str]) -> None:
        """APIError(400) for the first of `reasons`' fields that is set (not None)"""
        for name, why in reasons.items():
            if getattr(self, name) is not None:
                raise APIError(f"{name} is not supported by cpufuse: {why}", param=name)


def _with_refused(model, reasons: Dict[str, str]):
    """`model` with one field per name of `reasons` (OpenAI fields cpufuse cannot honour), accepted
    by parsing so that the model's check can refuse them with their reason unless null"""
    return create_model(model.__name__.lstrip("_"), __base__=model, __module__=__name__,
                        **{name: (Optional[Any], None) for name in reasons})


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    include_obfuscation: Optional[bool] = None

    def check(self) -> None:
        if self.include_obfuscation:
            raise APIError("stream_options.include_obfuscation: cpufuse sends no obfuscation padding; "
                           "send false or leave it out", param="stream_options.include_obfuscation")


class _Sampling(_Strict):
    model: Optional[str] = None
    user: Optional[str] = None          # logged with the request (metrics.log_line)
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
        if self.stream_options is not None:
            self.stream_options.check()

    def constraint_options(self) -> dict:
        return dict(response_format=self.response_format, grammar=self.grammar, json_schema=self.json_schema,
                    regex=self.regex, lark=self.lark)


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None
    # the other part types' payloads: declared so that such a part gets the "not supported" 400
    image_url: Optional[Any] = None
    input_audio: Optional[Any] = None
    file: Optional[Any] = None
    refusal: Optional[Any] = None
    prompt_cache_breakpoint: Optional[Any] = None


class ToolCallFunction(_Strict):
    name: str
    arguments: Optional[Union[str, Dict[str, Any]]] = None


class ToolCall(_Strict):
    id: Optional[str] = None
    type: Optional[Literal["function"]] = "function"
    function: ToolCallFunction


# OpenAI message fields cpufuse cannot honour: accepted only as null (an echoed reply carries them)
MESSAGE_REFUSED = {
    "audio": "audio output is not supported",
    "function_call": "the deprecated function_call; use tool_calls",
    "refusal": "cpufuse's replies have no refusals to send back",
    "annotations": "message annotations are not supported",
}


class _ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # and the fields of MESSAGE_REFUSED (_with_refused below)

    def text(self) -> str:
        for name, why in MESSAGE_REFUSED.items():
            v = getattr(self, name)
            if v is not None and v != []:
                raise APIError(f"messages: {name} is not supported by cpufuse: {why}", param="messages")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise APIError(f"message content parts of type {p.type!r} are not supported "
                               "(text only)", param="messages")
            if p.prompt_cache_breakpoint is not None:
                raise APIError("messages: prompt_cache_breakpoint is not supported by cpufuse: its prompt "
                               "cache is automatic (whole chunks of the longest shared prefix)", param="messages")
            parts.append(p.text)
        return "".join(parts)


ChatMessage = _with_refused(_ChatMessage, MESSAGE_REFUSED)


# OpenAI chat fields cpufuse cannot honour: a 400 unless null
CHAT_REFUSED = {
    "audio": "audio output is not supported (text only)",
    "prediction": "predicted outputs are not supported (--lookup and --draft speculate on the server's side)",
    "reasoning_effort": "the effort is not passed to the model",
    "verbosity": "the verbosity is not passed to the model",
    "web_search_options": "there is no web search",
    "functions": "the deprecated functions; use tools",
    "function_call": "the deprecated function_call; use tool_choice",
    "moderation": "there is no moderation",
    "prompt_cache_options": "the prompt cache is automatic (whole chunks of the longest shared prefix)",
}


class _ChatRequest(_Sampling):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # accepted with a documented meaning (docs/serve.md): logged, or what cpufuse does anyway
    safety_identifier: Optional[str] = None
    metadata: Optional[Dict[str, str]] = Field(None, max_length=16)
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    modalities: Optional[List[str]] = None
    # and the fields of CHAT_REFUSED, refused unless null (_with_refused below)

    def check(self) -> None:
        self.check_common()
        self.refuse_set(CHAT_REFUSED)
        if self.store:
            raise APIError("store: cpufuse keeps no completions; send false or leave it out", param="store")
        if self.service_tier not in (None, "auto", "default"):
            raise APIError(f"service_tier: cpufuse has one tier ('auto' or 'default'), got {self.service_tier!r}",
                           param="service_tier")
        if self.prompt_cache_retention not in (None, "in_memory"):
            raise APIError("prompt_cache_retention: the prompt cache is in memory only ('in_memory'), got "
                           f"{self.prompt_cache_retention!r}", param="prompt_cache_retention")
        if self.modalities is not None and self.modalities != ["text"]:
            raise APIError(f"modalities: cpufuse writes text only (['text']), got {self.modalities!r}",
                           param="modalities")
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


ChatRequest = _with_refused(_ChatRequest, CHAT_REFUSED)


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
