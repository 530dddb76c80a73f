"""python -m cpufuse {info, models, generate, chat, serve} [--help] | --version | --help"""
import argparse
import importlib
import sys

# command -> (module, function, one-line help); each command parses its own arguments
COMMANDS = {
    "models": ("cpufuse.llama.hub", "models_main", "the models that ship (by name): size, licence, present or not"),
    "generate": ("cpufuse.llama.cli", "main", "generate text from a GGUF model (stream to stdout)"),
    "chat": ("cpufuse.llama.cli", "chat_main", "interactive chat with a GGUF model on stdin/stdout"),
    "serve": ("cpufuse.serve.cli", "main", "OpenAI-compatible HTTP server (needs cpufuse[serve])"),
}


def _version():
    from importlib import metadata
    try:
        return metadata.version("cpufuse")
    except metadata.PackageNotFoundError:   # a source tree on PYTHONPATH
        import cpufuse
        return cpufuse.__version__


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m cpufuse",
                                 description="cpufuse: a CPU runtime for LLMs (GGUF models: chat, generate, an OpenAI-compatible "
                                             "server) on fused kernels. Start with: python -m cpufuse chat",
                                 epilog="`python -m cpufuse COMMAND --help` lists a command's options.")
    ap.add_argument("--version", action="version", version=f"cpufuse {_version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("info", help="the build: compiled ISAs, CPU features, the kernel each op uses")
    for name, (_, _, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        mod, fn, _ = COMMANDS[argv[0]]
        from cpufuse._extras import MissingExtra
        try:
            run = getattr(importlib.import_module(mod), fn)
        except MissingExtra as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return run(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command != "info":
        ap.print_help(sys.stderr)
        return 2
    import cpufuse
    i = cpufuse.info()
    print(f"cpufuse {i['version']} on {i['machine']}")
    print(f"  native extension : {'built' if i['native_extension'] else 'missing (' + str(i['native_load_error']) + ')'}")
    print(f"  compiled ISAs    : {', '.join(i['compiled_isas']) or 'none'}")
    print(f"  CPU features     : {', '.join(i['cpu_features']) or 'unknown'}")
    print(f"  CPU ISAs         : {', '.join(i['cpu_isas'])}")
    print(f"  available        : {', '.join(i['available_isas'])} (auto: {i['auto_isa']})")
    ov = i["override"]
    print(f"  override         : {ov['source'] + ' = ' + ov['isa'] if ov['source'] else 'none (CPUFUSE_ISA unset)'}")
    print(f"  ISA in force     : {i['isa']} (every op: {', '.join(cpufuse.OPS)})")
    c = i["cores"]
    quota = f"a cgroup CPU quota of {c['cgroup_cpu_quota']}" if c["cgroup_cpu_quota"] else "no cgroup CPU quota"
    print(f"  threads          : {i['num_threads']} by default ({c['affinity']} cores in the affinity mask, {quota}; "
          f"usable {c['usable']})")
    h = i["huge_pages"]
    print(f"  huge pages       : {'on' if h['used'] else 'off'} for the repacked weights (THP "
          f"{h['enabled'] or 'unavailable'}, defrag {h['defrag'] or '-'}; CPUFUSE_HUGEPAGES "
          f"{'unset' if h['env'] is None else '= ' + h['env']})")
    for isa, flags in i["build_flags"].items():
        print(f"  build[{isa}]: {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
