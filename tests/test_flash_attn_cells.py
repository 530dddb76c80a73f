"""Split-KV decode in the KV cache's layout (native/kernels/flash_attn.inc fa_split_cells_task, docs/kv.md).

K and V as the cache holds them, (cells, KV heads, row): a sequence's KV heads lie side by side within
a cell, so split-KV decode runs one task per (chunk, sequence, block of head groups), each group block by
block, with the next block's whole cells prefetched. Each group's partial must be the one the per-(group,
chunk) tasks compute on the same values laid out head by head, bit for bit, for every thread count
(the cells tasks run up to FA_CELLS_MAX_NTH = 2 threads or CPUFUSE_FA_CELLS_NTH, their blocks smaller with more threads; 3
threads take the per-group tasks on the cache's layout, which must give the same bits), chunk and
cache type, with masks (a hole, a fully masked chunk), two sequences, and with the prefetch on (K + V past 4 MiB) and off."""
import zlib

import numpy as np
import pytest

import cpufuse
from cpufuse.ops import kvquant

AVAILABLE_NATIVE = tuple(i for i in cpufuse.available_isas() if i != "numba")
PAIRS = [("f32", "f32"), ("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")]


def _cells(x, t):
    """x (S, T, H, D) float32 -> the cache's (S, T, H, row) array of type t"""
    if t == "f32":
        return x.copy()
    return kvquant.quantize(x, t) if t in ("q8_0", "q4_0") else x.astype(np.float16)


def _case(rng, S, Hq, Hk, T, D, kt, vt):
    q = rng.uniform(-2, 2, (S, Hq, 1, D)).astype(np.float32)
    kc = _cells(rng.standard_normal((S, T, Hk, D)).astype(np.float32), kt)
    vc = _cells(rng.standard_normal((S, T, Hk, D)).astype(np.float32), vt)
    cache = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)       # (S, Hk, T, row) views, cells apart
    heads = tuple(np.ascontiguousarray(a) for a in cache)            # the same values, each head contiguous
    return q, cache, heads


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("isa", AVAILABLE_NATIVE)
@pytest.mark.parametrize("kt,vt", PAIRS)
def test_cells_tasks_match_head_tasks(isa, kt, vt):
    rng = np.random.default_rng(zlib.crc32(f"{kt}/{vt}".encode()))
    # (S, Hq, Hk, T, D): GQA 4 with the prefetch on (K + V past 4 MiB), GQA 6, MHA, one KV head, D 128
    shapes = [(1, 32, 8, 4200 if kt != "f32" else 2200, 64), (2, 12, 2, 700, 64), (1, 8, 8, 600, 64),
              (2, 4, 1, 900, 128)]
    for S, Hq, Hk, T, D in shapes:
        q, cache, heads = _case(rng, S, Hq, Hk, T, D, kt, vt)
        m = np.zeros((S, 1, 1, T), np.float16)
        m[..., 130:133] = -np.inf            # a hole
        m[1 % S, ..., 256:512] = -np.inf     # a fully masked chunk (of 256) in the last sequence
        call = dict(scale=0.125, k_type=kt, v_type=vt, dv=D, isa=isa, strategy="split")
        if kt == "f32":
            call.pop("k_type"), call.pop("v_type")
        for mask in (None, m):
            for chunk in ((256, 100, 1000) if Hk == 8 and mask is None else (256,)):
                want = cpufuse.flash_attn(q, *heads, mask, chunk=chunk, n_threads=1, **call)
                for nt in (1, 2, 3):
                    got = cpufuse.flash_attn(q, *cache, mask, chunk=chunk, n_threads=nt, **call)
                    assert np.array_equal(_bits(want), _bits(got)), (S, Hq, Hk, T, D, chunk, nt, mask is None)
        rows = cpufuse.flash_attn(q, *cache, m, **dict(call, strategy="rows"))
        np.testing.assert_allclose(got, rows, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("isa", AVAILABLE_NATIVE)
@pytest.mark.parametrize("kt,vt", [("f16", "f16"), ("q8_0", "q4_0"), ("f32", "f32")])
def test_cold_prefetch_keeps_bits(isa, kt, vt):
    """flash_attn(cold=True): K and V from DRAM, as a decoder step's cache, prefetched at any size (the small calls
    here, under 4 MiB, have no prefetch otherwise): the same bits on the cache's layout and head by head, at 1-3
    threads, split and rows, with a mask; cold must be a bool"""
    rng = np.random.default_rng(5)
    for S, Hq, Hk, T, D in [(1, 16, 16, 200, 128), (2, 32, 8, 300, 64), (1, 8, 2, 70, 64)]:
        q, cache, heads = _case(rng, S, Hq, Hk, T, D, kt, vt)
        m = np.zeros((S, 1, 1, T), np.float16)
        m[..., 3:9] = -np.inf
        call = dict(scale=0.125, k_type=kt, v_type=vt, dv=D, isa=isa)
        if kt == "f32":
            call.pop("k_type"), call.pop("v_type")
        for strategy in ("split", "rows"):
            for mask in (None, m):
                want = cpufuse.flash_attn(q, *heads, mask, strategy=strategy, n_threads=1, **call)
                for kv in (cache, heads):
                    for nt in (1, 2, 3):
                        got = cpufuse.flash_attn(q, *kv, mask, strategy=strategy, n_threads=nt, cold=True, **call)
                        assert np.array_equal(_bits(want), _bits(got)), (S, Hq, Hk, T, D, strategy, nt)
    with pytest.raises(TypeError, match="cold must be a bool"):
        cpufuse.flash_attn(q, *heads, scale=0.125, cold=1)


@pytest.mark.parametrize("knob", ["CPUFUSE_FA_CELLS_NTH=0", "CPUFUSE_FA_CELLS_NTH=64", "CPUFUSE_FA_PF_RAMP=1"])
def test_cells_threads_knob(knob):
    """CPUFUSE_FA_CELLS_NTH (flash_attn.inc, read once per process; default FA_CELLS_MAX_NTH = 2): the cells
    tasks at no thread count (0) or at every one (64) give the same bits; CPUFUSE_FA_PF_RAMP=1 (default off), a
    prefetching call's first rows prefetched before its first block, too; this file's checks, run again in a
    process with the knob set"""
    import subprocess
    import sys
    from _util import clean_env
    name, _, val = knob.partition("=")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not knob", __file__],
                       env=clean_env(**{name: val}), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout, r.stdout[-2000:]
