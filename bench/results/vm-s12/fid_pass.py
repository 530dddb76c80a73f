"""One teacher-forced pass of bench.e2e.kvfidelity in its own process, its logits saved (session 12: the
f16 and q8_0 passes to 16k ran at once, one per core, then `--compare`):

    python bench/results/vm-s12/fid_pass.py MODEL TEXT CTX N_EVAL TYPE OUT.npy > OUT.log
    python bench/results/vm-s12/fid_pass.py --compare BASE.npy OTHER.npy TEXT MODEL CTX N_EVAL JSON

(each pass prints one JSON line, which --compare reads from OUT.log beside OUT.npy)"""
import json
import sys
import time

import numpy as np

from bench.e2e import kvfidelity as kf
from cpufuse.llama.tokenizer import Tokenizer


def ids_of(model, text):
    return Tokenizer.from_gguf(model).encode(open(text, encoding="utf-8").read())


if sys.argv[1] == "--compare":
    base, other, text, model, C, n_eval, out = sys.argv[2:9]
    C, n_eval = int(C), int(n_eval)
    b, o = np.load(base), np.load(other)
    logs = [json.loads(open(f[:-4] + ".log").readline()) for f in (base, other)]   # each pass's first line
    nxt = np.asarray(ids_of(model, text)[C - n_eval + 1:C + 1])
    agree, kl = kf.compare(b, o)
    acc = lambda lg: float(np.mean(lg.argmax(-1)[:len(nxt)] == nxt))     # noqa: E731
    res = dict(ctx=C, n_eval=n_eval, top1_agree=agree, kl=kl, top1_acc_base=acc(b), top1_acc_other=acc(o),
               other_type=logs[1]["type"], kv_bytes_other=logs[1]["kv_bytes"],
               **{f"{k}_{w}": lg[k] for w, lg in zip(("base", "other"), logs) for k in ("cpu_s", "wall_s")})
    print(json.dumps(res))
    json.dump(res, open(out, "w"), indent=1)
else:
    model, text, C, n_eval, kv_type, out = sys.argv[1:7]
    C, n_eval = int(C), int(n_eval)
    lg, secs, kvb = kf.teacher_forced("cpufuse", model, ids_of(model, text), [C], n_eval, kv_type, 1, 512)
    np.save(out, lg[C])
    print(json.dumps(dict(type=kv_type, ctx=C, wall_s=secs[C][0], cpu_s=secs[C][1], kv_bytes=kvb)), flush=True)
