"""The model's forward pass as it ran before the decoder graph: one public cpufuse op per step,
driven from Python (cpufuse/llama/model.py's `_forward` until the decoder graph replaced it). The
decoder graph must give exactly these numbers (tests/test_llama_model.py): it is the reference for
"the single-sequence logits stay bit-identical"."""
import numpy as np

from cpufuse import flash_attn, matmul, matmul_multi, matmul_swiglu, rms_norm, rope


def forward(m, tokens, pos0, kc_all, vc_all, all_logits=False):
    """tokens at positions pos0.. of one sequence whose KV cells are rows 0.. of kc_all[l]/vc_all[l]
    ((n_ctx, Hkv, D) per layer, written here); returns the last token's logits (1, V) or all (n, V)"""
    hp = m.hparams
    n, T = len(tokens), pos0 + len(tokens)
    E, H, Hkv, D = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim
    eps, act, isa, nt = hp.eps, m.act, m.isa, m.n_threads
    x = np.empty((n, E), np.float32)
    m._embed(tokens, x)
    q, k, v = (np.empty((n, w), np.float32) for w in (H * D, Hkv * D, Hkv * D))
    q3, k3, v3 = q.reshape(n, H, D), k.reshape(n, Hkv, D), v.reshape(n, Hkv, D)
    attn = np.empty((1, n, H, D), np.float32)
    o, g = np.empty((n, E), np.float32), np.empty((n, hp.n_ff), np.float32)
    pos = np.arange(pos0, T, dtype=np.int32)
    mask = None
    if n > 1:
        mask = np.zeros((n, T), np.float16)
        mask[:, pos0:T] = np.triu(np.full((n, n), -np.inf, np.float16), 1)
        mask = mask[None, None]
    rope_kw = m._rope_kw
    for li, L in enumerate(m.layers):
        matmul_multi(x, (L.wq, L.wk, L.wv), out=(q, k, v), norm_weight=L.attn_norm, eps=eps, act=act, isa=isa,
                     n_threads=nt)
        for a, b in ((q, L.bq), (k, L.bk), (v, L.bv)):
            if b is not None:
                a += b
        if L.q_norm is not None:
            q.reshape(-1, D)[...] = rms_norm(q.reshape(-1, D), L.q_norm, eps=eps, isa=isa, n_threads=nt)
            k.reshape(-1, D)[...] = rms_norm(k.reshape(-1, D), L.k_norm, eps=eps, isa=isa, n_threads=nt)
        kc, vc = kc_all[li], vc_all[li]
        rope(q3, pos, out=q3, **rope_kw)
        rope(k3, pos, cache=(kc, pos0), **rope_kw)
        vc[pos0:T] = v3
        flash_attn(q3.transpose(1, 0, 2)[None], kc[:T].transpose(1, 0, 2)[None], vc[:T].transpose(1, 0, 2)[None],
                   mask, scale=hp.kq_scale, out=attn, isa=isa, n_threads=nt)
        matmul(attn.reshape(n, H * D), L.wo, out=o, act=act, isa=isa, n_threads=nt)
        if L.bo is not None:
            o += L.bo
        x += o
        matmul_swiglu(x, L.wg, L.wu, out=g, norm_weight=L.ffn_norm, eps=eps, act=act, isa=isa, n_threads=nt)
        matmul(g, L.wd, out=o, act=act, isa=isa, n_threads=nt)
        if L.bd is not None:
            o += L.bd
        x += o
    rows = x if all_logits else x[n - 1:n]
    out = matmul(rows, m.output, norm_weight=m.output_norm, eps=eps, act=act, isa=isa, n_threads=nt)
    if m.output_bias is not None:
        out += m.output_bias
    return out
