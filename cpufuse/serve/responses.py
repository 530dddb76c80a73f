"""OpenAI's response shapes on the engine's token stream: the token loop (text, stop strings,
finish reasons), logprobs, server-sent events (`SSEResponse`, `Responses.sse`) and whole replies
(`Responses.collect`), chat and text completions, n choices merged, tool calls. A mixin of the
server (cpufuse.serve.app) that needs `self.engine`.
"""
from __future__ import annotations

import asyncio
import json
import time

import anyio
from starlette.responses import JSONResponse, Response

from .engine import FinishEvent
from .protocol import APIError, error_body
from .text import TextAssembler

__all__ = ["Responses", "SSEResponse", "SSE_HEADERS", "add_usage", "fingerprint", "until_disconnect"]

SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}

def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))



async def until_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return



def _retrieve(task):
    """a done callback: takes a finished task's exception, so asyncio does not log it as never retrieved"""
    if not task.cancelled():
        task.exception()

class SSEResponse(Response):
    """Server-sent events from an async iterator of str, racing the client's disconnect: when the
    client goes, the iterator is cancelled (its finally cancels the engine request) and
    `on_close` runs. Independent of Starlette's own StreamingResponse disconnect handling, which
    changed with the ASGI spec version."""

    media_type = "text/event-stream"

    def __init__(self, events, on_close):   # no body: no content-length header
        self.status_code, self.background = 200, None
        self.init_headers(SSE_HEADERS)
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    tg.cancel_scope.cancel()

                async def watch():
                    await until_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            self.on_close()



async def _deadline(handle, st):
    """the handle's events until st["deadline"] (perf_counter seconds, if set): past it, APIError
    504 naming the --timeout (the caller's finally cancels the request in the engine)"""
    deadline = st.get("deadline")
    if deadline is None:
        async for ev in handle:
            yield ev
        return
    while True:
        left = deadline - time.perf_counter()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            ev = await asyncio.wait_for(handle.__anext__(), left)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise APIError(f"the request took longer than the server's timeout of {st['timeout']:g} s "
                           f"(--timeout) and was ended", status=504, type="timeout_error",
                           code="timeout") from None
        yield ev


