"""Write tiny llama-family GGUF models with gguf.GGUFWriter (random weights, a small byte-level BPE
vocab): a model to try the API on without a download, and the tests' models (needs the `gguf`
package, part of cpufuse[llama]). The text they generate is noise.

    path = write_tiny_gguf("tiny.gguf", qtype="Q4_0")

qtype sets every 2-D weight except the token embedding (F16 unless embd_qtype is given):
F32, F16, Q8_0, Q4_0, IQ4_NL (n_in a multiple of 32) or Q4_K, Q6_K, Q2_K, Q3_K, IQ4_XS (n_in a
multiple of 256: use `kquant_dims()`). gguf-py cannot quantize K-quants, so Q4_K/Q6_K blocks are
random bytes with the f16 super-block scales set to give the wanted weight spread (any byte pattern
is a valid block); Q2_K, Q3_K and the IQ4 types come from cpufuse.reference.quant's quantizers.
"""
import numpy as np

import gguf

from .tokenizer import bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("Ġt", "he"), ("Ġ", "a"),
          ("r", "e"), ("o", "u"), ("Ġ", "s"), ("Ġ", "w"), ("i", "s"), ("e", "n"), ("Ġ", "h"), ("l", "l"),
          ("Ġ", "c"), ("Ġ", "o"), ("e", "s"), ("Ġ", "b"), ("a", "t"), ("o", "r"), ("e", "d"), ("Ġ", "f"),
          ("i", "t"), ("Ġw", "or"), ("l", "d"), ("Ġwor", "ld"), ("Ġh", "e"), ("Ġhe", "ll"), ("Ġhell", "o")]

DEFAULT_DIMS = dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=96)


def kquant_dims():
    """dimensions whose every n_in is a multiple of 256 (K-quant super-blocks)"""
    return dict(n_embd=256, n_layer=2, n_head=8, n_head_kv=2, n_ff=256)


def tiny_vocab():
    """(tokens, token_types, merges): 256 byte tokens, merged tokens, then the special tokens"""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [1] * 256
    merges = []
    for a, b in MERGES:
        merges.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(1)
    for s in SPECIALS:
        tokens.append(s)
        types.append(3)   # CONTROL
    return tokens, types, merges


