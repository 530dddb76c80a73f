"""python -m cpufuse info | python -m cpufuse generate ... (see cpufuse/llama/cli.py)"""
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        from cpufuse.llama.cli import main as generate_main
        return generate_main(argv[1:])
    if not argv or argv[0] != "info":
        print("usage: python -m cpufuse info | python -m cpufuse generate [-m PATH] -p PROMPT ...", file=sys.stderr)
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
    for op, isa in i["ops"].items():
        print(f"  {op:<17}: {isa}")
    for isa, flags in i["build_flags"].items():
        print(f"  build[{isa}]: {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
