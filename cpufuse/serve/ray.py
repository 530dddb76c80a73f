"""cpufuse.serve on Ray Serve: replicas of the OpenAI server, past one machine.

    pip install "cpufuse[ray]"
    serve run cpufuse.serve.ray:build_app model=/models/m.gguf num_replicas=2 num_cpus=8

`build_app(args)` is a Ray Serve application builder: `args` are the `key=value` pairs of `serve
run` (or a config file's `args:`), all strings or already typed. Two deployments:

- `CpufuseReplica`, `num_replicas` of them: each loads the model once and runs one engine
  (cpufuse.serve.batch.BatchEngine, `parallel` slots) with `num_cpus` threads, behind the very
  ASGI app of `python -m cpufuse serve` (cpufuse.serve.app.create_app): the same routes, keys,
  limits and replies. Ray reserves `num_cpus` CPUs for each replica.
- `CpufuseIngress`, the HTTP entry: it reads the request, takes the prompt text (the prompt, or
  the messages' text) and hands the request to a replica through a deployment handle, streaming
  the reply back as it comes.

Routing prefers the replica that already holds the request's prefix, so the replica's prompt
cache is hit. With `router=prefix` (the default) it is `PrefixRouter` below, a request router on
Ray Serve's documented extension point (`ray.serve.request_router.RequestRouter`); with
`router=ray-prefix` Ray Serve LLM's PrefixCacheAffinityRouter (it needs `ray[llm]`); with
`router=pow2` Ray's default (power of two choices, by queue length).

A request's tokens do not depend on the batch or on which replica runs it (cpufuse's batch
invariance), so the same request and seed give the same tokens from every replica: a retry or
a hedged request to another replica is safe. Each reply carries `X-Cpufuse-Replica` (the
replica's id). The ingress relies on it when a replica dies: a request the dead replica had
accepted is sent again while none of its reply has reached the client (CpufuseIngress).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import os
from typing import Any, Dict, List, Optional

from cpufuse._extras import require as _require

_require("ray", "cpufuse.serve.ray")

from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica  # noqa: E402

__all__ = ["build_app", "PrefixRouter", "Forwarded", "app_options", "CpufuseIngress", "CpufuseReplica"]

# build_app's arguments: name -> (type, default); `model` is required
OPTIONS = {
    "model": (str, None), "num_replicas": (int, 1), "num_cpus": (int, 1), "parallel": (int, 4),
    "n_ctx": (int, 2048), "kv": (str, "f16"), "alias": (str, None), "chunk": (int, 128),
    "api_key": (str, None), "max_queue": (int, None), "max_body": (int, 8 << 20), "timeout": (float, None),
    "router": (str, "prefix"), "max_ongoing_requests": (int, 64),
}
ROUTERS = {"prefix": "cpufuse.serve.ray.PrefixRouter",
           "ray-prefix": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
           "pow2": None}
BLOCK_CHARS = 64        # the prefix router's unit: prompts sharing k blocks of text share a prefix
MAX_BLOCKS = 256        # the longest prefix it tracks (16 K characters)


def app_options(args: Dict[str, Any]) -> Dict[str, Any]:
    """build_app's arguments parsed and checked: ValueError naming the argument for an unknown
    one, a value of the wrong type or out of range, or a missing model."""
    unknown = sorted(set(args) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; expected some of {', '.join(OPTIONS)}")
    out = {}
    for name, (typ, default) in OPTIONS.items():
        v = args.get(name, default)
        if v is not None and not isinstance(v, typ):
            try:
                v = typ(v)
            except (TypeError, ValueError):
                raise ValueError(f"{name} must be {typ.__name__}, got {args[name]!r}") from None
        out[name] = v
    if not out["model"]:
        raise ValueError("model is required: model=/path/to/model.gguf")
    for name in ("num_replicas", "num_cpus", "parallel", "n_ctx", "chunk", "max_body", "max_ongoing_requests"):
        if out[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {out[name]}")
    if out["router"] not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {out['router']!r}")
    if out["kv"] not in ("f16", "f32"):
        raise ValueError(f"kv must be f16 or f32, got {out['kv']!r}")
    return out


@dataclasses.dataclass
class Forwarded:
    """One HTTP request handed from the ingress to a replica. `prompt` is its prompt text (for
    the request routers: Ray's prefix router reads a `prompt` attribute too)."""
    method: str
    path: str
    query: str
    headers: List[tuple]
    body: bytes
    prompt: str = ""


def prompt_text(path: str, body: bytes) -> str:
    """the text a request's prefix is made of: a completion's prompt, or the messages' roles and
    contents in order ("" when there is none)"""
    if not path.endswith("completions"):
        return ""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return ""
    if not isinstance(obj, dict):
        return ""
    p = obj.get("prompt")
    if isinstance(p, str):
        return p
    msgs = obj.get("messages")
    if isinstance(msgs, list):
        parts = []
        for m in msgs:
            if isinstance(m, dict):
                c = m.get("content")
                if isinstance(c, list):
                    c = "".join(x.get("text", "") for x in c if isinstance(x, dict))
                parts.append(f"{m.get('role', '')}\n{c if isinstance(c, str) else ''}\n")
        return "".join(parts)
    return ""


def prefix_hashes(text: str) -> List[bytes]:
    """the hashes of text[:64], text[:128], ... (whole blocks only, MAX_BLOCKS at most)"""
    h = hashlib.blake2b(digest_size=16)
    out = []
    for i in range(min(len(text) // BLOCK_CHARS, MAX_BLOCKS)):
        h.update(text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        out.append(h.copy().digest())
    return out


class PrefixRouter(RequestRouter):
    """Prefix affinity on Ray Serve's request-router extension point: a request goes to the
    replica that last took the longest prefix it shares (in blocks of BLOCK_CHARS characters),
    unless that replica's queue is longer than the shortest by more than `imbalanced_threshold`;
    otherwise (and for a prompt shorter than one block) to the least loaded replica, taking turns
    among replicas that tie (Ray picks the first of equals, and its queue lengths lag a burst, so a
    burst would otherwise pile onto one replica). The map of prefixes is bounded (`max_entries`,
    least recently used out)."""

    def initialize_state(self, imbalanced_threshold: int = 4, max_entries: int = 1 << 16, **kwargs):
        self.imbalanced_threshold = int(imbalanced_threshold)
        self.max_entries = int(max_entries)
        self._owner: "collections.OrderedDict[bytes, ReplicaID]" = collections.OrderedDict()
        self._turn = 0

    @staticmethod
    def _prompt(pending_request: Optional[PendingRequest]) -> str:
        if pending_request is None:
            return ""
        for a in list(pending_request.args) + list(pending_request.kwargs.values()):
            p = getattr(a, "prompt", None)
            if isinstance(p, str):
                return p
        return ""

    def _queue(self, r: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(r.replica_id)
        return 0 if q is None else q

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        least = min(self._queue(r) for r in candidate_replicas)
        for h in reversed(prefix_hashes(self._prompt(pending_request))):
            rid = self._owner.get(h)
            r = by_id.get(rid) if rid is not None else None
            if r is not None and self._queue(r) - least <= self.imbalanced_threshold:
                return [[r], [x for x in candidate_replicas if x is not r]]
        ranked = sorted(candidate_replicas, key=lambda x: (self._queue(x), str(x.replica_id)))
        tied = [x for x in ranked if self._queue(x) == least]
        k = self._turn % len(tied)
        self._turn += 1
        return [tied[k:] + tied[:k], ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for h in prefix_hashes(self._prompt(pending_request)):
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        for h in [h for h, r in self._owner.items() if r == replica_id]:
            del self._owner[h]


async def asgi_forward(app, fwd: Forwarded, extra_headers=()):
    """Run one request through an ASGI app in this process: yields {"status", "headers"} first,
    then the body's chunks (bytes). Closing the generator early (the client went) is the app's
    http.disconnect, so the engine request is cancelled."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": fwd.method, "scheme": "http", "path": fwd.path, "raw_path": fwd.path.encode(),
             "query_string": fwd.query.encode(), "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("cpufuse", 0),
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in fwd.headers]}
    q: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": fwd.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        q.put_nowait(msg)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            q.put_nowait(None)
    task = asyncio.ensure_future(run())
    try:
        while True:
            msg = await q.get()
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                hs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", ())
                      if k.lower() != b"content-length"]
                yield {"status": msg["status"], "headers": hs + list(extra_headers)}
            elif msg["type"] == "http.response.body" and msg.get("body"):
                yield bytes(msg["body"])
        await task
    finally:
        gone.set()
        if not task.done():
            await asyncio.wait({task}, timeout=10)


class CpufuseReplica:
    """One engine behind the OpenAI app (see the module docstring)."""

    def __init__(self, opts: Dict[str, Any]):
        from .app import create_app
        from .batch import BatchEngine
        from .guard import Limits
        engine = BatchEngine.load(opts["model"], n_ctx=opts["n_ctx"], n_threads=opts["num_cpus"],
                                  kv_dtype=opts["kv"], model_name=opts["alias"], parallel=opts["parallel"],
                                  chunk=opts["chunk"])
        engine.start()
        self.engine = engine
        self.app = create_app(engine, limits=Limits(
            api_keys=(opts["api_key"],) if opts["api_key"] else (), max_queue=opts["max_queue"],
            max_body=opts["max_body"], timeout=opts["timeout"]))
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 -- outside a Ray Serve replica (a direct construction)
            self.replica_id = f"local-{os.getpid()}"

    async def forward(self, fwd: Forwarded):
        async for item in asgi_forward(self.app, fwd, [("x-cpufuse-replica", self.replica_id)]):
            yield item

    def __del__(self):
        e = getattr(self, "engine", None)
        if e is not None:
            e.stop(0.0)


class CpufuseIngress:
    """The HTTP entry: every path and method goes to a replica (see the module docstring).

    A replica that dies: Ray Serve's router retries a request it has not yet handed to a replica
    (a replica found dead while it reserves a slot leaves the router's set and the request goes
    to another), but a request a replica has accepted dies with it (actor calls are at most
    once). The ingress sends such a request again, to another replica, while nothing of its reply
    has reached the client (a whole reply is sent at its end; a stream's headers wait for its
    first chunk): the same request and seed give the same tokens on every replica, so the client
    sees one answer. At most `RETRIES` times, then a 503. A stream whose replica dies after its
    first chunk ends with an SSE error event and `[DONE]`. A retried reply carries
    `X-Cpufuse-Retries`."""

    RETRIES = 3

    def __init__(self, replica, max_body: int):
        self.replica = replica.options(stream=True)
        self.max_body = max_body

    async def _start(self, fwd: Forwarded):
        """(the reply's generator, its head, its first chunk or None, retries) from a replica
        that stays alive until the first chunk"""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import ReplicaUnavailableError
        for attempt in range(self.RETRIES + 1):
            gen = self.replica.forward.remote(fwd)
            try:
                head = await gen.__anext__()
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    first = None
                return gen, head, first, attempt
            except (RayActorError, ReplicaUnavailableError) as e:
                gone = e
                gen.cancel()
        raise _ReplicaGone(f"the replicas that took this request died ({self.RETRIES + 1} tries): "
                           f"{type(gone).__name__}")

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        from .protocol import error_body
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return JSONResponse(error_body(f"the request body is more than the server's limit of "
                                               f"{self.max_body} bytes", "invalid_request_error", None,
                                               "request_too_large"), status_code=413)
        path = request.url.path
        fwd = Forwarded(request.method, path, request.url.query, list(request.headers.items()), body,
                        prompt_text(path, body))
        try:
            gen, head, first, retries = await self._start(fwd)
        except _ReplicaGone as e:
            return JSONResponse(error_body(str(e), "unavailable_error", None, "replica_died"), status_code=503,
                                headers={"Retry-After": "1"})
        headers = dict(head["headers"])
        if retries:
            headers["x-cpufuse-retries"] = str(retries)
        sse = headers.get("content-type", "").startswith("text/event-stream")

        async def rest():
            from ray.exceptions import RayActorError
            try:
                if first is not None:
                    yield first
                async for chunk in gen:
                    yield chunk
            except RayActorError as e:             # the replica died mid-stream: end it with the reason
                if sse:
                    err = error_body(f"the replica serving this stream died: {type(e).__name__}", "server_error",
                                     None, "replica_died")
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                gen.cancel()
        return StreamingResponse(rest(), status_code=head["status"], headers=headers)


class _ReplicaGone(Exception):
    pass


def build_app(args: Dict[str, Any]):
    """The Ray Serve application (`serve run cpufuse.serve.ray:build_app model=... num_replicas=2`):
    see the module docstring. ValueError for a bad argument."""
    opts = app_options(args)
    router = ROUTERS[opts["router"]]
    rkw = {}
    if router is not None:
        rkw["request_router_config"] = RequestRouterConfig(request_router_class=router)
    replica = serve.deployment(CpufuseReplica, name="CpufuseReplica", num_replicas=opts["num_replicas"],
                               max_ongoing_requests=opts["max_ongoing_requests"],
                               ray_actor_options={"num_cpus": opts["num_cpus"]}, **rkw)
    ingress = serve.deployment(CpufuseIngress, name="CpufuseIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=max(opts["max_ongoing_requests"] * opts["num_replicas"], 100))
    return ingress.bind(replica.bind(opts), opts["max_body"])
