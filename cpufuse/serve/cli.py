"""`python -m cpufuse serve [MODEL]`: the OpenAI-compatible server on uvicorn.

    python -m cpufuse serve [MODEL | -m MODEL | -hf ORG/REPO[:QUANT]] [--host 127.0.0.1] [--port 8080]
                            [--parallel N] [-c N] [-t T] [--alias NAME] [--kv f16|f32]
                            [--temp ... --top-k ... --top-p ... --min-p ... --repeat-penalty ... --seed ...]

The model, context, thread and sampling flags are `generate`'s and `chat`'s (cpufuse.llama.cli);
the sampling flags are the defaults of a request that does not set the field. Without MODEL the
default model (cpufuse.llama.hub.DEFAULT_MODEL) is served, installed on first use. One log line
per request (status, the reason of an error, tokens, timings) goes to stderr. The event loop is
asyncio's own (not uvloop). Ctrl-C: uvicorn stops accepting, waits up to --shutdown-timeout
seconds for open requests, cancels the rest, then the engine stops.
"""
import argparse
import os
import sys

from cpufuse.llama import cli as llama_cli

from .app import create_app
from .batch import DEFAULT_CHUNK, DEFAULT_STEP_TOKENS, BatchEngine, SerialEngine
from .engine import SamplingParams

# --engine NAME -> a factory(path, n_ctx, n_threads, kv_dtype, model_name, parallel) -> Engine
ENGINES = {"batch": BatchEngine.load, "serial": SerialEngine.load}


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m cpufuse serve",
                                 description="Serve a GGUF model over an OpenAI-compatible HTTP API "
                                             "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).")
    llama_cli.add_model_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    ap.add_argument("-np", "--parallel", type=int, default=8,
                    help="sequences run at once, each with its own KV slot of --n-ctx cells (default 8; "
                         "more requests wait in a queue; the serial engine runs one at a time)")
    llama_cli.add_run_args(ap)
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
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds open requests get to finish on shutdown (default 10)")
    ap.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    llama_cli.add_sampling_args(ap, "sampling (the defaults of a request that does not set the field)")
    llama_cli.add_spec_args(ap)
    g = ap.add_argument_group("embeddings")
    g.add_argument("--embeddings", action="store_true", help="serve POST /v1/embeddings (L2-normalized vectors)")
    ap.add_argument("--slot-save-path", default=None, metavar="DIR",
                    help="serve llama-server's POST /slots/{id}?action=save|restore|erase with files in DIR")
    g.add_argument("--pooling", choices=("none", "mean", "cls", "last", "rank"), default=None,
                   help="how a text's token vectors become one (default: the model file's pooling_type, else none, "
                        "which /v1/embeddings refuses: give mean, cls or last for a chat model)")
    return ap


def sampling_defaults(args) -> SamplingParams:
    return SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, repeat_penalty=args.repeat_penalty)


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("parallel", "port", "chunk", "batch_tokens"):
        v = getattr(args, name)
        if v < (0 if name == "port" else 1):
            print(f"error: --{name.replace('_', '-')} must be {'>= 0' if name == 'port' else '>= 1'}, got {v}", file=sys.stderr)
            return 2
    try:
        llama_cli.check_sampling(args)
        path = llama_cli.model_path(args)
        n_ctx = llama_cli.context(args, path, n_seq=args.parallel if args.engine == "batch" else 1)
        draft = llama_cli.make_draft(args)       # loaded with the model (speculative decoding per sequence)
    except llama_cli.CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    try:
        kw = {"chunk": args.chunk, "step_tokens": args.batch_tokens} if args.engine == "batch" else {}
        kw["draft"] = draft
        engine = ENGINES[args.engine](path, n_ctx=n_ctx, n_threads=args.threads, kv_dtype=args.kv,
                                      model_name=args.alias, parallel=args.parallel,
                                      progress=llama_cli.LoadProgress(os.path.basename(path)), **kw)
    except (OSError, ValueError, NotImplementedError, RuntimeError, TypeError) as e:
        print(f"error: cannot load {path}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    import uvicorn
    print(f"cpufuse serve: {os.path.basename(path)} as {engine.model_name!r}, n_ctx {engine.n_ctx}, "
          f"engine {type(engine).__name__} (parallel {engine.parallel}) on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    _request_log(args.log_level)
    try:
        app = create_app(engine, sampling=sampling_defaults(args),
                         embeddings=(args.pooling or True) if args.embeddings else None,
                         slot_save_path=args.slot_save_path)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            loop="asyncio", log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0



def _request_log(level):
    """the per-request lines (cpufuse.serve.app's logger "cpufuse.serve") to stderr, in place of
    uvicorn's access log"""
    import logging
    log = logging.getLogger("cpufuse.serve")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(h)
    log.setLevel(level.upper())
    log.propagate = False


if __name__ == "__main__":
    sys.exit(main())
