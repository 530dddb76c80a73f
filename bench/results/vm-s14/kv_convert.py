"""A cpufuse q8_0 (or q4_0) cache state at depth from an f16 one, for depth_ab.py's timing (session 14):
the f16 state's K and V rows quantized as the graph's kv_write quantizes a row (cpufuse.ops.kvquant),
the same tokens. Not a q8_0 fill: the cells differ a little from what a q8_0 cache would have computed
(its later layers see the f16 cells' attention), the work at depth does not; it saves a 16k fill.

    python kv_convert.py MODEL N_CTX SRC-f16.state TYPE DST.state"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from cpufuse.llama import state                # noqa: E402
from cpufuse.llama.model import Model          # noqa: E402
from cpufuse.ops import kvquant                # noqa: E402

model, n_ctx, src, kv, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
f = Model.load(model, n_ctx=n_ctx, n_threads=1, type_k="f16", type_v="f16")
n = f.load_kv(src)
toks = np.asarray(f._cached[:n]).copy()
q = Model.load(model, n_ctx=n_ctx, n_threads=1, type_k=kv, type_v=kv)
for li in range(q.kv.n_layer):
    for a, b, t in zip(f.kv.layer(li), q.kv.layer(li), (q.kv.quant_k, q.kv.quant_v)):
        b[:n] = kvquant.quantize(a[:n].astype(np.float32), t)
state.save_file(q, dst, state.dump(q, 0, toks))
print(f"{dst}: {n} tokens, {kv} from {src}")
