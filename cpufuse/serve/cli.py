"""`python -m cpufuse serve [MODEL]`: the OpenAI-compatible server on uvicorn.

    python -m cpufuse serve [MODEL | -m MODEL | -hf ORG/REPO[:QUANT]] [--host 127.0.0.1] [--port 8080]
                            [--parallel N] [-c N] [-t T] [--alias NAME] [--kv T] [-ctk T] [-ctv T]
                            [--context-shift [--keep N]]
                            [--temp ... --top-k ... --top-p ... --min-p ... --repeat-penalty ... --seed ...]
                            [--api-key KEY | --api-key-file FILE] [--protect-metrics] [--max-queue N]
                            [--max-body BYTES] [--timeout S] [--shutdown-timeout S]

The model, context, thread and sampling flags are `generate`'s and `chat`'s (cpufuse.llama.cli);
the sampling flags are the defaults of a request that does not set the field. Without MODEL the
default model (cpufuse.llama.hub.DEFAULT_MODEL) is served, installed on first use. One log line
per request (status, the reason of an error, tokens, timings) goes to stderr. The event loop is
asyncio's own (not uvloop). The port is bound at once and the model loads behind it (/health
says "loading" with 503 meanwhile). SIGTERM or Ctrl-C: new requests get 503, open ones get up to
--shutdown-timeout seconds, the rest are ended with their reason (a stream: a last SSE error event
and [DONE]), then the server exits 0; a second Ctrl-C exits at once.
"""
import argparse
import ipaddress
import os
import signal
import sys

from cpufuse.llama import cli as llama_cli

from .app import create_app
from .batch import DEFAULT_CHUNK, DEFAULT_STEP_TOKENS, BatchEngine, SerialEngine
from .engine import SamplingParams
from .guard import DEFAULT_MAX_BODY, Limits, drain

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
    llama_cli.add_context_args(ap, 'finish_reason "length"; prompt + max_tokens must fit -c, else 400')
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
                    help="seconds open requests get to finish on SIGTERM/Ctrl-C before they are ended with "
                         "a reason (default 10)")
    g = ap.add_argument_group("keys and limits")
    g.add_argument("--api-key", default=None,
                   help="requests must send Authorization: Bearer KEY (else 401); /health and /metrics stay open")
    g.add_argument("--api-key-file", default=None, help="a file of API keys, one a line (any of them is accepted)")
    g.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too")
    g.add_argument("--max-queue", type=int, default=None,
                   help="the most requests waiting for a slot; beyond it 503 with Retry-After (default: no bound)")
    g.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY,
                   help=f"the largest request body in bytes; larger ones get 413 (default {DEFAULT_MAX_BODY})")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds a request may take from arrival to its last token; past it the request is ended "
                        "with the reason (504, or a last SSE error event) (default: no limit)")
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


def limits(args) -> Limits:
    """the Limits of the flags; ValueError (its message names the flag) for a bad one"""
    keys = [args.api_key] if args.api_key else []
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                keys += [k.strip() for k in f if k.strip() and not k.startswith("#")]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from None
        if not keys:
            raise ValueError(f"--api-key-file: {args.api_key_file} holds no key")
    for flag, v, ok, want in (("--max-queue", args.max_queue, args.max_queue is None or args.max_queue >= 0, ">= 0"),
                              ("--max-body", args.max_body, args.max_body >= 1, ">= 1"),
                              ("--timeout", args.timeout, args.timeout is None or args.timeout > 0, "> 0"),
                              ("--shutdown-timeout", args.shutdown_timeout, args.shutdown_timeout >= 0, ">= 0")):
        if not ok:
            raise ValueError(f"{flag} must be {want}, got {v}")
    return Limits(api_keys=tuple(keys), protect_metrics=args.protect_metrics, max_queue=args.max_queue,
                  max_body=args.max_body, timeout=args.timeout)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        lim = limits(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
        if args.keep < 0 or (n_ctx and args.keep > n_ctx - 2):
            raise llama_cli.CLIError(f"--keep must be in [0, -c - 2 = {n_ctx - 2}] (a context shift keeps --keep "
                                     f"tokens and drops half of the rest), got {args.keep}" if n_ctx else
                                     f"--keep must be >= 0, got {args.keep}", 2)
    except llama_cli.CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        return 130
    kw = {"chunk": args.chunk, "step_tokens": args.batch_tokens} if args.engine == "batch" else {}
    kw.update(draft=draft, context_shift=args.context_shift, n_keep=args.keep)
    kw.update(llama_cli.kv_types(args))     # -ctk / -ctv

    def load():
        e = ENGINES[args.engine](path, n_ctx=n_ctx, n_threads=args.threads, kv_dtype=args.kv,
                                 model_name=args.alias, parallel=args.parallel,
                                 progress=llama_cli.LoadProgress(os.path.basename(path)), **kw)
        print(f"cpufuse serve: {os.path.basename(path)} loaded as {e.model_name!r}, n_ctx {e.n_ctx}, engine "
              f"{type(e).__name__} (parallel {e.parallel})", file=sys.stderr, flush=True)
        return e
    if not _loopback(args.host) and not lim.api_keys:
        print(f"warning: --host {args.host} is not a loopback address and no --api-key is set: anyone who can "
              "reach the port can use the model", file=sys.stderr, flush=True)
    try:
        app = create_app(load, sampling=sampling_defaults(args), limits=lim,
                         embeddings=(args.pooling or True) if args.embeddings else None,
                         slot_save_path=args.slot_save_path)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cpufuse serve: loading {os.path.basename(path)}, listening on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    _request_log(args.log_level)
    srv = app.state.server
    server = _uvicorn_server()(app, args)

    def failed(e):
        print(f"error: cannot load {path}: {e}", file=sys.stderr, flush=True)
        server.rc, server.should_exit = 1, True
    srv.on_load_error = failed
    try:
        server.run()
    except KeyboardInterrupt:   # a Ctrl-C outside uvicorn's signal capture
        return 130
    return server.rc


def _uvicorn_server():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn with cpufuse's shutdown (guard.drain): the first SIGTERM/SIGINT drains, a second
        SIGINT exits at once; the signal is not raised again after the exit (rc 0, no traceback)"""

        def __init__(self, app, args):
            super().__init__(uvicorn.Config(app, host=args.host, port=args.port, loop="asyncio",
                                            log_level=args.log_level, access_log=False,
                                            timeout_graceful_shutdown=2.0))
            self.app, self.grace, self.rc, self._draining = app, args.shutdown_timeout, 0, False

        def handle_exit(self, sig, frame):
            if self._draining or self.should_exit:
                if sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            self._draining = True
            print(f"cpufuse serve: {signal.Signals(sig).name}: shutting down (new requests get 503, open ones "
                  f"get up to {self.grace:g} s)", file=sys.stderr, flush=True)
            import asyncio
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

        async def _drain(self):
            try:
                await drain(self.app.state.server, self.grace)
            finally:
                self.should_exit = True
    return Server




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
