"""llama-server's slot save / restore: POST /slots/{id}?action=save|restore|erase (cpufuse.llama.state).

Served when the app is made with `slot_save_path=` a directory (python -m cpufuse serve
--slot-save-path DIR); without it the route answers 501, as llama-server does. The body names a
file in that directory: {"filename": "name.bin"} (a plain name: no path separator, not "." or
"..", at most 255 bytes). The action runs on the engine thread between steps, on a slot that runs
no request (else 400):
- save: the slot's evaluated tokens and their KV cells -> {"id_slot", "filename", "n_saved",
  "n_written", "timings": {"save_ms"}};
- restore: the file, checked against the model (its identity, layout and bounds: a bad file is a
  400 naming what is wrong) -> {"id_slot", "filename", "n_restored", "n_read", "timings":
  {"restore_ms"}}. The slot then holds those tokens, and a request whose prompt starts with them
  reuses their whole chunks (the prompt cache; with the same --chunk as the server that saved
  them, the tokens are those of evaluating the prompt);
- erase: the slot forgets its tokens -> {"id_slot", "n_erased"}.
"""
from __future__ import annotations

import asyncio
import os
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from .engine import EngineStopped
from .protocol import APIError, check_fields

__all__ = ["slot_action"]


def _filename(obj):
    f = obj.get("filename")
    if not isinstance(f, str) or not f or f in (".", "..") or "/" in f or "\\" in f or "\0" in f \
            or len(f.encode("utf-8")) > 255:
        raise APIError(f"filename must be a plain file name (no path separator, not '.' or '..'), got {f!r}",
                       param="filename")
    return f


async def slot_action(srv, request: Request):
    if srv.slot_save_path is None:
        raise APIError("this server does not support slot actions: start it with --slot-save-path", status=501,
                       type="not_supported_error")
    action = request.query_params.get("action")
    if action not in ("save", "restore", "erase"):
        raise APIError(f"action must be save, restore or erase, got {action!r}", param="action")
    try:
        index = int(request.path_params["id"])
    except ValueError:
        raise APIError(f"the slot id must be an integer, got {request.path_params['id']!r}", param="id_slot") from None
    # erase takes no body; save and restore a {"filename"} object
    obj = await srv.json_object(request, ("filename",)) if (action != "erase" or await request.body()) else {}
    if action == "erase":
        check_fields(obj, ())
    name = _filename(obj) if action != "erase" else None
    path = os.path.join(srv.slot_save_path, name) if name else None
    t0 = time.perf_counter()
    try:
        fut = srv.engine.slot_action(index, action, path)
        out = await asyncio.wrap_future(fut)
    except EngineStopped as e:
        raise APIError(str(e), status=503, type="unavailable_error") from None
    except FileNotFoundError:
        raise APIError(f"no saved slot file {name!r}", status=404, type="not_found_error", param="filename") from None
    except ValueError as e:
        raise APIError(str(e), param="filename" if action == "restore" else "id_slot") from None
    ms = (time.perf_counter() - t0) * 1e3
    res = {"id_slot": index}
    if name:
        res["filename"] = name
    res.update(out)
    if action != "erase":
        res["timings"] = {f"{action}_ms": ms}
    return JSONResponse(res)
