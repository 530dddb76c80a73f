"""Synthetic GGUFs with real Llama shapes, for the end-to-end benchmark on 1B-8B models.

    python -m bench.e2e.bigmodels [--models 1b,8b] [--types q4_0,q4_k,q6_k,q8_0,q4_k_m] [--dir D]
                              [--force] [--check]

Details: bench/README.md, "bench.e2e.bigmodels".
"""
import argparse
import concurrent.futures
import json
import math
import os
import sys
import time

import numpy as np

from cpufuse.quant.types import QTYPES

GEN_VERSION = 1
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "cpufuse-bench")

SHAPES = {
    "1b": dict(name="Llama-3.2-1B", n_embd=2048, n_layer=16, n_ff=8192, n_head=32, n_head_kv=8, n_vocab=128256,
               tied=True, n_ctx_train=131072, freq_base=500000.0, eps=1e-5, rope_factor=32.0),
    "8b": dict(name="Llama-3.1-8B", n_embd=4096, n_layer=32, n_ff=14336, n_head=32, n_head_kv=8, n_vocab=128256,
               tied=False, n_ctx_train=131072, freq_base=500000.0, eps=1e-5, rope_factor=8.0),
}
TYPES = ("q4_0", "q4_k", "q6_k", "q8_0", "q4_k_m")

# block size (weights), bytes per block and GGUF type number of the block types used here (from
# cpufuse/quant/types.py, the one table), and the llama_ftype numbers
_BLOCK_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")
QK = {t: QTYPES[t].block_size for t in _BLOCK_TYPES}
BLOCK_BYTES = {t: QTYPES[t].type_size for t in _BLOCK_TYPES}
GGML_TYPE = {t: QTYPES[t].type_id for t in _BLOCK_TYPES}
FTYPE = {"q4_0": 2, "q8_0": 7, "q4_k": 14, "q4_k_m": 15, "q6_k": 18}   # llama_ftype (q4_k = Q4_K_S)


def models_dir(path=None):
    return os.path.abspath(os.path.expanduser(path or os.environ.get("CPUFUSE_BENCH_MODELS") or DEFAULT_DIR))


def file_name(shape, qtype, pure=False):
    return f"llama-{shape}-shapes-{qtype.upper()}{'-pure' if pure else ''}.gguf"


# ------------------------------------------------------------------------------------------------
# which type each tensor gets

def tensor_type(shape, qtype, role, pure=False):
    """the GGML type name of a 2-D weight: role is 'token_embd', 'output' or a layer matrix name
    ('attn_q', ..., 'ffn_down'); see the module docstring for the rules"""
    base = "Q4_K" if qtype == "q4_k_m" else qtype.upper()
    if pure:
        return base
    tied = SHAPES[shape]["tied"]
    if role == "output" or (role == "token_embd" and tied):
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    if qtype == "q4_k_m" and role == "ffn_down":
        return "Q6_K"
    return base


