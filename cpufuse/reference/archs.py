"""A float64 reference forward pass of the decoder architectures cpufuse.llama runs, written from
llama.cpp's graph of each (docs/architectures.md), for the tests. It reads the GGUF with gguf-py's
GGUFReader and dequantizes with gguf.quants (nothing of cpufuse's loader, graph or kernels), keeps
K and V exactly (no f16 cache) and computes every step in float64.

    logits = ref_logits(path, tokens)        # (len(tokens), n_vocab) float64, from an empty cache
    python -m cpufuse.reference.archs MODEL.gguf [--prompt TEXT] [-n 8] [--text FILE] [--gelu-table]

The command line checks a real file: greedy tokens from cpufuse, then this reference's logits at
each of them (teacher forced), top-1 agreement and the reference's top-1/top-2 margin where they
differ (not a test: the suite never downloads; docs/architectures.md).

Per layer (each architecture's deltas in the comments): pre-norm RMSNorm (none on olmo2), Q/K/V,
the Q/K norms (per head; olmo2: over the full projection), RoPE, causal (and sliding-window)
softmax attention with the q.k scale and the optional logit softcap, the output projection, the
optional post-norm or residual scale, the residual add, then the same for the gated FFN (SiLU or
tanh-GELU gate); the final norm, the head (token_embd when output.weight is absent), the logit
scale and the final softcap.
"""
import math

import numpy as np

from .gguf_ref import RefFile as _File, rms as _rms
from .gptoss import ref_gptoss_logits
from .moe_ffn import ref_moe_ffn

_NEOX = {"qwen2", "qwen3", "gemma3", "gemma2", "phi3", "olmo2", "qwen3moe", "qwen2moe", "olmoe"}


