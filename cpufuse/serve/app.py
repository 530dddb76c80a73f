"""The OpenAI-compatible HTTP layer: a Starlette app over an `Engine` (cpufuse.serve.engine).

    app = create_app(engine)          # the app starts the engine at startup and stops it at shutdown
    uvicorn.run(app, host=..., port=...)

Endpoints: GET /health (also /v1/health), GET /v1/models (also /models), POST /v1/chat/completions,
POST /v1/completions, GET /metrics (Prometheus text), POST /tokenize and /detokenize (llama-server's
shapes). Constraints (response_format, grammar, json_schema, regex, lark) and tools are compiled
per request (cpufuse.llama.constrain, cpufuse.llama.tools) and enforced by the engine. The app
never calls the model: it renders the chat template, tokenizes, checks the request against the
context and submits token ids to the engine; cpufuse.serve.responses turns its token events into
OpenAI's replies (text, stop strings, logprobs, tool calls) and cpufuse.serve.metrics counts and
logs.

Decisions (docs/serve.md has the full list):
- the `model` field is not checked (one model is served, as llama.cpp does); responses name the
  served model;
- a prompt that with max_tokens (max_completion_tokens) exceeds the context is a 400
  `context_length_exceeded` with OpenAI's message; without max_tokens the completion may use the
  rest of the context; an engine with context_shift (serve --context-shift) takes any max_tokens
  and only a prompt that fills the context is the 400;
- no request field is silently ignored: an unknown one is a 400 naming it, on every route
  (cpufuse.serve.protocol);
- a client that disconnects, streaming or not, has its request cancelled in the engine;
- a request the engine cannot start now waits in its queue (no capacity error).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from cpufuse.llama.chat import TemplateError, chat_prompt

from .engine import EngineRequest, EngineStopped, SamplingParams
from .guard import Guard, Limits
from .metrics import Metrics, log_line, log_user
from .protocol import (APIError, ChatRequest, CompletionRequest, ValidationError, check_fields, error_body,
                       validation_error)
from .responses import Responses, SSEResponse

__all__ = ["create_app"]

log = logging.getLogger("cpufuse.serve")   # one line per request (python -m cpufuse serve prints it)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


class _Server(Responses):
    """the endpoints (request parsing, checks, submission); the response shapes are Responses'"""

    def __init__(self, engine, drain: float = 0.0, sampling: Optional[SamplingParams] = None,
                 limits: Optional[Limits] = None, pooling=None, slot_save_path=None):
        self.loader = engine if (callable(engine) and not hasattr(engine, "submit")) else None
        self.engine = None if self.loader is not None else engine     # None while the model loads
        self.load_error: Optional[str] = None
        self.on_load_error = None            # called with the exception when the loader fails (the CLI exits)
        self.draining = False                # shutdown began: new requests get 503 (guard.drain)
        self.open = 0                        # HTTP requests open (guard.Guard counts them)
        self.limits = Limits() if limits is None else limits
        self.embeddings_arg = None           # create_app's embeddings: the pooling is set once the model is there
        self.pooling = pooling          # /v1/embeddings: a pooling name, or None (not served)
        self.slot_save_path = slot_save_path   # /slots/{id}?action=...: a directory, or None (not served)
        self.drain = drain
        self.defaults = SamplingParams() if sampling is None else sampling
        self.created = int(time.time())
        self.counters = Metrics()

    # ------------------------------------------------------------------ helpers
    async def parse(self, request: Request, model):
        try:
            raw = await request.body()
            obj = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise APIError(f"the request body must be a JSON object, got {type(obj).__name__}")
        try:
            req = model.model_validate(obj)
        except ValidationError as e:
            raise validation_error(e) from None
        req.check()
        return req

    def context_check(self, n_prompt: int, limit: Optional[int], chat: bool) -> int:
        """max_tokens for the engine, or APIError(400, context_length_exceeded)."""
        n_ctx = self.engine.n_ctx
        where = ("messages", "in the messages", "the messages") if chat else ("prompt", "in your prompt", "your prompt")
        extra = {"n_prompt_tokens": n_prompt, "n_ctx": n_ctx}
        if limit is None:
            if n_prompt < n_ctx:
                return n_ctx - n_prompt
            raise APIError(f"This model's maximum context length is {n_ctx} tokens. However, your prompt "
                           f"resulted in {n_prompt} tokens ({n_prompt} {where[1]}), which leaves no room for "
                           f"the completion. Please reduce the length of {where[2]}.",
                           param=where[0], code="context_length_exceeded", extra=extra)
        if getattr(self.engine, "context_shift", False):
            self.context_check(n_prompt, None, chat)      # the prompt must leave room; the rest shifts
            return limit
        if n_prompt + limit > n_ctx:
            raise APIError(f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                           f"{n_prompt + limit} tokens ({n_prompt} {where[1]}, {limit} in the completion). "
                           f"Please reduce the length of {where[2]} or completion.",
                           param=where[0], code="context_length_exceeded", extra=extra)
        return limit

    def constraints(self, req, chat: bool):
        """(Constraint or None, ToolSpec or None, logit bias pairs) of a request, built by
        cpufuse.llama.guide as the library builds them; APIError(400) naming the field for a
        schema, grammar, tool list or bias llguidance or the checks reject."""
        from cpufuse.llama.guide import GuideError, build_guide
        tools = dict(tools=req.tools, tool_choice=req.tool_choice,
                     parallel_tool_calls=req.parallel_tool_calls) if chat else {}
        try:
            g = build_guide(self.engine.tokenizer, self.engine.n_vocab, chat_template=self.engine.chat_template,
                            logit_bias=req.logit_bias, chat=chat, **tools, **req.constraint_options())
        except GuideError as e:
            raise APIError(str(e), param=e.param) from None
        return g.constraint, g.spec, g.bias

    def engine_request(self, req, ids, chat: bool, constraint=None, bias=(), index: int = 0) -> EngineRequest:
        if not ids:
            raise APIError("the prompt is empty", param="messages" if chat else "prompt")
        max_tokens = self.context_check(len(ids), req.limit(), chat)
        d = self.defaults
        base = req.seed if req.seed is not None else d.seed
        seed = None if base is None else (int(base) + index) % (1 << 64)
        sp = SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repeat_penalty=d.repeat_penalty if req.repeat_penalty is None else req.repeat_penalty,
            logit_bias=bias)
        stop_ids = self.engine.eog_ids if (constraint is not None or not req.ignore_eos) else frozenset()
        return EngineRequest(prompt_ids=list(ids), max_tokens=max_tokens, sampling=sp,
                             logprobs=req.n_logprobs(), stop_ids=stop_ids, constraint=constraint)

    def submit(self, ereq: EngineRequest):
        try:
            return self.engine.submit(ereq, asyncio.get_running_loop())
        except EngineStopped as e:
            raise APIError(str(e), status=503, type="unavailable_error") from None
        except ValueError as e:        # engine.check_request: the prompt's token ids are checked there
            raise APIError(str(e), param=getattr(e, "param", None)) from None

    def check_queue(self, n: int) -> None:
        """503 + Retry-After when n more requests would make more than max_queue wait for a slot"""
        mq = self.limits.max_queue
        if mq is None:
            return
        s = self.engine.stats()
        waiting = max(0, s.queue_depth + s.active + n - _slots(self.engine))
        if waiting > mq:
            raise APIError(f"the server is busy: {s.queue_depth} request(s) wait for a slot and the queue holds "
                           f"{mq} (--max-queue); retry later", status=503, type="unavailable_error",
                           code="queue_full", headers={"Retry-After": "1"})

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request):
        """llama-server's states: loading (503), ok, busy (every slot taken; 503 with
        ?fail_on_no_slot=1), and 503 once the server stops or the model failed to load"""
        e = self.engine
        if e is None:
            if self.load_error is not None:
                return JSONResponse(error_body(f"the model failed to load: {self.load_error}", "unavailable_error",
                                               None, 503), status_code=503)
            return JSONResponse(error_body("Loading model", "unavailable_error", None, 503), status_code=503,
                                headers={"Retry-After": "5"})
        if self.draining or not e.running:
            return JSONResponse(error_body("the server is shutting down" if self.draining else
                                           "the engine is not running", "unavailable_error", None, 503),
                                status_code=503)
        s = e.stats()
        idle = max(0, _slots(e) - s.active)
        if idle == 0 or s.queue_depth:
            body = {"status": "busy", "slots_idle": idle, "slots_processing": s.active,
                    "requests_waiting": s.queue_depth}
            fail = request.query_params.get("fail_on_no_slot", "") not in ("", "0", "false")
            return JSONResponse(body, status_code=503 if fail else 200)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request):
        e = self.engine
        return JSONResponse({"object": "list", "data": [{
            "id": e.model_name, "object": "model", "created": self.created, "owned_by": "cpufuse",
            "root": getattr(e, "model_path", e.model_name), "parent": None, "max_model_len": e.n_ctx}]})

    async def chat(self, request: Request):
        req = await self.parse(request, ChatRequest)
        msgs = req.messages_for_template()
        tok = self.engine.tokenizer
        constraint, spec, bias = await run_in_threadpool(self.constraints, req, True)

        def render():
            extra = {}
            m = msgs
            if spec is not None:
                m, extra = spec.messages(msgs)
            text = chat_prompt(tok, m, add_generation_prompt=True, template=self.engine.chat_template, **extra)
            return tok.tokenize(text, add_bos=False, special=True)
        try:
            ids = await run_in_threadpool(render)
        except TemplateError as e:           # the template's raise_exception()
            raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
        except Exception as e:  # noqa: BLE001 -- a template that fails on these messages
            raise APIError(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           param="messages") from None
        ereqs = [self.engine_request(req, ids, True, constraint, bias, i) for i in range(req.n or 1)]
        return await self.respond(request, req, ereqs, chat=True, spec=spec)

    async def completions(self, request: Request):
        req = await self.parse(request, CompletionRequest)
        p = req.single_prompt()
        constraint, _, bias = await run_in_threadpool(self.constraints, req, False)
        if isinstance(p, str):
            ids = await run_in_threadpool(self.engine.tokenizer.tokenize, p, None, True)
        else:
            ids = list(p)
        ereqs = [self.engine_request(req, ids, False, constraint, bias, i) for i in range(req.n or 1)]
        return await self.respond(request, req, ereqs, chat=False)

    async def respond(self, request: Request, req, ereqs, chat: bool, spec=None):
        t0 = getattr(request.state, "cf_t0", None) or time.perf_counter()
        st = request.state.cf_log = {"t0": t0}
        log_user(st, req.user, getattr(req, "safety_identifier", None))
        if self.limits.timeout is not None:
            st["deadline"], st["timeout"] = t0 + self.limits.timeout, self.limits.timeout
        self.check_queue(len(ereqs))
        handles = []
        try:
            for e in ereqs:
                handles.append(self.submit(e))
        except APIError:
            for h in handles:
                h.cancel()
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.engine.model_name}
        want_lp = ereqs[0].logprobs is not None
        tools = spec if (spec is not None and spec.choice != "none") else None

        def cancel_all():
            for h in handles:
                h.cancel()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self.sse(handles, req.stop, head, chat, want_lp, include_usage, tools, st), cancel_all)
        return await self.collect(request, handles, req.stop, head, chat, want_lp, tools, st)

    # ------------------------------------------------------------------ llama-server's token routes
    async def tokenize(self, request: Request):
        obj = await self.json_object(request, ("content", "add_special", "parse_special", "with_pieces"))
        content = obj.get("content")
        if not isinstance(content, str):
            raise APIError(f"content must be a string, got {type(content).__name__}", param="content")
        flags = {}
        for k, d in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
            v = obj.get(k, d)
            if not isinstance(v, bool):
                raise APIError(f"{k} must be a boolean, got {v!r}", param=k)
            flags[k] = v
        tok = self.engine.tokenizer
        ids = await run_in_threadpool(tok.tokenize, content, None if flags["add_special"] else False,
                                      flags["parse_special"])
        if not flags["with_pieces"]:
            return JSONResponse({"tokens": ids})
        out = []
        for t in ids:
            b = tok.token_to_piece(int(t), special=True)
            try:
                piece = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    async def detokenize(self, request: Request):
        obj = await self.json_object(request, ("tokens",))
        ids = obj.get("tokens", [])
        n_vocab = self.engine.n_vocab
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError("tokens must be an array of token ids (integers)", param="tokens")
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {n_vocab})", param="tokens")
        text = await run_in_threadpool(self.engine.tokenizer.detokenize, ids, True)
        return JSONResponse({"content": text})

    async def json_object(self, request: Request, fields) -> dict:
        """the body, a JSON object whose keys are among `fields` (else a 400 naming the others)"""
        try:
            obj = json.loads(await request.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise APIError(f"the request body must be a JSON object, got {type(obj).__name__}")
        check_fields(obj, fields)
        return obj

    async def metrics(self, request: Request):
        return PlainTextResponse(self.counters.prometheus(self.engine),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(engine, drain: float = 0.0, sampling: Optional[SamplingParams] = None,
               limits: Optional[Limits] = None, embeddings=None, slot_save_path=None):
    """The ASGI app serving `engine`: an Engine, or a callable that makes one (the model then
    loads in a thread at startup while /health says "loading"). Lifespan: engine.start() at
    startup; at shutdown engine.stop(drain) (queued requests cancelled, running ones given `drain`
    seconds); cpufuse.serve.guard.drain is the graceful shutdown the CLI runs on SIGTERM/Ctrl-C.
    `sampling`: the values of the sampling fields a request leaves out (default: OpenAI's,
    SamplingParams()). `limits` (cpufuse.serve.guard.Limits): API keys, queue, body size and
    timeout. Every request is logged in one line to the logger "cpufuse.serve" (INFO; GET
    requests at DEBUG); a stream's line is written when the stream ends. embeddings: None or
    False (POST /v1/embeddings answers 501), True (served, pooled by the model's pooling_type), or a
    pooling name ("mean", "cls", "last", "none"): cpufuse.serve.embeddings (checked against the
    model when it is there: a ValueError here, or a load failure for a loader). slot_save_path: None
    (POST /slots/{id} answers 501) or a directory for llama-server's slot save / restore
    (cpufuse.serve.slots). The Starlette app is `app.app`; the server object `app.state.server`."""
    from . import embeddings as emb
    from .slots import slot_action
    if slot_save_path is not None and not os.path.isdir(slot_save_path):
        raise ValueError(f"slot_save_path must be an existing directory, got {slot_save_path!r}")
    srv = _Server(engine, drain, sampling, limits, None, slot_save_path)
    srv.embeddings_arg = embeddings
    if srv.engine is not None:
        _configure(srv, srv.engine)

    def endpoint(fn):
        async def wrapped(request: Request):
            t0 = request.state.cf_t0 = time.perf_counter()
            reason = None
            try:
                resp = await fn(request)
            except APIError as e:
                resp = _error_response(e)
                reason = e.message
            srv.counters.count(request.url.path, resp.status_code)
            st = getattr(request.state, "cf_log", None) or {"t0": t0}
            level = logging.DEBUG if request.method == "GET" else logging.INFO
            if isinstance(resp, SSEResponse):
                close = resp.on_close

                def on_close():
                    close()
                    if log.isEnabledFor(level):
                        log.log(level, log_line(request.method, request.url.path, 200, st, st.get("error")))
                resp.on_close = on_close
            elif log.isEnabledFor(level):
                log.log(level, log_line(request.method, request.url.path, resp.status_code, st, reason))
            return resp
        return wrapped

    async def not_found(request: Request, exc: HTTPException):
        srv.counters.count("other", exc.status_code)
        log.info(log_line(request.method, request.url.path, exc.status_code, {}, str(exc.detail)))
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind, None,
                                       exc.status_code), status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception):
        srv.counters.count(request.url.path, 500)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        loading = None
        if srv.engine is not None:
            srv.engine.start()
        else:
            loading = asyncio.ensure_future(run_in_threadpool(_load, srv))
        try:
            yield
        finally:
            if loading is not None and not loading.done():
                await asyncio.wait({loading})
            if srv.engine is not None:
                await run_in_threadpool(srv.engine.stop, drain)

    routes = [
        Route("/health", endpoint(srv.health), methods=["GET"]),
        Route("/v1/health", endpoint(srv.health), methods=["GET"]),
        Route("/v1/models", endpoint(srv.models), methods=["GET"]),
        Route("/models", endpoint(srv.models), methods=["GET"]),
        Route("/v1/chat/completions", endpoint(srv.chat), methods=["POST"]),
        Route("/v1/completions", endpoint(srv.completions), methods=["POST"]),
        Route("/metrics", endpoint(srv.metrics), methods=["GET"]),
        Route("/tokenize", endpoint(srv.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint(srv.detokenize), methods=["POST"]),
    ] + [Route(p, endpoint(lambda r, f=f: f(srv, r)), methods=["POST"])
         for p, f in (("/v1/embeddings", emb.embeddings), ("/embeddings", emb.embeddings),
                      ("/v1/rerank", emb.rerank), ("/rerank", emb.rerank), ("/v1/reranking", emb.rerank),
                      ("/slots/{id}", slot_action))]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: not_found, Exception: server_error})
    app.state.server = srv
    return _GuardedApp(app, srv)