def tensors(shape, qtype, pure=False):
    """[(name, kind, n_out, n_in, type)] in file order; kind 'w' (a 2-D weight) or 'f32' (n_out = 1)"""
    s = SHAPES[shape]
    E, FF, H, Hkv = s["n_embd"], s["n_ff"], s["n_head"], s["n_head_kv"]
    D = E // H
    out = [("rope_freqs.weight", "f32", 1, D // 2, "F32"),
           ("token_embd.weight", "w", s["n_vocab"], E, tensor_type(shape, qtype, "token_embd", pure))]
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", "f32", 1, E, "F32"))
        for nm, n_out, n_in in (("attn_q", H * D, E), ("attn_k", Hkv * D, E), ("attn_v", Hkv * D, E),
                                ("attn_output", E, H * D)):
            out.append((b + nm + ".weight", "w", n_out, n_in, tensor_type(shape, qtype, nm, pure)))
        out.append((b + "ffn_norm.weight", "f32", 1, E, "F32"))
        for nm, n_out, n_in in (("ffn_gate", FF, E), ("ffn_up", FF, E), ("ffn_down", E, FF)):
            out.append((b + nm + ".weight", "w", n_out, n_in, tensor_type(shape, qtype, nm, pure)))
    out.append(("output_norm.weight", "f32", 1, E, "F32"))
    if not s["tied"]:
        out.append(("output.weight", "w", s["n_vocab"], E, tensor_type(shape, qtype, "output", pure)))
    return out


def nbytes(kind, n_out, n_in, t):
    if kind == "f32":
        return 4 * n_out * n_in
    return n_out * (n_in // QK[t]) * BLOCK_BYTES[t]


def work(shape, qtype, pure=False):
    """What one token costs, from the shapes: decode weight bytes streamed (every layer matrix and
    the output matrix; token_embd only as the output when tied: its one get_rows row is nothing),
    int8 MACs of the matmuls (sum of n_in * n_out), and the attention MACs of a 512-token prompt
    per token (QK^T and PV, causal: (T + 1) / 2 keys on average), stated apart."""
    s = SHAPES[shape]
    wb = macs = 0
    types = {}
    for name, kind, n_out, n_in, t in tensors(shape, qtype, pure):
        if kind != "w" or (name == "token_embd.weight" and not s["tied"]):
            continue
        wb += nbytes(kind, n_out, n_in, t)
        macs += n_out * n_in
        types[t] = types.get(t, 0) + nbytes(kind, n_out, n_in, t)
    D = s["n_embd"] // s["n_head"]
    attn512 = s["n_layer"] * s["n_head"] * D * 2 * (512 + 1) / 2
    return {"weight_bytes_per_token": wb, "matmul_macs_per_token": macs, "attn_macs_per_token_pp512": attn512,
            "bytes_by_type": types}


def file_bytes(shape, qtype, pure=False):
    return sum(nbytes(k, o, i, t) for _, k, o, i, t in tensors(shape, qtype, pure))


# ------------------------------------------------------------------------------------------------
# random blocks

def _f16_col(buf, off):
    """the f16 field at byte `off` of every block (row) of buf, as a writable strided view"""
    return np.ndarray(shape=(buf.shape[0],), dtype="<f2", buffer=buf, offset=off, strides=(buf.strides[0],))


def _d_table(d0, signed):
    """256 f16 scales around d0 (0.75..1.25 d0, RMS ~d0), half of them negative when signed"""
    mag = d0 * (0.75 + 0.5 * (np.arange(256) % 128) / 127.0)
    if signed:
        mag = np.where(np.arange(256) < 128, mag, -mag)
    return mag.astype(np.float16)


def _rms(vals):
    v = np.asarray(vals, np.float64)
    return float(np.sqrt(np.mean(v * v)))


# RMS of the code part of one weight, per type (uniform random codes): Q4_0 (q - 8), Q8_0 q,
# Q4_K sc*(q - 7.5) with sc uniform in 32..63, Q6_K sc*(q - 32) with |sc| uniform in 32..95
_Q4K_SC = np.arange(32, 64)
_Q6K_SC = np.arange(32, 96)
CODE_RMS = {
    "Q4_0": _rms(np.arange(16) - 8),
    "Q8_0": _rms(np.arange(-128, 128)),
    "Q4_K": _rms(_Q4K_SC) * _rms(np.arange(16) - 7.5),
    "Q6_K": _rms(_Q6K_SC) * _rms(np.arange(64) - 32),
}


def random_blocks(t, n_out, n_in, rng):
    """(n_out * n_in / QK) blocks of type t as a uint8 array (n_out, row bytes): random codes, the
    scales set for an element RMS of 1/sqrt(n_in) and mean ~0 (module docstring)"""
    if t not in QK:
        raise ValueError(f"type {t!r}: expected one of {sorted(QK)}")
    nb = n_out * n_in // QK[t]
    bs = BLOCK_BYTES[t]
    words = rng.bit_generator.random_raw((nb * bs + 7) // 8)      # raw 64-bit outputs: ~1 GB/s
    buf = words.view(np.uint8)[:nb * bs].reshape(nb, bs)
    d0 = 1.0 / (math.sqrt(n_in) * CODE_RMS[t])
    pick = rng.bit_generator.random_raw(nb // 8 + 1).view(np.uint8)[:nb]   # a random byte per block picks its scale
    if t in ("Q4_0", "Q8_0"):
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
    """llama3 RoPE frequency factors (rope_freqs.weight): low_freq_factor 1, high_freq_factor 4,
    original context 8192, factor 8 (8B) or 32 (1B)"""
    s = SHAPES[shape]
    D = s["n_embd"] // s["n_head"]
    factor, lo_f, hi_f, old = s["rope_factor"], 1.0, 4.0, 8192
    freqs = s["freq_base"] ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    wl = 2 * math.pi / freqs
    lo_wl, hi_wl = old / lo_f, old / hi_f
    smooth = (old / wl - lo_f) / (hi_f - lo_f)
    f = np.where(wl < hi_wl, 1.0, np.where(wl > lo_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return f.astype(np.float32)


# ------------------------------------------------------------------------------------------------
# vocabulary

def vocab():
    """(tokens, token_types, merges) of the byte-level BPE vocabulary (module docstring)"""
    from gguf import TokenType

    from cpufuse.llama.tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    first = ["\u0120"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]   # Ġ = a space
    for a in first:
        for c in range(ord("a"), ord("z") + 1):
            merges.append(f"{a} {chr(c)}")
            tokens.append(a + chr(c))
    seen = set(tokens)
    i = 0
    while len(tokens) < 128000:
        t = f"\u0120w{i:05x}"
        i += 1
        if t not in seen:
            tokens.append(t)
    types = [int(TokenType.NORMAL)] * len(tokens)
    special = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
               6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
               10: "<|python_tag|>"}
    r = 0
    for k in range(256):
        if k not in special:
            special[k] = f"<|reserved_special_token_{r}|>"
            r += 1
    tokens += [special[k] for k in range(256)]
    types += [int(TokenType.CONTROL)] * 256
    return tokens, types, merges


# ------------------------------------------------------------------------------------------------
# writing

def params(shape, qtype, pure=False, seed=0):
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: expected one of {sorted(SHAPES)}")
    if qtype not in TYPES:
        raise ValueError(f"type {qtype!r}: expected one of {list(TYPES)}")
    return {"generator_version": GEN_VERSION, "shape": shape, "type": qtype, "pure": bool(pure), "seed": int(seed),
            **SHAPES[shape]}


def _sidecar(path):
    return path + ".json"


def is_valid(path, shape, qtype, pure=False, seed=0):
    """True when `path` exists with the expected size and its sidecar names these parameters"""
    try:
        with open(_sidecar(path)) as f:
            meta = json.load(f)
        return meta.get("params") == params(shape, qtype, pure, seed) and os.path.getsize(path) == meta.get("size")
    except (OSError, ValueError):
        return False


def write(path, shape, qtype, pure=False, seed=0, log=print):
    """Write the GGUF for (shape, qtype) at `path` (and its sidecar); returns path"""
    import gguf
    p = params(shape, qtype, pure, seed)
    s = SHAPES[shape]
    E, H = s["n_embd"], s["n_head"]
    plan = tensors(shape, qtype, pure)
    total = file_bytes(shape, qtype, pure)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".part"
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"{s['name']} shapes, random {qtype.upper()} weights (cpufuse bench)")
    w.add_file_type(FTYPE[qtype])
    w.add_quantization_version(2)
    w.add_context_length(s["n_ctx_train"])
    w.add_embedding_length(E)
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(H)
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["freq_base"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_dimension_count(E // H)
    w.add_vocab_size(s["n_vocab"])
    tokens, types, merges = vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(128000)
    w.add_eos_token_id(128009)
    w.add_add_bos_token(True)
    for name, kind, n_out, n_in, t in plan:
        if kind == "f32":
            w.add_tensor_info(name, (n_in,), np.dtype(np.float32), 4 * n_in)
        else:
            nb = nbytes(kind, n_out, n_in, t)
            w.add_tensor_info(name, (n_out, nb // n_out), np.dtype(np.uint8), nb,
                              raw_dtype=gguf.GGMLQuantizationType(GGML_TYPE[t]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng([seed, GEN_VERSION, list(SHAPES).index(shape), TYPES.index(qtype)])

    def make(item):
        name, kind, n_out, n_in, t = item
        if kind == "f32":
            return rope_freqs(shape) if name == "rope_freqs.weight" else np.ones(n_in, np.float32)
        return random_blocks(t, n_out, n_in, rng)

    # the next tensor is generated on a second thread while this one is written (both release the
    # GIL); one thread, in file order, so the random stream is the same as a serial loop's
    done, last = 0, t0
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        nxt = ex.submit(make, plan[0])
        for i in range(len(plan)):
            a = nxt.result()
            if i + 1 < len(plan):
                nxt = ex.submit(make, plan[i + 1])
            w.write_tensor_data(a)
            done += a.nbytes
            now = time.perf_counter()
            if now - last > 2.0 or done == total:
                log(f"  {os.path.basename(path)}: {done / 2**30:5.2f} / {total / 2**30:.2f} GiB "
                    f"({done / 2**20 / (now - t0):.0f} MiB/s)")
                last = now
    w.close()
    os.replace(tmp, path)
    # Flush the GBs just written before anything is timed: the kernel's writeback of dirty pages
    # otherwise runs during the first measurements (seen on the 16-core Xeon as decode steps 2-5x
    # slower at 16 threads, with the load average up while nothing else ran).
    t_sync = time.perf_counter()
    os.sync()
    log(f"  {os.path.basename(path)}: synced to disk in {time.perf_counter() - t_sync:.1f} s")
    with open(_sidecar(path), "w") as f:
        json.dump({"params": p, "size": os.path.getsize(path), "seconds": time.perf_counter() - t0,
                   "work": work(shape, qtype, pure)}, f, indent=1)
    return path


def _check_outside_git(path):
    """refuse a model path inside this repository unless git ignores it (no multi-GB file in git)"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.commonpath([root, os.path.abspath(path)]) != root or not os.path.exists(os.path.join(root, ".git")):
        return
    import subprocess
    try:
        r = subprocess.run(["git", "-C", root, "check-ignore", "-q", os.path.abspath(path)], capture_output=True)
    except OSError:
        return
    if r.returncode == 1:
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
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize + (os.path.getsize(path) if os.path.exists(path) else 0)
    if free < need + (1 << 30):
        raise OSError(f"{d}: {free / 2**30:.1f} GiB free, {need / 2**30:.1f} GiB needed for {file_name(shape, qtype, pure)} "
                      "(+1 GiB margin); free some space or choose another --dir / CPUFUSE_BENCH_MODELS")
    log(f"bigmodels: writing {path} ({need / 2**30:.2f} GiB)")
    return write(path, shape, qtype, pure, seed, log=log)


def check(path, n_tokens=64, n_threads=None):
    """cpufuse on a prompt of n_tokens: the last logits' statistics (finite, mean, std, max)"""
    from cpufuse.llama import Model
    m = Model.load(path, n_ctx=max(256, n_tokens + 8), n_threads=n_threads)
    ids = m.tokenize("The town library stands at the corner of Elm Street and the old market square. " * 8)
    ids = (ids * (n_tokens // max(1, len(ids)) + 1))[:n_tokens]
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
