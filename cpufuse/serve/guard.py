"""The server's gate: what is checked before a request reaches a route, and the server's states.

`Guard` is an ASGI middleware around the Starlette app (cpufuse.serve.app.create_app puts it there):
- API keys (`Limits.api_keys`): a request without `Authorization: Bearer KEY` gets 401 with
  OpenAI's error body (code "invalid_api_key"). /health and /v1/health stay open, and /metrics
  too unless `protect_metrics`.
- The body: one over `max_body` bytes gets 413 (by its Content-Length at once, else while it is
  read); the body is read here and handed to the route whole.
- The state: while the model loads, every route but /health answers 503 "Loading model" with
  Retry-After; once shutdown has begun (`drain`), 503 "the server is shutting down".
- It counts the requests open (`Server.open`), which `drain` waits for.

The queue bound (`max_queue`, 503 + Retry-After) and the request timeout are checked where the
request is submitted and where its tokens are read (cpufuse.serve.app, cpufuse.serve.responses).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from typing import Optional, Tuple

from starlette.responses import JSONResponse

from .metrics import log_line
from .protocol import error_body

__all__ = ["Guard", "Limits", "drain", "DEFAULT_MAX_BODY"]

DEFAULT_MAX_BODY = 8 << 20
OPEN_PATHS = ("/health", "/v1/health")
log = logging.getLogger("cpufuse.serve")


@dataclasses.dataclass(frozen=True)
class Limits:
    """api_keys: the accepted keys (empty: no key needed); protect_metrics: /metrics needs a key
    too; max_queue: the most requests waiting for a slot (None: no bound); max_body: bytes;
    timeout: seconds a request may take from its arrival to its last token (None: no limit)."""
    api_keys: Tuple[str, ...] = ()
    protect_metrics: bool = False
    max_queue: Optional[int] = None
    max_body: int = DEFAULT_MAX_BODY
    timeout: Optional[float] = None

    def __post_init__(self):
        if isinstance(self.api_keys, str):
            object.__setattr__(self, "api_keys", (self.api_keys,))
        keys = tuple(self.api_keys)
        if any(not isinstance(k, str) or not k or k != k.strip() for k in keys):
            raise ValueError(f"api_keys must be non-empty strings without surrounding spaces, got {keys!r}")
        object.__setattr__(self, "api_keys", keys)
        if self.max_queue is not None and int(self.max_queue) < 0:
            raise ValueError(f"max_queue must be >= 0 or None, got {self.max_queue!r}")
        if int(self.max_body) < 1:
            raise ValueError(f"max_body must be >= 1 byte, got {self.max_body!r}")
        if self.timeout is not None and not float(self.timeout) > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {self.timeout!r}")


def _header(scope, name: bytes) -> Optional[bytes]:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class Guard:
    """ASGI middleware: keys, body size, loading/shutdown state, open-request count (see the module
    docstring). `srv` is the app's server object (cpufuse.serve.app): engine (None while loading),
    load_error, draining, open, counters."""

    def __init__(self, app, srv, limits: Limits):
        self.app, self.srv, self.limits = app, srv, limits
        self._keys = [k.encode() for k in limits.api_keys]

    async def reject(self, scope, receive, send, status, message, type_, code=None, headers=None):
        path = scope.get("path", "")
        self.srv.counters.count(path, status)
        log.info(log_line(scope.get("method", ""), path, status, {}, message))
        await JSONResponse(error_body(message, type_, None, code), status_code=status,
                           headers=headers)(scope, receive, send)

    def authorized(self, scope) -> bool:
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        ok = False
        for k in self._keys:                 # every key compared, in constant time
            ok |= hmac.compare_digest(token, k)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv, lim, path = self.srv, self.limits, scope["path"]
        open_path = path in OPEN_PATHS or (path == "/metrics" and not lim.protect_metrics)
        if self._keys and not open_path and not self.authorized(scope):
            had = _header(scope, b"authorization") is not None
            msg = ("Incorrect API key provided." if had else
                   "You didn't provide an API key. Send it in the Authorization header as Bearer auth "
                   "(Authorization: Bearer YOUR_KEY).")
            return await self.reject(scope, receive, send, 401, msg, "invalid_request_error", "invalid_api_key",
                                     {"WWW-Authenticate": "Bearer"})
        if path not in OPEN_PATHS:
            if srv.draining:
                return await self.reject(scope, receive, send, 503, "the server is shutting down",
                                         "unavailable_error")
            if srv.engine is None:
                msg = "Loading model" if srv.load_error is None else f"the model failed to load: {srv.load_error}"
                return await self.reject(scope, receive, send, 503, msg, "unavailable_error", None,
                                         {"Retry-After": "5"} if srv.load_error is None else None)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, status = await self.read_body(scope, receive)
            if status is not None:
                n = "more than" if body is None else f"{len(body)} bytes,"
                return await self.reject(scope, receive, send, 413,
                                         f"the request body is {n} the server's limit of {lim.max_body} "
                                         f"bytes (--max-body)", "invalid_request_error", "request_too_large")
            receive = _replay(body, receive)
        srv.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            srv.open -= 1

    async def read_body(self, scope, receive):
        """(body, None), or (None or the part read, 413) over max_body"""
        lim = self.limits.max_body
        cl = _header(scope, b"content-length")
        if cl is not None and cl.strip().isdigit() and int(cl) > lim:
            return None, 413
        parts, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > lim:
                return None, 413
            parts.append(chunk)
            if not msg.get("more_body", False):
                break
        return b"".join(parts), None


def _replay(body: bytes, receive):
    """an ASGI receive that gives `body` once, then the original's messages (the disconnect)"""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again


async def drain(srv, grace: float, settle: float = 5.0) -> None:
    """Graceful shutdown: new requests get 503 from now; the open ones get up to `grace` seconds;
    then the engine stops, which ends each one left with its reason (a stream: a last SSE error
    event and [DONE]; a whole reply: 503), and this returns once they are answered (at most
    `settle` seconds more)."""
    from starlette.concurrency import run_in_threadpool
    srv.draining = True
    t_end = time.monotonic() + max(0.0, grace)
    while srv.open and time.monotonic() < t_end:
        await asyncio.sleep(0.05)
    if srv.open:
        log.warning(f"shutdown: {srv.open} request(s) still open after {grace:g} s: ending them")
    if srv.engine is not None:
        await run_in_threadpool(srv.engine.stop, 0.0)
    t_end = time.monotonic() + settle
    while srv.open and time.monotonic() < t_end:
        await asyncio.sleep(0.02)
