"""llama.cpp's teacher-forced pass at 16k on the ids of session 12's cpufuse pass, its cache states kept for
depth_ab.py (issue 42, session 14). One llama.cpp fill to 16k serves both: the logits of the scored windows
(bench.e2e.kvfidelity's llama-cpp-python engine: flash attention on, 1 thread, micro-batches of 512, logits
asked only for the scored tokens) and, at each window's end, llama_state_save_file (the format depth_ab.py's
llama.cpp child loads).

    python  llama_pass.py ids MODEL TEXT N IDS.npy                    # cpufuse's ids (checked: == depth_ab's)
    PEERPY  llama_pass.py pass MODEL IDS.npy TYPE N_CTX ENDS N_EVAL OUTDIR STATEDIR > pass.log
    python  llama_pass.py compare BASE.npy OTHER.npy IDS.npy END N_EVAL     # agreement, KL, top-1 accuracy

Each window is the N_EVAL positions END - N_EVAL .. END - 1, as fid_pass.py's (cpufuse) scores."""
import ctypes
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "e2e")]     # kvfidelity alone: the peer venv has no cffi
import kvfidelity as kf     # noqa: E402

cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "ids":
    from cpufuse.llama.tokenizer import Tokenizer
    model, text, n, out = args[0], open(args[1], encoding="utf-8").read(), int(args[2]), args[3]
    tok = Tokenizer.from_gguf(model)
    ids = tok.encode(text)                   # fid_pass.py's ids (the whole text)
    pre = tok.encode(text[:n * 8])[:n]       # depth_ab.py's ids
    assert ids[:n] == pre, "the two tokenizations differ"
    np.save(out, np.asarray(ids[:n + 1], np.int32))
    print(f"{len(ids)} ids, first {n} identical to depth_ab.py's")
elif cmd == "pass":
    import llama_cpp
    model, ids, kv, n_ctx, ends, n_eval, outdir, statedir = args
    ids, n_ctx, n_eval = np.load(ids).tolist(), int(n_ctx), int(n_eval)
    run, _ = kf.llama_cpp_engine(model, n_ctx, kv, 1, 512)
    pos, w0, c0 = 0, time.perf_counter(), time.process_time()
    for C in map(int, ends.split(",")):
        if C - n_eval > pos:
            run(ids[pos:C - n_eval], False)
        np.save(os.path.join(outdir, f"llama-{kv}-{C}.npy"), run(ids[C - n_eval:C], True))
        pos, w, c = C, time.perf_counter() - w0, time.process_time() - c0
        toks = (llama_cpp.llama_token * C)(*ids[:C])
        st = os.path.join(statedir, f"llama.cpp-{kv}-{C}.state")
        assert llama_cpp.llama_state_save_file(run.llm.ctx, st.encode(), toks, C)
        print(json.dumps(dict(type=kv, ctx=C, n_eval=n_eval, wall_s=w, cpu_s=c, n_ctx=n_ctx, state=st,
                              load_avg=os.getloadavg(), version=llama_cpp.__version__)), flush=True)
elif cmd == "compare":
    base, other, ids = np.load(args[0]), np.load(args[1]), np.load(args[2])
    C, n_eval = int(args[3]), int(args[4])
    nxt = ids[C - n_eval + 1:C + 1]
    agree, kl = kf.compare(base, other)
    acc = lambda lg: float(np.mean(lg.argmax(-1)[:len(nxt)] == nxt))      # noqa: E731
    print(json.dumps(dict(ctx=C, n_eval=n_eval, positions=[C - n_eval, C - 1], top1_agree=agree, kl=kl,
                          top1_acc_base=acc(base), top1_acc_other=acc(other))))
