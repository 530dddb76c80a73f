"""Synthetic GGUFs with real model shapes (Llama 3, Gemma 3, Phi-4-mini; the mixtures of experts
granite-3.1-1b-a400m, OLMoE-1B-7B, Qwen3-30B-A3B, gpt-oss-20b), for the end-to-end benchmark
(bench/README.md, "bench.e2e.bigmodels")."""
import argparse
import concurrent.futures
import itertools
import json
import math
import os
import shutil
import sys
import time

import numpy as np

from cpufuse.llama.tiny import add_model_keys, model_dims, planned_tensors
from cpufuse.quant.types import QTYPES

from ..report import save

GEN_VERSION = 2   # 2: the tensors in tiny.py's tensor_plan order (stacked experts 3-D)
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "cpufuse-bench")

SHAPES = {
    "1b": dict(name="Llama-3.2-1B", n_embd=2048, n_layer=16, n_ff=8192, n_head=32, n_head_kv=8, n_vocab=128256,
               tied=True, n_ctx_train=131072, freq_base=500000.0, eps=1e-5, rope_factor=32.0),
    "8b": dict(name="Llama-3.1-8B", n_embd=4096, n_layer=32, n_ff=14336, n_head=32, n_head_kv=8, n_vocab=128256,
               tied=False, n_ctx_train=131072, freq_base=500000.0, eps=1e-5, rope_factor=8.0),
    # arch: cpufuse/llama/tiny.py's keys and tensors for it; arch_keys: the real "<arch>." keys beyond those
    "gemma3-1b": dict(name="Gemma-3-1B", arch="gemma3", n_embd=1152, n_layer=26, n_ff=6912, n_head=4, n_head_kv=1,
                      head_dim=256, n_vocab=262144, tied=True, n_ctx_train=32768, freq_base=1000000.0, eps=1e-6,
                      arch_keys={"attention.sliding_window": 512}),
    "phi4-mini": dict(name="Phi-4-mini", arch="phi3", n_embd=3072, n_layer=32, n_ff=8192, n_head=24, n_head_kv=8,
                      n_rot=96, n_vocab=200064, tied=True, n_ctx_train=131072, freq_base=10000.0, eps=1e-5,
                      arch_keys={"rope.scaling.original_context_length": 4096,
                                 "rope.scaling.attn_factor": math.sqrt(1 + math.log(32) / math.log(4096)),
                                 "attention.sliding_window": 262144}),
    # mixtures of experts (shapes from the published configs; docs/moe.md): n_expert experts of n_ff_exp,
    # n_expert_used per token. The routers (ffn_gate_inp) are F32 as llama.cpp's quantizer keeps them.
    "granite-1b-a400m": dict(name="granite-3.1-1b-a400m", arch="granitemoe", n_embd=1024, n_layer=24, n_ff=512,
                             n_head=16, n_head_kv=8, n_vocab=49155, tied=True, n_ctx_train=131072,
                             freq_base=10000.0, eps=1e-6, n_expert=32, n_expert_used=8, n_ff_exp=512,
                             n_ff_shexp=0,   # no shared expert (granitemoe's tiny files have one)
                             arch_keys={"embedding_scale": 12.0, "residual_scale": 0.22,
                                        "attention.scale": 0.015625, "logit_scale": 6.0}),
    "olmoe-1b-7b": dict(name="OLMoE-1B-7B", arch="olmoe", n_embd=2048, n_layer=16, n_ff=1024, n_head=16,
                        n_head_kv=16, n_vocab=50304, tied=False, n_ctx_train=4096, freq_base=10000.0, eps=1e-5,
                        n_expert=64, n_expert_used=8, n_ff_exp=1024),
    "qwen3-30b-a3b": dict(name="Qwen3-30B-A3B", arch="qwen3moe", n_embd=2048, n_layer=48, n_ff=6144, n_head=32,
                          n_head_kv=4, head_dim=128, n_vocab=151936, tied=False, n_ctx_train=40960,
                          freq_base=1000000.0, eps=1e-6, n_expert=128, n_expert_used=8, n_ff_exp=768),
}
# Qwen2.5-Coder-1.5B-Instruct (its config.json; Q/K/V biases): bench.e2e.spec --replay times its speculative
# decoding's recorded decoder calls on this file where the real one cannot be copied
SHAPES["qwen2.5-coder-1.5b"] = dict(name="Qwen2.5-Coder-1.5B", arch="qwen2", n_embd=1536, n_layer=28, n_ff=8960,
                                    n_head=12, n_head_kv=2, n_vocab=151936, tied=True, n_ctx_train=32768,
                                    freq_base=1000000.0, eps=1e-6)
