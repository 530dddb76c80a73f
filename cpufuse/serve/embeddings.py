"""POST /v1/embeddings (OpenAI's shape; also /embeddings) and the refusal of /v1/rerank.

Served when the app is made with `embeddings=` a pooling name (python -m cpufuse serve
--embeddings [--pooling mean|cls|last]); without it the route answers 501, as llama-server does
without --embeddings. Each input runs in the engine (BatchEngine.embed): on its thread, in a free
KV slot, between the generation steps, one input after another (not in the same decoder call as
other requests). Vectors are L2-normalized, as llama-server's /v1/embeddings. Pooling "none" is
refused (400), as llama-server refuses it on its OpenAI-compatible route.

Request (any other field is a 400): input (a string, an array of strings, an array of token ids, or an array of such arrays;
nothing empty), encoding_format ("float", or "base64": the float32 little-endian bytes),
dimensions (only n_embd: there is no truncation), model (not checked), user (logged). Strings are tokenized with the model's special
tokens (BOS/EOS as its file says) and special-token text parsed, as llama-server does.
"""
from __future__ import annotations

import asyncio
import base64

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from .engine import EngineStopped
from .metrics import log_user
from .protocol import APIError

__all__ = ["embeddings", "rerank"]


def _log_state(request: Request) -> dict:
    st = getattr(request.state, "cf_log", None)
    if st is None:
        st = request.state.cf_log = {"t0": request.state.cf_t0}
    return st


def _inputs(obj, n_vocab):
    """the request's inputs: a list of str or of token-id lists (checked)"""
    x = obj.get("input")
    if isinstance(x, str):
        x = [x]
    elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        x = [x]
    if not isinstance(x, list) or not x:
        raise APIError("input must be a non-empty string, an array of strings, an array of token ids or an "
                       "array of such arrays", param="input")
    for i, v in enumerate(x):
        if isinstance(v, str):
            ok = bool(v)
        else:
            ok = isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
            if ok and not all(0 <= t < n_vocab for t in v):
                bad = next(t for t in v if not 0 <= t < n_vocab)
                raise APIError(f"input[{i}]: token id {bad} is outside the vocabulary [0, {n_vocab})", param="input")
        if not ok:
            raise APIError(f"input[{i}] must be a non-empty string or a non-empty array of token ids", param="input")
    return x


async def embeddings(srv, request: Request):
    engine, pooling = srv.engine, srv.pooling
    if pooling is None:
        raise APIError("this server does not serve embeddings: start it with --embeddings", status=501,
                       type="not_supported_error")
    obj = await srv.json_object(request, ("input", "model", "encoding_format", "dimensions", "user"))
    user = obj.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(f"user must be a string, got {type(user).__name__}", param="user")
    log_user(_log_state(request), user)
    if pooling == "none":
        raise APIError("pooling 'none' is not OpenAI-compatible (one vector per token): start the server with "
                       "--pooling mean, cls or last")
    fmt = obj.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise APIError(f"encoding_format must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    n_embd = engine.model.hparams.n_embd
    dims = obj.get("dimensions")
    if dims is not None and dims != n_embd:
        raise APIError(f"dimensions: this model's embeddings have {n_embd} dimensions, got {dims!r}",
                       param="dimensions")
    inputs = _inputs(obj, engine.n_vocab)
    tok = engine.tokenizer
    ids = [await run_in_threadpool(tok.tokenize, v, None, True) if isinstance(v, str) else v for v in inputs]
    for i, t in enumerate(ids):
        if not t:
            raise APIError(f"input[{i}] has no tokens", param="input")
        if len(t) > engine.n_ctx:
            raise APIError(f"input[{i}] has {len(t)} tokens, more than the context of {engine.n_ctx}",
                           param="input", code="context_length_exceeded")
    try:
        futs = [engine.embed(t, pooling, 2) for t in ids]
    except EngineStopped as e:
        raise APIError(str(e), status=503, type="unavailable_error") from None
    vecs = [await asyncio.wrap_future(f) for f in futs]
    data = [{"object": "embedding", "index": i,
             "embedding": (base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii") if fmt == "base64"
                           else np.asarray(v, np.float32).tolist())} for i, v in enumerate(vecs)]
    n = sum(len(t) for t in ids)
    return JSONResponse({"object": "list", "data": data, "model": engine.model_name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


async def rerank(srv, request: Request):
    raise APIError("reranking needs a model with a classification head (pooling 'rank'); cpufuse runs decoder "
                   "models without one", status=501, type="not_supported_error")
