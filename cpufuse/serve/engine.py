"""The engine interface between the HTTP layer (`cpufuse.serve.app`) and the model. The engines
live in `cpufuse.serve.batch`: `BatchEngine` (continuous batching) and `SerialEngine` (one
request at a time: a BatchEngine on one slot, so there is one sample loop).

The contract every engine implements
====================================

Threads
    An engine owns its model on ONE engine thread, started by `start()` and joined by `stop()`.
    Nothing else touches the model. The HTTP layer calls only `submit()`, `stats()`,
    `Handle.cancel()` and the read-only attributes below; they are safe from any thread.

Read-only attributes
    `model_name` (str), `n_ctx` (the most tokens one sequence may hold: prompt + generated),
    `n_vocab`, `eog_ids` (frozenset: the model's end-of-generation ids), `tokenizer` (a
    `cpufuse.llama.tokenizer.Tokenizer`; stateless, shared by every thread), `parallel` (the most
    sequences run at once), `chat_template` (str or None).

`submit(request, loop=None) -> Handle`
    Thread-safe and non-blocking: it queues the request and wakes the engine thread. `request` is
    an `EngineRequest`: prompt token ids, max_tokens, `SamplingParams`, logprobs (None, or the number
    of top alternatives, 0 = the chosen token's only) and stop token ids. It raises `RequestError`
    (a `ValueError` whose `param` names the field) for a request no engine state can run (empty
    prompt, an id outside [0, n_vocab), max_tokens < 1, len(prompt) + max_tokens > n_ctx; with
    `context_shift`, len(prompt) >= n_ctx) and
    `EngineStopped` once `stop()` has begun. This is the one check of the prompt's token ids on
    the server's path (the HTTP layer relies on it; the model does not check again).
    A request that cannot run now waits in the queue: there is no capacity error.

Events
    A handle yields, in order, one `TokenEvent` per generated token (`token`, `logprob`,
    `top_logprobs`), then exactly one `FinishEvent` (`finish_reason`, `prompt_tokens`,
    `completion_tokens`, `cached_tokens`, `error`), then nothing. `Handle.cached_tokens` (the
    prompt tokens whose KV came from a cache) is set before the first TokenEvent is delivered, so
    a consumer that stops early (a stop string) still knows it. A sampled stop id ends the
    sequence with "stop" and is not delivered (nor counted). finish_reason is
      "stop"       a stop token id was sampled (or the request's grammar is complete);
      "length"     max_tokens tokens were generated (`detail` says when the context was full);
      "cancelled"  `Handle.cancel()` or `stop()` ended it;
      "error"      the engine failed on this request (`error` holds the message).
    `detail` (None or a few words for the request log) says more: "context full: n_ctx N" when
    "length" came at the end of the context, "N context shifts" when the sequence shifted.
    Text is not the engine's business: detokenization and stop STRINGS are done by the server on
    the token stream; it calls `Handle.cancel()` when a stop string matches.

Delivery to asyncio
    `submit(request, loop)` binds the handle to the consumer's event loop: the engine thread
    hands events over with `loop.call_soon_threadsafe` into an `asyncio.Queue` (never touching the
    queue itself), so the loop never blocks; consume with `async for ev in handle`. With
    `loop=None` events go to a thread-safe queue; consume with `for ev in handle` (blocking).
    `deliver()` hands many handles' events over with one wake-up per loop (a batching engine
    calls it once per step). No backpressure: events wait in the handle's queue (at most
    max_tokens + 1 of them).

Cancellation
    `Handle.cancel()` is thread-safe, idempotent and non-blocking. The engine checks it before a
    queued request starts and at every step boundary (each decode step, each prefill chunk), drops
    the sequence within one step, frees its resources (KV cells, slot) and delivers
    FinishEvent("cancelled"). After the finish event it is a no-op.

Sampling and determinism
    Each request has its own `cpufuse.llama.sampling.Sampler` (its own seeded RNG; see
    `make_sampler`): OpenAI's presence/frequency penalties over the generated tokens
    (penalty_scope="generated"), the request's repeat penalty over the last 64 tokens (prompt
    included; 1.0 = off), temperature <= 0 greedy. A request's tokens
    depend only on the request: never on what runs beside it or before it. `SerialEngine` gives
    exactly `Model.generate(prompt_ids, reuse_cache=False, sampler=make_sampler(params))`'s tokens.
    logprobs are taken from the raw model logits (log-softmax before penalties, filters and
    temperature; `token_logprobs`), as vLLM reports them by default, also under a constraint.

Context beyond the cache
    `context_shift` False (the default, as llama-server's): a sequence never holds more than n_ctx
    tokens (submit checks prompt + max_tokens). True: max_tokens may go past the context; a
    decoding sequence whose next token would not fit shifts its slot as llama.cpp's
    --context-shift does (`Model.shift_slot`: the first `n_keep` positions stay, half of the rest
    is dropped, the later K rows re-rotated) and goes on. Its tokens are those of
    `Model.generate(..., context_shift=True, n_keep=n_keep)` alone. The prompt must still be
    shorter than n_ctx.

Constraints and logit bias
    `EngineRequest.constraint` (a `cpufuse.llama.constrain.Constraint`) and
    `SamplingParams.logit_bias` make the sampler a `GuidedSampler`: the bias is added to the
    logits, then every token the grammar does not allow is set to -inf, before the sampler chain.
    Each sequence has its own matcher, fed only its own tokens, so the mask is batch-invariant. A
    constrained sequence finishes with "stop" as soon as its grammar is complete (only an
    end-of-generation id could follow; it is not sampled), and the server always passes the
    model's eog ids as stop ids with a constraint.

`stats() -> EngineStats`
    A snapshot of counters and gauges for /metrics, cheap and safe from any thread (it never
    waits for a step to end).

Lifespan
    `start()` starts the engine thread (the model is loaded before, by the constructor or its
    factory). `stop(drain=0.0)` is graceful: it stops admitting (`submit` raises EngineStopped),
    cancels every queued request, lets running sequences go on for up to `drain` seconds, cancels
    what is left, and joins the thread. Every handle gets its FinishEvent. The server calls it at
    lifespan shutdown, after uvicorn has waited (up to its graceful-shutdown timeout) for open
    requests to finish.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import queue
import threading
from typing import Iterable, List, Optional, Tuple, Union

import numpy as np

__all__ = ["SamplingParams", "EngineRequest", "TokenEvent", "FinishEvent", "EngineStats", "Handle",
           "Engine", "EngineStopped", "RequestError", "deliver", "make_sampler", "token_logprobs"]

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling (OpenAI defaults). temperature <= 0: greedy. top_k <= 0, top_p >= 1,
    min_p <= 0: that filter is off. seed None: a random seed."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0              # llama.cpp's, over the last 64 tokens (prompt included)
    logit_bias: Tuple[Tuple[int, float], ...] = ()   # (token id, bias) added to the logits


@dataclasses.dataclass
class EngineRequest:
    prompt_ids: List[int]
    max_tokens: int
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    logprobs: Optional[int] = None          # None: none; n >= 0: chosen token + n top alternatives
    stop_ids: frozenset = frozenset()        # sampled -> finish "stop" (usually the model's eog_ids)
    id: str = ""
    constraint: Optional[object] = None      # a cpufuse.llama.constrain.Constraint (a matcher per sequence)


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: Optional[float] = None
    top_logprobs: Optional[Tuple[Tuple[int, float], ...]] = None   # (id, logprob), descending


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    finish_reason: str                       # one of FINISH_REASONS
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0                   # prompt tokens whose KV came from a cache
    error: Optional[str] = None
    detail: Optional[str] = None             # for the request log: "context full: n_ctx N", "N context shifts"


Event = Union[TokenEvent, FinishEvent]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    requests_submitted: int = 0              # counters since start
    requests_finished: dict = dataclasses.field(default_factory=dict)   # finish_reason -> count
    prompt_tokens: int = 0                   # prompt tokens of the requests started
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0                    # speculative decoding: ids drafted, and those accepted
    draft_accepted: int = 0
    steps: int = 0                           # decode steps (one token for each running sequence)
    context_shifts: int = 0                  # context shifts (context_shift=True)
    queue_depth: int = 0                     # gauges: requests waiting
    active: int = 0                          # sequences running (prefill or decode)
    batch_size: int = 0                      # sequences in the last decode step
    parallel: int = 1                        # the most sequences at once


class EngineStopped(RuntimeError):
    """submit() after stop() began"""


class RequestError(ValueError):
    """submit(): a request no engine state can run; `param` names the request field at fault (the
    server's 400 reports it)"""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class Handle:
    """One request's event stream (see the module docstring). Created by `Engine.submit`."""

    def __init__(self, request: EngineRequest, loop: Optional[asyncio.AbstractEventLoop] = None,
                 on_cancel=None):
        self.request = request
        self.loop = loop
        self._cancel = threading.Event()
        self._on_cancel = on_cancel
        self._q = asyncio.Queue() if loop is not None else queue.SimpleQueue()
        self._done = False                   # consumer side: the FinishEvent was taken
        self.finished = False                # engine side: the FinishEvent was delivered
        self.cached_tokens = 0               # engine side: set before the first TokenEvent

    # ------------------------------------------------------------------ any thread
    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        if not self._cancel.is_set():
            self._cancel.set()
            if self._on_cancel is not None:
                self._on_cancel(self)

    # ------------------------------------------------------------------ engine side
    def put(self, *events: Event) -> None:
        """Deliver events (engine thread). A FinishEvent must be the last one ever put."""
        deliver((self, ev) for ev in events)

    # ------------------------------------------------------------------ consumer side
    def __iter__(self):
        if self.loop is not None:
            raise TypeError("this handle is bound to an event loop: use `async for`")
        while not self._done:
            ev = self._q.get()
            self._done = isinstance(ev, FinishEvent)
            yield ev

    def __aiter__(self):
        if self.loop is None:
            raise TypeError("this handle has no event loop (submit(request, loop)): use `for`")
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        ev = await self._q.get()
        self._done = isinstance(ev, FinishEvent)
        return ev


def deliver(items: Iterable[Tuple[Handle, Event]]) -> None:
    """Hand (handle, event) pairs to their consumers from the engine thread: one
    call_soon_threadsafe per event loop for the lot, in order. A handle whose loop is closed is
    cancelled (its consumer is gone)."""
    by_loop = collections.OrderedDict()
    for h, ev in items:
        if isinstance(ev, FinishEvent):
            h.finished = True
        if h.loop is None:
            h._q.put(ev)
        else:
            by_loop.setdefault(h.loop, []).append((h, ev))
    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_pairs, pairs)
        except RuntimeError:               # the loop is closed
            for h, _ in pairs:
                h._cancel.set()