# Qwen3-30B-A3B with its first 8 of 48 layers (3.4 GB at Q4_K_M instead of 18.6): a quick file to check
# load-time memory per layer on a small machine (docs/moe.md extrapolates the full model from it)
SHAPES["qwen3-30b-a3b-8l"] = dict(SHAPES["qwen3-30b-a3b"], name="Qwen3-30B-A3B (8 of 48 layers)", n_layer=8)
# gpt-oss-20b (its config.json: 24 layers, d 2880, 64 / 8 heads of 64, 32 experts of 2880, top-4, window
# 128 on alternate layers, YaRN factor 32 over 4096); the released GGUFs are "mxfp4": MXFP4 experts,
# Q8_0 elsewhere (about 12 GB)
SHAPES["gpt-oss-20b"] = dict(name="gpt-oss-20b", arch="gpt-oss", n_embd=2880, n_layer=24, n_ff=2880, n_head=64,
                             n_head_kv=8, head_dim=64, n_vocab=201088, tied=False, n_ctx_train=131072,
                             freq_base=150000.0, eps=1e-5, n_expert=32, n_expert_used=4, n_ff_exp=2880,
                             arch_keys={"attention.sliding_window": 128, "rope.scaling.type": "yarn",
                                        "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096})
# gpt-oss-20b with its first 4 of 24 layers (about 2.5 GB instead of 12.1): its MXFP4 experts repacked and
# profiled per op on a small machine (docs/moe.md, gpt-oss)
SHAPES["gpt-oss-20b-4l"] = dict(SHAPES["gpt-oss-20b"], name="gpt-oss-20b (4 of 24 layers)", n_layer=4)
TYPES = ("q4_0", "q4_k", "q6_k", "q8_0", "q4_k_m", "mxfp4")

# block size, bytes per block and GGUF type number of the block types used here; the llama_ftype numbers
_BLOCK_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "MXFP4")
QK = {t: QTYPES[t].block_size for t in _BLOCK_TYPES}
BLOCK_BYTES = {t: QTYPES[t].type_size for t in _BLOCK_TYPES}
GGML_TYPE = {t: QTYPES[t].type_id for t in _BLOCK_TYPES}
FTYPE = {"q4_0": 2, "q8_0": 7, "q4_k": 14, "q4_k_m": 15, "q6_k": 18, "mxfp4": 38}   # llama_ftype (q4_k = Q4_K_S;
# mxfp4 = MXFP4_MOE)


def models_dir(path=None):
    return os.path.abspath(os.path.expanduser(path or os.environ.get("CPUFUSE_BENCH_MODELS") or DEFAULT_DIR))


def file_name(shape, qtype, pure=False):
    return f"{'' if 'arch' in SHAPES[shape] else 'llama-'}{shape}-shapes-{qtype.upper()}{'-pure' if pure else ''}.gguf"


def _more_bits(layer, n_layer):
    """llama-quant.cpp's use_more_bits: the layers Q4_K_M gives Q6_K ffn_down (a mixture's ffn_down_exps)"""
    return layer < n_layer // 8 or layer >= 7 * n_layer // 8 or (layer - n_layer // 8) % 3 == 2


def tensor_type(shape, qtype, role, pure=False, layer=None):
    """the GGML type llama.cpp's quantizer gives a 2-D weight of `role` ('token_embd', 'output', 'attn_q', ...)
    (layer: its block, for a mixture's ffn_down_exps; the router ffn_gate_inp stays F32; "mxfp4": the
    stacked experts MXFP4, everything else Q8_0)"""
    if role == "ffn_gate_inp":
        return "F32"
    if qtype == "mxfp4":
        return "MXFP4" if role.endswith("_exps") else "Q8_0"
    base = "Q4_K" if qtype == "q4_k_m" else qtype.upper()
    if role == "ffn_down_exps":
        return "Q6_K" if not pure and qtype == "q4_k_m" and _more_bits(layer, SHAPES[shape]["n_layer"]) else base
    if not pure and (role == "output" or role == "token_embd" and SHAPES[shape]["tied"]):
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    return "Q6_K" if not pure and qtype == "q4_k_m" and role == "ffn_down" else base


def tensors(shape, qtype, pure=False):
    """[(name, kind, n_out, n_in, type, lead)] in file order: tiny.py's planned tensors at the real dims,
    after llama3's rope_freqs; kind 'w' (a weight; K-quants replaced on rows not a multiple of 256) or 'f32';
    a stacked expert weight (n_expert, rows, n_in) has n_out = n_expert * rows and lead (n_expert,)"""
    s, d = SHAPES[shape], dims(shape)
    out = [] if "arch" in s else [("rope_freqs.weight", "f32", 1, d["head_dim"] // 2, "F32", ())]
    for name, kind, shp in planned_tensors(s.get("arch", "llama"), d, s["n_vocab"], s["tied"]):
        n_out, n_in, lead = int(np.prod(shp[:-1], dtype=np.int64)), shp[-1], tuple(shp[:-2])
        if kind not in ("w", "router"):
            out.append((name, "f32", 1, n_in, "F32", ()))
            continue
        part = name.split(".")
        t = "F32" if part[-1] == "bias" else \
            tensor_type(shape, qtype, part[-2], pure, int(part[1]) if part[0] == "blk" else None)
        out.append((name, "w", n_out, n_in, KQUANT_FALLBACK.get(t, t) if n_in % 256 else t, lead))
    return out


def nbytes(kind, n_out, n_in, t):
    return 4 * n_out * n_in if kind == "f32" or t == "F32" else n_out * (n_in // QK[t]) * BLOCK_BYTES[t]


def work(shape, qtype, pure=False):
    """What one token costs: decode weight bytes streamed (every layer matrix and the output matrix; an
    untied token_embd is one row a token; of a mixture's stacked experts, the n_expert_used it picks)
    and the int8 MACs of the matmuls"""
    s = SHAPES[shape]
    act = s.get("n_expert_used", 1) / s.get("n_expert", 1)
    ws = [(n_out * n_in * (act if lead else 1), t, nbytes(kind, n_out, n_in, t) * (act if lead else 1))
          for name, kind, n_out, n_in, t, lead in tensors(shape, qtype, pure)
          if kind == "w" and (name != "token_embd.weight" or s["tied"])]
    types = {t: sum(b for _, u, b in ws if u == t) for t in dict.fromkeys(t for _, t, _ in ws)}
    return {"weight_bytes_per_token": sum(b for *_, b in ws), "matmul_macs_per_token": sum(m for m, *_ in ws),
            "bytes_by_type": types}


def file_bytes(shape, qtype, pure=False):
    return sum(nbytes(k, o, i, t) for _, k, o, i, t, _ in tensors(shape, qtype, pure))


def _f16_col(buf, off):
    """the f16 field at byte `off` of every block (row) of buf, as a writable strided view"""
    return np.ndarray(shape=(buf.shape[0],), dtype="<f2", buffer=buf, offset=off, strides=(buf.strides[0],))


def _d_table(d0, signed):
    """256 f16 scales around d0 (0.75..1.25 d0, RMS ~d0), half of them negative when signed"""
    mag = d0 * (0.75 + 0.5 * (np.arange(256) % 128) / 127.0)
    if signed:
        mag = np.where(np.arange(256) < 128, mag, -mag)
    return mag.astype(np.float16)


def _rms(*ranges):
    return math.prod(float(np.sqrt(np.mean(np.asarray(v, np.float64) ** 2))) for v in ranges)


# RMS of the code part of one weight, per type (uniform random codes): Q4_0 (q - 8), Q8_0 q,
# Q4_K sc*(q - 7.5) with sc uniform in 32..63, Q6_K sc*(q - 32) with |sc| uniform in 32..95
CODE_RMS = {"Q4_0": _rms(np.arange(16) - 8), "Q8_0": _rms(np.arange(-128, 128)), "Q5_0": _rms(np.arange(32) - 16),
            "Q4_K": _rms(np.arange(32, 64), np.arange(16) - 7.5), "Q6_K": _rms(np.arange(32, 96), np.arange(64) - 32),
            "MXFP4": _rms(np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]))}


def random_blocks(t, n_out, n_in, rng):
    """(n_out, row bytes) uint8 blocks of type t: random codes, scales for an element RMS of 1/sqrt(n_in), mean ~0"""
    if t not in QK:
        raise ValueError(f"type {t!r}: expected one of {sorted(QK)}")
    nb = n_out * n_in // QK[t]
    bs = BLOCK_BYTES[t]
    words = rng.bit_generator.random_raw((nb * bs + 7) // 8)      # raw 64-bit outputs: ~1 GB/s
    buf = words.view(np.uint8)[:nb * bs].reshape(nb, bs)
    d0 = 1.0 / (math.sqrt(n_in) * CODE_RMS[t])
    pick = rng.bit_generator.random_raw(nb // 8 + 1).view(np.uint8)[:nb]   # a random byte per block picks its scale
    if t == "MXFP4":   # E8M0 scales 2^(e - 128): 2^lo or 2^(lo + 1) about d0, the larger with the share p
        lo = math.floor(math.log2(d0))          # that makes the mean square d0^2: p 4^(lo+1) + (1-p) 4^lo
        p_hi = (d0 * d0 / 4.0 ** lo - 1) / 3
        buf[:, 0] = (128 + lo + (pick < round(256 * p_hi))).astype(np.uint8)
    elif t in ("Q4_0", "Q8_0", "Q5_0"):
        _f16_col(buf, 0)[:] = _d_table(d0, True)[pick]
    elif t == "Q4_K":
        tab = _d_table(d0, False)
        _f16_col(buf, 0)[:] = tab[pick]
        _f16_col(buf, 2)[:] = (tab.astype(np.float32) * 7.5).astype(np.float16)[pick]   # dmin = 7.5 d
        sc = (buf[:, 4:12] & 31) | 32                                  # 8 sub-block scales in 32..63, min = scale
        lo, hi = sc[:, :4], sc[:, 4:]
        buf[:, 4:8] = lo | ((hi >> 4) << 6)                            # scales[0..3]: sc_j, top bits of sc_{j+4}
        buf[:, 8:12] = lo | ((hi >> 4) << 6)                           # scales[4..7]: m_j, top bits of m_{j+4}
        buf[:, 12:16] = (hi & 15) | ((hi & 15) << 4)                   # scales[8..11]: low bits of sc, m
    else:                                                              # Q6_K
        r = buf[:, 192:208]
        mag = 32 + (r & 63)                                              # |sc| in 32..95, sign: bit 7
        buf[:, 192:208] = np.where(r & 128, -mag.astype(np.int16), mag).astype(np.int8).view(np.uint8)
        _f16_col(buf, 208)[:] = _d_table(d0, False)[pick]
    return buf.reshape(n_out, (n_in // QK[t]) * bs)


def rope_freqs(shape):
    """llama3 RoPE frequency factors: low / high freq factor 1 / 4, original context 8192, factor 8 or 32"""
    s = SHAPES[shape]
    D = s["n_embd"] // s["n_head"]
    factor, lo_f, hi_f, old = s["rope_factor"], 1.0, 4.0, 8192
    freqs = s["freq_base"] ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    wl = 2 * math.pi / freqs
    lo_wl, hi_wl = old / lo_f, old / hi_f
    smooth = (old / wl - lo_f) / (hi_f - lo_f)
    f = np.where(wl < hi_wl, 1.0, np.where(wl > lo_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return f.astype(np.float32)


def longrope_factors(n, long):
    """Phi-4-mini-like LongRoPE factors: short all 1; long a ramp from 1 to 32 over two thirds of the pairs"""
    if not long:
        return np.ones(n, np.float32)
    k = (2 * n) // 3
    return np.minimum(32.0 ** (np.arange(n) / (k - 1)), 32.0).astype(np.float32)


# K-quant types llama.cpp's quantizer replaces when a row is not a multiple of 256 (llama-quant.cpp)
KQUANT_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def dims(shape):
    """cpufuse/llama/tiny.py's model_dims of a shape (head_dim and n_rot filled in)"""
    s = SHAPES[shape]
    keys = ("n_embd", "n_layer", "n_ff", "n_head", "n_head_kv", "head_dim", "n_rot", "n_expert", "n_expert_used",
            "n_ff_exp", "n_ff_shexp")
    return model_dims(s.get("arch", "llama"), {k: s[k] for k in keys if k in s})


def vocab(n_vocab=128256):
    """(tokens, token_types, merges): 256 byte symbols, 702 merges, fillers, then the 256 Llama-3 specials"""
    from gguf import TokenType

    from cpufuse.llama.tokenizer import bytes_to_unicode
    b2u, letters = bytes_to_unicode(), [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merges = [f"{a} {c}" for a in ["\u0120"] + letters for c in letters]     # Ġ = a space
    tokens = [b2u[b] for b in range(256)] + [m.replace(" ", "") for m in merges]
    seen = set(tokens)
    fill = (t for t in (f"\u0120w{i:05x}" for i in itertools.count()) if t not in seen)
    tokens += itertools.islice(fill, n_vocab - 256 - len(tokens))
    types = [int(TokenType.NORMAL)] * len(tokens) + [int(TokenType.CONTROL)] * 256
    names, reserved = {0: "begin_of_text", 1: "end_of_text", 4: "finetune_right_pad_id", 6: "start_header_id",
                       7: "end_header_id", 8: "eom_id", 9: "eot_id", 10: "python_tag"}, itertools.count()
    tokens += [f"<|{names[k]}|>" if k in names else f"<|reserved_special_token_{next(reserved)}|>" for k in range(256)]
    return tokens, types, merges


def params(shape, qtype, pure=False, seed=0):
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: expected one of {sorted(SHAPES)}")
    if qtype not in TYPES:
        raise ValueError(f"type {qtype!r}: expected one of {list(TYPES)}")
    return {"generator_version": GEN_VERSION, "shape": shape, "type": qtype, "pure": bool(pure), "seed": int(seed),
            **SHAPES[shape]}


def is_valid(path, shape, qtype, pure=False, seed=0):
    """True when `path` exists with the expected size and its sidecar names these parameters"""
    try:
        with open(path + ".json") as f:
            meta = json.load(f)
        return meta.get("params") == params(shape, qtype, pure, seed) and os.path.getsize(path) == meta.get("size")
    except (OSError, ValueError):
        return False


def write(path, shape, qtype, pure=False, seed=0, log=print):
    """Write the GGUF for (shape, qtype) at `path` (and its sidecar); returns path"""
    import gguf
    p, s, plan, total = params(shape, qtype, pure, seed), SHAPES[shape], tensors(shape, qtype, pure), \
        file_bytes(shape, qtype, pure)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp, t0 = path + ".part", time.perf_counter()
    w = gguf.GGUFWriter(tmp, s.get("arch", "llama"))
    add_model_keys(w, s.get("arch", "llama"), dims(shape), f"{s['name']} shapes, random {qtype.upper()} weights "
                   "(cpufuse bench)", s["n_ctx_train"], s["freq_base"], s["eps"], s.get("arch_keys"))
    tokens, types, merges = vocab(s["n_vocab"])
    for key, v in (("file_type", FTYPE[qtype]), ("quantization_version", 2), ("vocab_size", s["n_vocab"]),
                   ("tokenizer_model", "gpt2"), ("tokenizer_pre", "llama-bpe"), ("token_list", tokens),
                   ("token_types", types), ("token_merges", merges), ("bos_token_id", s["n_vocab"] - 256),
                   ("eos_token_id", s["n_vocab"] - 256 + 9), ("add_bos_token", True)):   # <|begin_of_text|>, <|eot_id|>
        getattr(w, "add_" + key)(v)
    for name, kind, n_out, n_in, t, lead in plan:
        nb = nbytes(kind, n_out, n_in, t)
        if kind == "f32":
            w.add_tensor_info(name, (n_in,), np.dtype(np.float32), nb)
        elif t == "F32":   # a router
            w.add_tensor_info(name, (n_out, n_in), np.dtype(np.float32), nb)
        else:
            rows = n_out // int(np.prod(lead, dtype=np.int64))
            w.add_tensor_info(name, lead + (rows, nb // n_out), np.dtype(np.uint8), nb,
                              raw_dtype=gguf.GGMLQuantizationType(GGML_TYPE[t]))
    for part in ("header", "kv_data", "ti_data"):
        getattr(w, f"write_{part}_to_file")()
    rng = np.random.default_rng([seed, GEN_VERSION, list(SHAPES).index(shape), TYPES.index(qtype)])

    def make(item):
        name, kind, n_out, n_in, t, _ = item
        if kind != "f32" and t == "F32":   # a router: N(0, 1/n_in) rows
            return (rng.standard_normal((n_out, n_in), np.float32) / np.float32(math.sqrt(n_in)))
        if kind != "f32":
            return random_blocks(t, n_out, n_in, rng)
        if name.startswith("rope_factors_"):
            return longrope_factors(n_in, name == "rope_factors_long.weight")
        return rope_freqs(shape) if name == "rope_freqs.weight" else np.ones(n_in, np.float32)

    # the next tensor is generated on a second thread while this one is written (both release the
    # GIL); one thread, in file order, so the random stream is the same as a serial loop's
    done, last = 0, t0
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        nxt = ex.submit(make, plan[0])
        for i in range(len(plan)):
            a, nxt = nxt.result(), ex.submit(make, plan[i + 1]) if i + 1 < len(plan) else None
            w.write_tensor_data(a)
            done, now = done + a.nbytes, time.perf_counter()
            if now - last > 2.0 or done == total:
                log(f"  {os.path.basename(path)}: {done / 2**30:5.2f} / {total / 2**30:.2f} GiB "
                    f"({done / 2**20 / (now - t0):.0f} MiB/s)")
                last = now
    w.close()
    os.replace(tmp, path)
    os.sync()   # before anything is timed (the kernel's writeback slowed the first measurements 2-5x)
    save(path + ".json", {"params": p, "size": os.path.getsize(path), "seconds": time.perf_counter() - t0,
                          "work": work(shape, qtype, pure)})
    return path


def _check_outside_git(path):
    """refuse a model path inside this repository unless git ignores it (no multi-GB file in git)"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.commonpath([root, os.path.abspath(path)]) != root or not os.path.exists(os.path.join(root, ".git")):
        return
    import subprocess
    if subprocess.run(["git", "-C", root, "check-ignore", "-q", os.path.abspath(path)]).returncode == 1:
        raise ValueError(f"models folder {os.path.dirname(path)}: inside the repository and not ignored by git; "
                         "choose a folder outside it (default ~/.cache/cpufuse-bench) or an ignored one")


def ensure(shape, qtype, directory=None, pure=False, seed=0, force=False, log=print):
    """The path of the (shape, qtype) file in the cache folder, written first if missing or stale"""
    d = models_dir(directory)
    path = os.path.join(d, file_name(shape, qtype, pure))
    if not force and is_valid(path, shape, qtype, pure, seed):
        return path
    _check_outside_git(path)
    need = file_bytes(shape, qtype, pure)
    os.makedirs(d, exist_ok=True)
    free = shutil.disk_usage(d).free + (os.path.getsize(path) if os.path.exists(path) else 0)
    if free < need + (1 << 30):
        raise OSError(f"{d}: {free / 2**30:.1f} GiB free, {need / 2**30:.1f} GiB needed for {os.path.basename(path)} "
                      "(+1 GiB margin); free some space or choose another --dir / CPUFUSE_BENCH_MODELS")
    log(f"bigmodels: writing {path} ({need / 2**30:.2f} GiB)")
    return write(path, shape, qtype, pure, seed, log=log)


def check(path, n_tokens=64, n_threads=None):
    """cpufuse on a prompt of n_tokens: the last logits' statistics (finite, mean, std, max)"""
    from cpufuse.llama import Model
    m = Model.load(path, n_ctx=max(256, n_tokens + 8), n_threads=n_threads)
    ids = (m.tokenize("The town library stands at the corner of Elm Street and the old market square. " * 8)
           * n_tokens)[:n_tokens]
    lg = np.array(m.logits(ids))
    return {"finite": bool(np.isfinite(lg).all()), "mean": float(lg.mean()), "std": float(lg.std()),
            "absmax": float(np.abs(lg).max()), "n_tokens": len(ids)}


def parse_list(s, allowed, what):
    """a comma list of names from `allowed` ("all": every one), for --models / --types"""
    if s.strip().lower() == "all":
        return list(allowed)
    items = [x.strip().lower() for x in s.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what}: {s!r}: expected a comma list of {', '.join(allowed)} (or all)")
    return items


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e.bigmodels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1b", help="comma list of " + ",".join(SHAPES) + " (default 1b)")
    ap.add_argument("--types", default="all", help="comma list of " + ",".join(TYPES) + ", or all (default)")
    ap.add_argument("--dir", help=f"cache folder (default $CPUFUSE_BENCH_MODELS or {DEFAULT_DIR})")
    ap.add_argument("--pure", action="store_true", help="every 2-D weight of the file type (token_embd/output too)")
    ap.add_argument("--force", action="store_true", help="write again even when a valid file is there")
    ap.add_argument("--check", action="store_true", help="run cpufuse on a 64-token prompt: logits finite?")
    a = ap.parse_args(argv)
    bad = False
    for shape in parse_list(a.models, list(SHAPES), "models"):
        for qt in parse_list(a.types, list(TYPES), "types"):
            t0 = time.perf_counter()
            path = ensure(shape, qt, a.dir, pure=a.pure, force=a.force)
            print(f"{path}: {os.path.getsize(path) / 2**30:.2f} GiB ({time.perf_counter() - t0:.1f} s)", flush=True)
            if a.check:
                c = check(path)
                bad |= not c["finite"]
                print(f"  cpufuse logits over {c['n_tokens']} tokens: finite {c['finite']}, mean {c['mean']:.3f}, "
                      f"std {c['std']:.3f}, max |x| {c['absmax']:.3f}", flush=True)
    if bad:
        sys.exit("bigmodels --check: non-finite logits")


if __name__ == "__main__":
    main()