def _kquant_random(rng, qtype, n_out, n_in, std):
    qt = gguf.GGMLQuantizationType[qtype]
    bsz, tsz = gguf.GGML_QUANT_SIZES[qt]
    nb = n_in // bsz
    raw = rng.integers(0, 256, size=(n_out, nb, tsz), dtype=np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    if qtype == "Q4_K":   # dmin = 7.5 d: E[d*sc*q] = E[dmin*m], rows of mean ~0
        raw[..., 0:2] = one
        raw[..., 2:4] = np.frombuffer(np.float16(7.5).tobytes(), np.uint8)
    elif qtype == "Q6_K":
        raw[..., 208:210] = one
    else:
        raise ValueError(qtype)
    flat = raw.reshape(n_out, nb * tsz)
    s = float(np.sqrt(np.mean(gguf.quants.dequantize(flat, qt).astype(np.float64) ** 2)))
    scale = np.frombuffer(np.float16(std / s).tobytes(), np.uint8)
    if qtype == "Q4_K":
        raw[..., 0:2] = scale
        raw[..., 2:4] = np.frombuffer(np.float16(7.5 * std / s).tobytes(), np.uint8)
    else:
        raw[..., 208:210] = scale
    return raw.reshape(n_out, nb * tsz)


def _add_weight(w, rng, name, n_out, n_in, qtype, std):
    if qtype in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"):   # cpufuse's own test quantizers
        from ..reference.quant import quantize_weight
        a = (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
        w.add_tensor(name, np.ascontiguousarray(quantize_weight(a, qtype).raw),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
        return
    if qtype in ("Q4_K", "Q6_K"):
        w.add_tensor(name, _kquant_random(rng, qtype, n_out, n_in, std),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
        return
    a = (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
    if qtype == "F32":
        w.add_tensor(name, a)
    elif qtype == "F16":
        w.add_tensor(name, a.astype(np.float16))
    else:
        qt = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)


ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gemma2", "phi3", "smollm3", "granite")
GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]


def write_tiny_gguf(path, qtype="F16", arch="llama", seed=0, tied=True, embd_qtype="F16",
                    n_ctx_train=512, freq_base=10000.0, eps=1e-5, chat_template=None, biases=None,
                    dims=None, extra=None, fused_qkv=False, arch_keys=None):
    """Write a tiny model and return its path (str). biases: None = the arch's default (qwen2 has
    Q/K/V biases). extra: callable(writer) to add keys. dims: DEFAULT_DIMS overrides, plus
    "head_dim" (written as attention.key_length/value_length when it is not n_embd / n_head) and
    "n_rot" (rope.dimension_count, default the head dim).

    arch: the general.architecture written; those of ARCHS get that architecture's tensors and keys
    (docs/architectures.md), any other name llama's (e.g. to test that it is refused):
    gemma3 (6 layers by default: 5 sliding-window layers then a global one; q/k norms, post norms,
    sliding_window 4, the Gemma turn tokens), gemma2 (post norms, softcaps 50/30, window 4),
    phi3 (fused attn_qkv and ffn_up, LongRoPE factors, partial rotary n_rot = head_dim / 2),
    smollm3, granite (embedding/residual/attention/logit scales). arch_keys: {key suffix: value}
    written as "<arch>.<suffix>" (overriding these defaults; None drops the key)."""
    d = dict(DEFAULT_DIMS)
    if arch == "gemma3":
        d["n_layer"] = 6
    if dims:
        d.update(dims)
    E, L, H, Hkv, FF = d["n_embd"], d["n_layer"], d["n_head"], d["n_head_kv"], d["n_ff"]
    D = d.get("head_dim") or E // H
    n_rot = d.get("n_rot") or (D // 2 if arch == "phi3" else D)
    gemma = arch in ("gemma2", "gemma3")
    if arch == "phi3":
        fused_qkv = True
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    if gemma:
        tokens, types = tokens + GEMMA_SPECIALS, types + [3] * len(GEMMA_SPECIALS)
    V = len(tokens)
    path = str(path)
    w = gguf.GGUFWriter(path, arch)
    akeys = {}
    if D != E // H:
        akeys["attention.key_length"] = D
        akeys["attention.value_length"] = D
    if gemma:
        akeys["attention.sliding_window"] = 4
    if arch == "gemma2":
        akeys["attn_logit_softcapping"] = 50.0
        akeys["final_logit_softcapping"] = 30.0
    if arch == "phi3":
        akeys["rope.scaling.original_context_length"] = 64
        akeys["rope.scaling.attn_factor"] = 1.19
    if arch == "granite":
        akeys.update({"embedding_scale": 12.0, "residual_scale": 0.22, "attention.scale": 0.0078125,
                      "logit_scale": 8.0})
    akeys.update(arch_keys or {})
    for k, v in akeys.items():
        if v is None:
            continue
        key = f"{arch}.{k}"
        if isinstance(v, bool) or isinstance(v, (list, tuple)) and v and isinstance(v[0], bool):
            if isinstance(v, bool):
                w.add_bool(key, v)
            else:
                w.add_array(key, list(v))
        elif isinstance(v, (list, tuple)):
            w.add_array(key, list(v))
        elif isinstance(v, int):
            w.add_uint32(key, v)
        else:
            w.add_float32(key, float(v))
    w.add_name("tiny-test")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(FF)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(freq_base)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_dimension_count(n_rot)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>" if gemma else "<|im_end|>"))
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    if extra is not None:
        extra(w)
    if biases is None:
        biases = arch == "qwen2"

    if arch == "phi3":
        for nm, lo in (("long", 1.0), ("short", 0.5)):   # LongRoPE factors (>= 1 in real files)
            w.add_tensor(f"rope_factors_{nm}.weight", (lo + rng.random(n_rot // 2) * 3).astype(np.float32))
    _add_weight(w, rng, "token_embd.weight", V, E, embd_qtype, 1.0)
    w.add_tensor("output_norm.weight", (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32))
    if not tied:
        _add_weight(w, rng, "output.weight", V, E, qtype, 1.0 / np.sqrt(E))
    for i in range(L):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32))
        if fused_qkv:   # one attn_qkv tensor: Q, K, V rows at offsets 0, H*D, (H+Hkv)*D
            _add_weight(w, rng, b + "attn_qkv.weight", (H + 2 * Hkv) * D, E, qtype, 1.0 / np.sqrt(E))
        else:
            _add_weight(w, rng, b + "attn_q.weight", H * D, E, qtype, 1.0 / np.sqrt(E))
            _add_weight(w, rng, b + "attn_k.weight", Hkv * D, E, qtype, 1.0 / np.sqrt(E))
            _add_weight(w, rng, b + "attn_v.weight", Hkv * D, E, qtype, 1.0 / np.sqrt(E))
        if biases:
            w.add_tensor(b + "attn_q.bias", (0.1 * rng.standard_normal(H * D)).astype(np.float32))
            w.add_tensor(b + "attn_k.bias", (0.1 * rng.standard_normal(Hkv * D)).astype(np.float32))
            w.add_tensor(b + "attn_v.bias", (0.1 * rng.standard_normal(Hkv * D)).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            w.add_tensor(b + "attn_q_norm.weight", (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32))
            w.add_tensor(b + "attn_k_norm.weight", (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32))
        _add_weight(w, rng, b + "attn_output.weight", E, H * D, qtype, 1.0 / np.sqrt(H * D))
        if gemma:
            w.add_tensor(b + "post_attention_norm.weight", (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32))
            w.add_tensor(b + "post_ffw_norm.weight", (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32))
        w.add_tensor(b + "ffn_norm.weight", (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32))
        if arch == "phi3":   # one ffn_up: the gate's n_ff rows, then up's
            _add_weight(w, rng, b + "ffn_up.weight", 2 * FF, E, qtype, 1.0 / np.sqrt(E))
        else:
            _add_weight(w, rng, b + "ffn_gate.weight", FF, E, qtype, 1.0 / np.sqrt(E))
            _add_weight(w, rng, b + "ffn_up.weight", FF, E, qtype, 1.0 / np.sqrt(E))
        _add_weight(w, rng, b + "ffn_down.weight", E, FF, qtype, 1.0 / np.sqrt(FF))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