def _put_pairs(pairs):
    for h, ev in pairs:
        h._q.put_nowait(ev)


def make_sampler(params: SamplingParams, constraint=None):
    """The request's Sampler: OpenAI penalties over the generated tokens; llama.cpp's repeat
    penalty (1.0: off) over the last 64 tokens, the prompt included (llama-cpp-python's window).
    With a logit bias or a constraint, a GuidedSampler around it (bias added, then the grammar's
    mask, with its own matcher)."""
    from cpufuse.llama.sampling import Sampler
    s = Sampler(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                min_p=params.min_p, repeat_penalty=params.repeat_penalty, penalty_last_n=64,
                frequency_penalty=params.frequency_penalty,
                presence_penalty=params.presence_penalty, seed=params.seed, penalty_scope="generated")
    if constraint is None and not params.logit_bias:
        return s
    from cpufuse.llama.constrain import GuidedSampler
    bias = ()
    if params.logit_bias:
        bias = (np.asarray([t for t, _ in params.logit_bias], np.int64),
                np.asarray([b for _, b in params.logit_bias], np.float32))
    return GuidedSampler(s, constraint, bias)


def token_logprobs(logits, token: int, n_top: int) -> Tuple[float, Tuple[Tuple[int, float], ...]]:
    """(logprob of `token`, the n_top most likely (id, logprob), descending, ties by id) from raw
    logits, in float64."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top = ()
    if n_top > 0:
        k = min(int(n_top), x.shape[0])
        from cpufuse.llama.sampling import top_ids
        idx = top_ids(x, k)
        top = tuple((int(i), float(x[i] - lse)) for i in idx)
    return float(x[int(token)] - lse), top


class Engine:
    """Base class: the shared state of every engine (attributes, admission checks, counters).
    Subclasses implement `_run()` (the engine thread's body) and may override `submit`."""

    def __init__(self, model_name: str, tokenizer, n_ctx: int, n_vocab: int, eog_ids=frozenset(),
                 parallel: int = 1, chat_template: Optional[str] = None):
        if int(parallel) < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel!r}")
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.n_ctx = int(n_ctx)
        self.n_vocab = int(n_vocab)
        self.eog_ids = frozenset(eog_ids)
        self.parallel = int(parallel)
        self.chat_template = chat_template
        self.context_shift, self.n_keep = False, 0   # a subclass that can shift sets them
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._ids = itertools.count(1)
        self._c = dict(requests_submitted=0, prompt_tokens=0, cached_prompt_tokens=0, generated_tokens=0,
                       draft_tokens=0, draft_accepted=0, steps=0, context_shifts=0, active=0, batch_size=0)
        self._finished = collections.Counter()

    # ------------------------------------------------------------------ lifespan
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=f"cpufuse-engine-{self.model_name}",
                                            daemon=True)
        self._thread.start()

    def stop(self, drain: float = 0.0) -> None:
        with self._lock:
            self._stopping = True
            waiting = list(self._queue)
            self._queue.clear()
            self._wake.notify_all()
        for h in waiting:
            self._finish(h, "cancelled", 0)
        t = self._thread
        if t is None:
            return
        if drain > 0:
            t.join(drain)
        self._cancel_running()
        t.join()

    def _cancel_running(self) -> None:
        """stop(): cancel the sequences still running (the subclass knows them)."""
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ admission
    def check_request(self, request: EngineRequest) -> None:
        """RequestError (a ValueError) for a request this engine can never run (the module
        docstring lists why). The one range check of the prompt's token ids on the server path:
        the engine thread and the model trust them."""
        ids = request.prompt_ids
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        bad = [t for t in ids if not (isinstance(t, (int, np.integer)) and 0 <= t < self.n_vocab)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.n_vocab})", "prompt")
        if int(request.max_tokens) < 1:
            raise RequestError(f"max_tokens must be >= 1, got {request.max_tokens}", "max_tokens")
        if self.context_shift:
            if len(ids) >= self.n_ctx:
                raise RequestError(f"the prompt ({len(ids)} tokens) does not fit the context ({self.n_ctx} "
                                   f"tokens): it must be shorter", "prompt")
        elif len(ids) + int(request.max_tokens) > self.n_ctx:
            raise RequestError(f"the prompt ({len(ids)} tokens) plus max_tokens ({request.max_tokens}) "
                               f"exceeds the context ({self.n_ctx} tokens)", "max_tokens")
        if request.logprobs is not None and not 0 <= int(request.logprobs) <= self.n_vocab:
            raise RequestError(f"logprobs must be in [0, {self.n_vocab}], got {request.logprobs}", "logprobs")

    def submit(self, request: EngineRequest, loop: Optional[asyncio.AbstractEventLoop] = None) -> Handle:
        self.check_request(request)
        if not request.id:
            request.id = f"req-{next(self._ids)}"
        h = Handle(request, loop, on_cancel=self._on_cancel)
        with self._lock:
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running")
            self._queue.append(h)
            self._c["requests_submitted"] += 1
            self._wake.notify()
        return h

    def _on_cancel(self, handle: Handle) -> None:
        """Handle.cancel(): a queued request is dropped at once (its slot in the queue freed)."""
        with self._lock:
            try:
                self._queue.remove(handle)
            except ValueError:
                return                     # running or finished: the engine thread sees the flag
        self._finish(handle, "cancelled", 0)

    # ------------------------------------------------------------------ accounting
    def _finish(self, h: Handle, reason: str, n_gen: int, cached: int = 0, error: Optional[str] = None,
                deliver_now: bool = True, detail: Optional[str] = None) -> FinishEvent:
        ev = FinishEvent(reason, len(h.request.prompt_ids), n_gen, cached, error, detail)
        with self._lock:
            self._finished[reason] += 1
        if deliver_now:
            h.put(ev)
        return ev

    def _count(self, **inc) -> None:
        with self._lock:
            for k, v in inc.items():
                self._c[k] += v

    def _set(self, **vals) -> None:
        with self._lock:
            self._c.update(vals)

    def stats(self) -> EngineStats:
        with self._lock:
            c = dict(self._c)
            return EngineStats(requests_finished=dict(self._finished), queue_depth=len(self._queue),
                               parallel=self.parallel, **c)

