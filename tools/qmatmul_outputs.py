"""Bit-identity check of the quantized matmul across a kernel refactor: writes (save) or compares
(check) the outputs of cpufuse.matmul for every weight type of cpufuse/quant/types.py, rows 1..64,
f32 and q8 activations (where the type has a q8 path), GGUF-row and repacked weights, on every native
ISA this CPU runs, and the fused forms (matmul_multi, matmul_swiglu, norm and residual).

    python tools/qmatmul_outputs.py save  OUT.npz     # with the tree before the change
    python tools/qmatmul_outputs.py check OUT.npz     # with the tree after: exit 1 on any difference
"""
import sys

import numpy as np

import cpufuse
from cpufuse import _dispatch
from cpufuse.quant.types import QTYPES
from cpufuse.reference import quant as qref

ISAS = [i for i in ("amx", "avx512", "avx2", "scalar") if i in _dispatch.AVAILABLE]
N_OUT = 80          # five P16 panels: whole panels, a P16_NP pass and a leftover
K_FOR = {1: 96}     # float types: a K that is not a multiple of 32 (tails)


def cases():
    for name, t in QTYPES.items():
        K = 512 if t.block_size == 256 else K_FOR.get(t.block_size, 256 + 32)
        rng = np.random.default_rng(t.type_id)
        w = qref.random_blocks(name, N_OUT, K, rng)
        w2 = qref.random_blocks(name, N_OUT, K, rng)
        x = rng.standard_normal((64, K)).astype(np.float32)
        nw = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
        res = rng.standard_normal((64, N_OUT)).astype(np.float32)
        acts = ["f32"] + (["q8"] if t.vec_dot_type else [])
        for isa in ISAS:
            for rep in (False, True):
                if rep and t.block_size == 1:
                    continue
                ww, ww2 = (w.repack(isa), w2.repack(isa)) if rep else (w, w2)
                for act in acts:
                    key = f"{name}/{isa}/{'p16' if rep else 'gguf'}/{act}"
                    out = []
                    for rows in range(1, 65):
                        out.append(cpufuse.matmul(x[:rows], ww, act=act, isa=isa).ravel())
                    for rows in (1, 5, 64):
                        xr = x[:rows]
                        out.append(cpufuse.matmul(xr, ww, act=act, isa=isa, norm_weight=nw, eps=1e-5).ravel())
                        out.append(cpufuse.matmul(xr, ww, act=act, isa=isa, residual=res[:rows]).ravel())
                        out += [y.ravel() for y in cpufuse.matmul_multi(xr, [ww, ww2], act=act, isa=isa)]
                        out.append(cpufuse.matmul_swiglu(xr, ww, ww2, act=act, isa=isa).ravel())
                    yield key, np.concatenate(out)


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "save":
        got = dict(cases())
        np.savez_compressed(path, **got)
        print(f"saved {len(got)} cases ({', '.join(ISAS)}) to {path}")
        return 0
    want = np.load(path)
    bad, n = [], 0
    for key, y in cases():
        n += 1
        if key not in want.files:
            bad.append(f"{key}: not in {path}")
        elif not np.array_equal(want[key].view(np.uint32), y.view(np.uint32)):
            d = np.flatnonzero(want[key].view(np.uint32) != y.view(np.uint32))
            bad.append(f"{key}: {d.size} of {y.size} outputs differ")
    for b in bad:
        print(b)
    print(f"{n} cases ({', '.join(ISAS)}): " + ("all bit-identical" if not bad else f"{len(bad)} differ"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