class Responses:
    """the token loop and the response shapes (a mixin: needs self.engine)"""

    # ------------------------------------------------------------------ the token loop
    async def run(self, handle, stops, special: bool = False, st=None):
        """Yields ("text", text, released) pieces, then ("end", finish_reason, usage). `st` (a dict)
        gets the request's numbers for its log line."""
        asm = TextAssembler(self.engine.tokenizer, stops, special=special)
        n_tokens = 0
        st = {} if st is None else st
        try:
            async for ev in _deadline(handle, st):
                if "t_first" not in st:
                    st["t_first"] = time.perf_counter()
                if isinstance(ev, FinishEvent):
                    if ev.finish_reason == "error":
                        raise APIError(f"the engine failed: {ev.error}", status=500, type="server_error")
                    if ev.finish_reason == "cancelled":
                        raise APIError("the request was cancelled: the server is shutting down", status=503,
                                       type="unavailable_error")
                    text, rel = asm.finish()
                    if text or rel:
                        yield ("text", text, rel)
                    st.update(finish=ev.finish_reason, finish_detail=ev.detail,
                              usage=self.usage(ev.prompt_tokens, n_tokens, ev.cached_tokens))
                    yield ("end", ev.finish_reason, st["usage"])
                    return
                n_tokens += 1
                text, rel, stopped = asm.push(ev)
                if text or rel:
                    yield ("text", text, rel)
                if stopped:
                    handle.cancel()
                    st.update(finish="stop", usage=self.usage(len(handle.request.prompt_ids), n_tokens,
                                                              handle.cached_tokens))
                    yield ("end", "stop", st["usage"])
                    return
        finally:
            handle.cancel()                  # no-op once finished; a disconnect or an error cancels

    @staticmethod
    def usage(p: int, c: int, cached: int) -> dict:
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ------------------------------------------------------------------ logprobs
    def _piece(self, tok: int):
        b = self.engine.tokenizer.token_to_piece(int(tok), special=True)
        return b.decode("utf-8", errors="replace"), list(b)

    def chat_logprobs(self, released) -> list:
        out = []
        for _, ev in released:
            s, b = self._piece(ev.token)
            top = []
            for t, lp in ev.top_logprobs or ():
                ts, tb = self._piece(t)
                top.append({"token": ts, "logprob": lp, "bytes": tb})
            out.append({"token": s, "logprob": ev.logprob, "bytes": b, "top_logprobs": top})
        return out

    def completion_logprobs(self, released) -> dict:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for start, ev in released:
            lp["tokens"].append(self._piece(ev.token)[0])
            lp["token_logprobs"].append(ev.logprob)
            lp["top_logprobs"].append({self._piece(t)[0]: v for t, v in ev.top_logprobs or ()})
            lp["text_offset"].append(start)
        return lp


    async def merged(self, handles, stops, special, st=None):
        """(index, item) from every choice's run(), as they come; ("end", ...) last per choice"""
        if len(handles) == 1:
            async for item in self.run(handles[0], stops, special, st):
                yield 0, item
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, h):
            try:
                async for item in self.run(h, stops, special, st):
                    q.put_nowait((i, item))
            except BaseException as e:  # noqa: BLE001 -- handed to the consumer
                q.put_nowait((i, ("error", e, None)))
        tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        try:
            left = len(handles)
            while left:
                i, item = await q.get()
                if item[0] == "error":
                    raise item[1]
                if item[0] == "end":
                    left -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for h in handles:
                h.cancel()

    @staticmethod
    def tool_deltas(calls) -> list:
        """OpenAI's streamed tool_calls: per call a header (id, name, empty arguments), then the arguments"""
        out = []
        for k, c in enumerate(calls):
            out.append([{"index": k, "id": c["id"], "type": "function",
                         "function": {"name": c["function"]["name"], "arguments": ""}}])
            out.append([{"index": k, "function": {"arguments": c["function"]["arguments"]}}])
        return out

    async def sse(self, handles, stops, head, chat, want_lp, include_usage, tools=None, st=None):
        from cpufuse.llama.tools import ToolStream

        def event(choice=None, usage=None, index=0):
            d = dict(head)
            d["choices"] = [] if choice is None else [dict(index=index, **choice)]
            if usage is not None:
                d["usage"] = usage
            return f"data: {_json(d)}\n\n"
        n = len(handles)
        streams = [ToolStream(tools) for _ in range(n)] if tools is not None else None
        if chat:
            for i in range(n):
                yield event({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
                            index=i)
        total = None
        try:
            async for i, (kind, a, b) in self.merged(handles, stops, tools is not None, st):
                if kind == "text":
                    if chat:
                        if streams is not None:
                            a = streams[i].push(a)
                        lp = {"content": self.chat_logprobs(b), "refusal": None} if want_lp else None
                        if a or (lp and b):
                            yield event({"delta": {"content": a}, "logprobs": lp, "finish_reason": None}, index=i)
                    else:
                        lp = self.completion_logprobs(b) if want_lp else None
                        yield event({"text": a, "logprobs": lp, "finish_reason": None}, index=i)
                else:
                    reason = a
                    if streams is not None:
                        rest, calls = streams[i].finish()
                        if rest:
                            yield event({"delta": {"content": rest}, "logprobs": None, "finish_reason": None}, index=i)
                        if calls:
                            for d in self.tool_deltas(calls):
                                yield event({"delta": {"tool_calls": d}, "logprobs": None, "finish_reason": None},
                                            index=i)
                            reason = "tool_calls"
                    body = {"delta": {}} if chat else {"text": ""}
                    yield event(dict(body, logprobs=None, finish_reason=reason), index=i)
                    total = b if total is None else add_usage(total, b)
            if include_usage and total is not None:
                yield event(None, total)
        except APIError as e:
            if st is not None:
                st["error"] = e.message
            yield f"data: {_json(e.body())}\n\n"
        except Exception as e:  # noqa: BLE001 -- the stream has started: report it in the stream
            if st is not None:
                st["error"] = f"internal error: {type(e).__name__}: {e}"
            yield f"data: {_json(error_body(f'internal error: {type(e).__name__}: {e}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    async def collect(self, request, handles, stops, head, chat, want_lp, tools=None, st=None):
        n = len(handles)
        parts = [[] for _ in range(n)]
        released = [[] for _ in range(n)]
        end = [None] * n

        async def consume():
            async for i, (kind, a, b) in self.merged(handles, stops, tools is not None, st):
                if kind == "text":
                    parts[i].append(a)
                    released[i].extend(b)
                else:
                    end[i] = (a, b)

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():              # the client went away (or the server stops): cancel it
                work.cancel()
                work.add_done_callback(_retrieve)   # it may still end with its APIError: nobody reads it
                for h in handles:
                    h.cancel()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody reads it
        work.result()                        # re-raises an APIError
        choices, usage = [], None
        for i in range(n):
            text = "".join(parts[i])
            reason, u = end[i]
            usage = u if usage is None else add_usage(usage, u)
            if chat:
                lp = {"content": self.chat_logprobs(released[i]), "refusal": None} if want_lp else None
                msg = {"role": "assistant", "content": text}
                if tools is not None:
                    content, calls = tools.parse(text)
                    if calls:
                        msg = {"role": "assistant", "content": content, "tool_calls": calls}
                        reason = "tool_calls"
                    else:                    # generic format: the "response" of the JSON reply
                        msg = {"role": "assistant", "content": content}
                choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": reason})
            else:
                lp = self.completion_logprobs(released[i]) if want_lp else None
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse(dict(head, object=obj, choices=choices, usage=usage,
                                 systemfingerprint=fingerprint()))



def add_usage(a: dict, b: dict) -> dict:
    """the usage of n choices: the prompt once, the completions summed"""
    c = a["completion_tokens"] + b["completion_tokens"]
    return dict(a, completion_tokens=c, total_tokens=a["prompt_tokens"] + c)


def fingerprint() -> str:
    import cpufuse
    return f"cpufuse-{cpufuse.__version__}"

