"""An OpenAI-compatible HTTP server for cpufuse.llama models (`python -m cpufuse serve`).

    from cpufuse.serve import SerialEngine, create_app
    app = create_app(SerialEngine.load("model.gguf", n_ctx=2048))   # an ASGI app for uvicorn

`engine.py` specifies the engine interface (the HTTP layer never calls the model), `app.py` the
endpoints, `text.py` stop strings and logprobs on the token stream, `protocol.py` the request
models, `cli.py` the command. Needs the serve extra: pip install cpufuse[serve].
"""
from cpufuse._extras import require as _require

_require("serve", "cpufuse.serve")

from .batch import SerialEngine  # noqa: E402
from .engine import (Engine, EngineRequest, EngineStats, EngineStopped, FinishEvent, Handle,  # noqa: E402
                     SamplingParams, TokenEvent)

__all__ = ["Engine", "EngineRequest", "EngineStats", "EngineStopped", "FinishEvent", "Handle",
           "SamplingParams", "SerialEngine", "TokenEvent", "create_app"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app
        return create_app
    raise AttributeError(f"module 'cpufuse.serve' has no attribute {name!r}")