def _gelu(x):
    # 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3), as x / (1 + exp(-2y)) (no cancellation)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_f16_table(x):
    """llama.cpp's CPU GELU (GGML_GELU_FP16): x <= -10 gives 0, x >= 10 gives x, else x rounded
    to f16 and the f16-rounded tanh GELU of that value (its 64K-entry table)"""
    xh = x.astype(np.float16).astype(np.float64)
    y = _gelu(xh).astype(np.float16).astype(np.float64)
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, y))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rope(x, pos, n_rot, neox, base, scale, factors, mscale):
    """x (n, heads, d): ggml rope_ext without YaRN extrapolation: theta_i = p * scale * base^(-2i/n_rot)
    / factors[i], cos and sin times mscale (attn_factor); dims >= n_rot unchanged"""
    y = x.copy()
    i = np.arange(n_rot // 2)
    th = pos[:, None] * scale * base ** (-2.0 * i / n_rot)
    if factors is not None:
        th = th / factors[None, :]
    c, s = (np.cos(th) * mscale)[:, None, :], (np.sin(th) * mscale)[:, None, :]
    if neox:
        a, b = x[..., i], x[..., i + n_rot // 2]
        y[..., i], y[..., i + n_rot // 2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        y[..., 2 * i], y[..., 2 * i + 1] = a * c - b * s, a * s + b * c
    return y


_CACHE = {}


def ref_logits(path, tokens, n_ctx=None, gelu="tanh", keep=False, hidden=False):
    """(len(tokens), n_vocab) float64 logits of every position; n_ctx: the context size the model
    runs with (phi3 picks its long or short RoPE factors by it; default context_length).
    gelu: "tanh" (the formula) or "f16_table" (llama.cpp's CPU table, to measure what it changes).
    keep: keep the dequantized file in memory for the next call on the same path.
    hidden: return the (len(tokens), n_embd) hidden states after output_norm (the embeddings)
    instead of the logits."""
    f = _CACHE.get(path) or _File(path)
    if keep:
        _CACHE[path] = f
    arch, T = f.arch, f.t
    if arch == "gpt-oss":   # its own forward (reference/gptoss.py)
        return ref_gptoss_logits(f, tokens, hidden=hidden)
    E, L, H = f.a("embedding_length"), f.a("block_count"), f.a("attention.head_count")
    Hkv = f.a("attention.head_count_kv", H)
    D = f.a("attention.key_length", E // H)
    n_rot = f.a("rope.dimension_count", D)
    eps = f.a("attention.layer_norm_rms_epsilon")
    base = f.a("rope.freq_base", 10000.0)
    factor = f.a("rope.scaling.factor", 0.0)
    scale_g = 1.0 / factor if factor and f.a("rope.scaling.type", "linear") == "linear" else 1.0
    mscale = f.a("rope.scaling.attn_factor", 1.0)
    n_ctx_train = f.a("context_length")
    gemma = arch in ("gemma2", "gemma3")
    olmo2 = arch == "olmo2"    # no pre-norms; Q/K norms over the full width; post-norms (as gemma)
    full_qk = arch in ("olmo2", "olmoe")   # Q/K norms over the full projection width
    granite = arch in ("granite", "granitemoe")
    tokens = np.asarray(tokens)
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)

    # per-layer attention kind and RoPE
    window = f.a("attention.sliding_window", 4096 if arch == "gemma2" else 0) if gemma else 0
    pattern = f.a("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):   # one bool per layer: True = sliding window
        swa = [bool(window) and bool(b) for b in pattern]
    else:                           # llama.cpp set_swa_pattern(n): il % n < n - 1 (n = 0: every layer)
        swa = [bool(window) and (pattern == 0 or il % pattern < pattern - 1) for il in range(L)]
    nope = [arch == "smollm3" and (il + 1) % 4 == 0 for il in range(L)]
    qscale = 1.0 / math.sqrt(D)
    if gemma and ((arch == "gemma2" and L == 46) or (arch == "gemma3" and L == 62)):
        qscale = 1.0 / math.sqrt(E // H)
    if granite and f.a("attention.scale"):
        qscale = f.a("attention.scale")
    attn_cap = f.a("attn_logit_softcapping", 50.0) if arch == "gemma2" else 0.0
    final_cap = f.a("final_logit_softcapping", 30.0 if arch == "gemma2" else 0.0) if gemma else 0.0
    factors = T.get("rope_freqs.weight")
    if arch == "phi3" and "rope_factors_long.weight" in T:
        orig = f.a("rope.scaling.original_context_length", n_ctx_train)
        factors = T["rope_factors_long.weight" if (n_ctx or n_ctx_train) > orig else "rope_factors_short.weight"]

    x = T["token_embd.weight"][tokens]
    if gemma:
        x = x * math.sqrt(E)
    if granite and f.a("embedding_scale"):
        x = x * f.a("embedding_scale")
    causal = pos[None, :] <= pos[:, None]
    for il in range(L):
        b = f"blk.{il}."
        h = x if olmo2 else _rms(x, T[b + "attn_norm.weight"], eps)
        if b + "attn_qkv.weight" in T:
            qkv = h @ T[b + "attn_qkv.weight"].T
            q, k, v = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
        else:
            q, k, v = (h @ T[b + f"attn_{c}.weight"].T for c in "qkv")
        for c, t in (("q", None), ("k", None), ("v", None)):
            if b + f"attn_{c}.bias" in T:
                if c == "q":
                    q = q + T[b + "attn_q.bias"]
                elif c == "k":
                    k = k + T[b + "attn_k.bias"]
                else:
                    v = v + T[b + "attn_v.bias"]
        if full_qk:   # over the whole projection, before the split into heads
            q, k = _rms(q, T[b + "attn_q_norm.weight"], eps), _rms(k, T[b + "attn_k_norm.weight"], eps)
        q, k, v = q.reshape(n, H, D), k.reshape(n, Hkv, D), v.reshape(n, Hkv, D)
        if b + "attn_q_norm.weight" in T and not full_qk:
            q = _rms(q, T[b + "attn_q_norm.weight"], eps)
            k = _rms(k, T[b + "attn_k_norm.weight"], eps)
        if not nope[il]:
            if swa[il]:   # gemma3: base 10000, scale 1; gemma2: the global base and scale
                lb = f.a("rope.freq_base_swa", 10000.0 if arch == "gemma3" else base)
                ls = 1.0 if arch == "gemma3" else scale_g
            else:
                lb, ls = base, scale_g
            q = _rope(q, pos, n_rot, arch in _NEOX, lb, ls, factors, mscale)
            k = _rope(k, pos, n_rot, arch in _NEOX, lb, ls, factors, mscale)
        vis = causal & ((pos[:, None] - pos[None, :] < window) if swa[il] else True)
        out = np.empty((n, H, D))
        g = H // Hkv
        for hh in range(H):
            s = (q[:, hh] @ k[:, hh // g].T) * qscale
            if attn_cap:
                s = attn_cap * np.tanh(s / attn_cap)
            s = np.where(vis, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, hh] = (p / p.sum(axis=1, keepdims=True)) @ v[:, hh // g]
        a = out.reshape(n, H * D) @ T[b + "attn_output.weight"].T
        if b + "attn_output.bias" in T:
            a = a + T[b + "attn_output.bias"]
        if gemma or olmo2:
            a = _rms(a, T[b + "post_attention_norm.weight"], eps)
        if granite and f.a("residual_scale"):
            a = a * f.a("residual_scale")
        x = x + a
        h = x if olmo2 else _rms(x, T[b + "ffn_norm.weight"], eps)
        if b + "ffn_gate_inp.weight" in T:   # a mixture of experts (reference/moe_ffn.py)
            y = ref_moe_ffn(f, b, h)
        else:
            if b + "ffn_gate.weight" in T:
                gt, up = h @ T[b + "ffn_gate.weight"].T, h @ T[b + "ffn_up.weight"].T
            else:   # phi3: one ffn_up, the gate's rows first
                gu = h @ T[b + "ffn_up.weight"].T
                gt, up = gu[:, :gu.shape[1] // 2], gu[:, gu.shape[1] // 2:]
            act = (_gelu_f16_table if gelu == "f16_table" else _gelu) if gemma else _silu
            y = (act(gt) * up) @ T[b + "ffn_down.weight"].T
        if gemma or olmo2:
            y = _rms(y, T[b + "post_ffw_norm.weight"], eps)
        if granite and f.a("residual_scale"):
            y = y * f.a("residual_scale")
        x = x + y
    x = _rms(x, T["output_norm.weight"], eps)
    if hidden:
        return x
    logits = x @ T.get("output.weight", T["token_embd.weight"]).T
    if granite and f.a("logit_scale"):
        logits = logits / f.a("logit_scale")
    if final_cap:
        logits = final_cap * np.tanh(logits / final_cap)
    return logits


def main(argv=None):
    import argparse
    import json
    import time

    from cpufuse.llama import Model
    ap = argparse.ArgumentParser(description="a GGUF model against the float64 reference forward")
    ap.add_argument("model")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("-n", type=int, default=8, help="greedy tokens (default 8)")
    ap.add_argument("--act", default="f32", choices=["f32", "q8"])
    ap.add_argument("--kv", default="f32", choices=["f32", "f16"])
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--text", default=None, help="a text file: teacher-force its first --max-tokens tokens "
                    "instead of generating (top-1 agreement over every position)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gelu-table", action="store_true",
                    help="also run the reference with llama.cpp's f16 GELU table and compare the three")
    a = ap.parse_args(argv)
    m = Model.load(a.model, n_ctx=256, act=a.act, kv_dtype=a.kv, n_threads=a.threads)
    if a.text:
        ids = m.tokenize(open(a.text, encoding="utf-8").read())[:a.max_tokens]
        seq, first, text = ids, 0, None
    else:
        ids = m.tokenize(a.prompt)
        r = m.generate(ids, max_tokens=a.n, temperature=0, stop_at_eog=False)
        seq, first, text = list(ids) + list(r.tokens), len(ids) - 1, r.text
    got = m.logits(seq)
    t0 = time.perf_counter()
    ref = ref_logits(a.model, seq, n_ctx=256, keep=a.gelu_table)
    t_ref = time.perf_counter() - t0
    rows = range(first, len(seq))
    agree, items = 0, []
    for i in rows:
        top_c, top_r = int(np.argmax(got[i])), int(np.argmax(ref[i]))
        s = np.sort(ref[i])
        items.append({"pos": i, "cpufuse": top_c, "ref": top_r, "ref_margin": float(s[-1] - s[-2])})
        agree += top_c == top_r
    err = float(np.max(np.abs(got[first:] - ref[first:])) / np.max(np.abs(ref[first:])))
    out = {"model": a.model, "act": a.act, "kv": a.kv, "n_positions": len(items), "text": text,
           "top1_agree": f"{agree}/{len(items)}", "max_logit_error_rel": err, "reference_s": round(t_ref, 1)}
    if a.gelu_table:   # what llama.cpp's f16 GELU table changes, against the formula and against cpufuse
        tab = ref_logits(a.model, seq, n_ctx=256, gelu="f16_table")
        top_t = np.argmax(tab[first:], 1)
        out["table_vs_formula_top1"] = f"{int(np.sum(top_t == np.argmax(ref[first:], 1)))}/{len(items)}"
        out["table_vs_cpufuse_top1"] = f"{int(np.sum(top_t == np.argmax(got[first:], 1)))}/{len(items)}"
        out["table_vs_formula_max_logit_diff_rel"] = float(np.max(np.abs(tab[first:] - ref[first:])) /
                                                           np.max(np.abs(ref[first:])))
    out["positions"] = items if not a.text else [x for x in items if x["cpufuse"] != x["ref"]]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