class _GuardedApp(Guard):
    """the Starlette app behind the guard; `state` and `app` reach through"""

    def __init__(self, app, srv):
        super().__init__(app, srv, srv.limits)
        self.state = app.state


def _slots(engine) -> int:
    """the sequences an engine runs at once (a SerialEngine reports `parallel` but has one slot)"""
    slots = getattr(engine, "slots", None)
    return len(slots) if isinstance(slots, list) else int(engine.parallel)


def _configure(srv, engine) -> None:
    """what create_app checks against the model: the embeddings' pooling (ValueError)"""
    if srv.embeddings_arg is not None and srv.embeddings_arg is not False:
        from cpufuse.llama.embedding import pooling_name
        srv.pooling = pooling_name(None if srv.embeddings_arg is True else srv.embeddings_arg, engine.model)


def _load(srv) -> None:
    """the loader thread: make the engine, start it, publish it (or record why it failed)"""
    try:
        e = srv.loader()
        _configure(srv, e)
        e.start()
    except BaseException as e:  # noqa: BLE001 -- reported on /health, in the log and to the CLI
        srv.load_error = f"{type(e).__name__}: {e}"
        log.error(f"the model failed to load: {srv.load_error}")
        if srv.on_load_error is not None:
            srv.on_load_error(e)
        return
    srv.engine = e
