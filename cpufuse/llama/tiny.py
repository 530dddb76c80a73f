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
import pathlib

import numpy as np

import gguf

from .arch import REGISTRY, SUPPORTED
from .arch.spec import Dims
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


def _add_weight(w, rng, name, n_out, n_in, qtype, std, lead=()):
    """a random weight of n_out rows of n_in; lead: leading dims (stacked experts) that split the
    rows, e.g. (n_expert,) writes (n_expert, n_out / n_expert, n_in)"""
    def add(a, raw_dtype=None):   # a: (n_out, n_in elements or row bytes)
        a = a.reshape(tuple(lead) + (n_out // int(np.prod(lead, dtype=np.int64)), a.shape[-1]))
        w.add_tensor(name, a, raw_dtype=raw_dtype)
    if qtype in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"):   # cpufuse's own test quantizers
        from ..reference.quant import quantize_weight
        a = (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
        add(np.ascontiguousarray(quantize_weight(a, qtype).raw), gguf.GGMLQuantizationType[qtype])
        return
    if qtype in ("Q4_K", "Q6_K"):
        add(_kquant_random(rng, qtype, n_out, n_in, std), gguf.GGMLQuantizationType[qtype])
        return
    a = (rng.standard_normal((n_out, n_in)) * std).astype(np.float32)
    if qtype == "F32":
        add(a)
    elif qtype == "F16":
        add(a.astype(np.float16))
    else:
        qt = gguf.GGMLQuantizationType[qtype]
        add(gguf.quants.quantize(a, qt), qt)


ARCHS = SUPPORTED   # every architecture of the registry (cpufuse/llama/arch/)


def model_dims(arch, dims=None):
    """DEFAULT_DIMS with the architecture's tiny overrides (gemma3: 6 layers) and `dims` applied,
    and "head_dim" and "n_rot" filled in (head_dim n_embd / n_head, n_rot the architecture's
    fraction of the head dim: all of it, half for phi3)"""
    a = REGISTRY.get(arch)
    d = dict(DEFAULT_DIMS)
    d.update(a.tiny_dims if a else {})
    d.update(dims or {})
    d["head_dim"] = d.get("head_dim") or d["n_embd"] // d["n_head"]
    d["n_rot"] = d.get("n_rot") or int(d["head_dim"] * (a.tiny_rot if a else 1.0))
    return d


def arch_key_values(arch, d, arch_keys=None):
    """{suffix: value} of the "<arch>.<suffix>" keys beyond the common ones: key/value_length when the
    head dim is not n_embd / n_head, then the arch's tiny defaults (its module's tiny_keys), then
    arch_keys (None drops one)"""
    akeys = {}
    if d["head_dim"] != d["n_embd"] // d["n_head"]:
        akeys["attention.key_length"] = d["head_dim"]
        akeys["attention.value_length"] = d["head_dim"]
    if arch in REGISTRY:
        akeys.update(REGISTRY[arch].tiny_keys)
    akeys.update(arch_keys or {})
    return {k: v for k, v in akeys.items() if v is not None}


def add_model_keys(w, arch, d, name, n_ctx_train, freq_base, eps, arch_keys=None):
    """Write the model's keys (not the tokenizer's) to the GGUFWriter w: arch_key_values, typed
    (bool, uint32, float32 or an array), then general.name and the common hyperparameters of `d`
    (model_dims)"""
    for k, v in arch_key_values(arch, d, arch_keys).items():
        key = f"{arch}.{k}"
        if isinstance(v, (list, tuple)):
            w.add_array(key, list(v))
        elif isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        else:
            w.add_float32(key, float(v))
    w.add_name(name)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(d["n_embd"])
    w.add_block_count(d["n_layer"])
    w.add_feed_forward_length(d["n_ff"])
    w.add_head_count(d["n_head"])
    w.add_head_count_kv(d["n_head_kv"])
    w.add_rope_freq_base(freq_base)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_dimension_count(d["n_rot"])
    if d.get("n_expert"):   # a mixture of experts (arch/_moe.py); arch_keys may override each
        given = arch_key_values(arch, d, arch_keys)
        for k, v in (("expert_count", d["n_expert"]), ("expert_used_count", d["n_expert_used"]),
                     ("expert_feed_forward_length", d["n_ff_exp"]),
                     ("expert_shared_feed_forward_length", d.get("n_ff_shexp"))):
            if v and k not in given and (arch_keys or {}).get(k, 0) is not None:
                w.add_uint32(f"{arch}.{k}", v)


def _dims(d, n_vocab):
    return Dims(d["n_embd"], d["n_head"], d["n_head_kv"], d["head_dim"], d["n_ff"], n_vocab, d["n_rot"],
                d["n_layer"], d.get("n_expert", 0), d.get("n_ff_exp", 0), d.get("n_ff_shexp", 0))


def _init(t):
    """tiny.py's kind of random values for the declared tensor t"""
    if t.init:
        return t.init
    if len(t.shape) >= 2:
        return "w"
    return "bias" if t.name.endswith(".bias") else "norm"


def tensor_plan(arch, d, n_vocab, tied=True, biases=None, fused_qkv=False, options=None):
    """[(name, kind, n_out, n_in)] of _plan: a weight of any rank as n_out = the product of its
    leading dims (the docstring of _plan says which tensors)"""
    return [(name, kind, int(np.prod(shape[:-1], dtype=np.int64)), shape[-1])
            for name, kind, shape in _plan(arch, d, n_vocab, tied, biases, fused_qkv, options)]


def planned_tensors(arch, d, n_vocab, tied=True, biases=None, fused_qkv=False, options=None):
    """[(name, kind, numpy shape)] of the tensors write_tiny_gguf writes (_plan), for writers of
    other sizes (bench/e2e/bigmodels.py)"""
    return _plan(arch, d, n_vocab, tied, biases, fused_qkv, options)


def _plan(arch, d, n_vocab, tied=True, biases=None, fused_qkv=False, options=None):
    """The model's tensors in file order, [(name, kind, shape)]: the tensors the architecture
    declares (cpufuse/llama/arch/, llama's for a name not in the registry) that these options
    select, with their declared numpy shapes. kind "w" a weight (any rank), "norm" a norm weight,
    "bias" a bias, "rope_long"/"rope_short" phi3's LongRoPE factors (the last four 1-D).
    d: model_dims(arch, ...); biases None: the arch's default (qwen2's Q/K/V biases); fused_qkv:
    one attn_qkv (Q, K, V rows at offsets 0, H*D, (H+Hkv)*D), phi3's default. options: {name: bool}
    of the MoE options "moe_bias" (router bias and selection bias) and "shexp" (granitemoe's optional
    shared expert; on by default). kind "router": a weight tiny.py writes in F32 (ffn_gate_inp)."""
    a = REGISTRY.get(arch, REGISTRY["llama"])
    on = {"untied": not tied,
          "biases": a.tiny_options.get("biases", False) if biases is None else biases,
          "fused_qkv": fused_qkv or a.tiny_options.get("fused_qkv", False),
          "moe_bias": a.tiny_options.get("moe_bias", False), "shexp": a.tiny_options.get("shexp", True)}
    on.update(options or {})

    def written(t):
        if t.tiny is None or t.refuse:
            return False
        if not t.tiny:
            return True
        return not on[t.tiny[1:]] if t.tiny.startswith("!") else on[t.tiny]

    model, layer = a.tensors(_dims(d, n_vocab))
    out = [(t.name, _init(t), tuple(t.shape)) for t in model if written(t)]
    for i in range(d["n_layer"]):
        out += [(f"blk.{i}." + t.name, _init(t), tuple(t.shape)) for t in layer if written(t)]
    return out


def write_tiny_gguf(path, qtype="F16", arch="llama", seed=0, tied=True, embd_qtype="F16",
                    n_ctx_train=512, freq_base=10000.0, eps=1e-5, chat_template=None, biases=None,
                    dims=None, extra=None, fused_qkv=False, arch_keys=None, split_max_tensors=0, options=None):
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
    written as "<arch>.<suffix>" (overriding these defaults; None drops the key). The MoE
    architectures (qwen3moe, qwen2moe, olmoe, granitemoe) take dims "n_expert", "n_expert_used",
    "n_ff_exp", "n_ff_shexp" and options (_plan); their routers are written in F32 (as llama.cpp's
    quantizer keeps ffn_gate_inp), their stacked experts as 3-D tensors.

    split_max_tensors > 0: a split GGUF (gguf-py's writer: PATHSTEM-00001-of-0000N.gguf, ...) of
    at most that many tensors a part; the first part's path is returned."""
    d = model_dims(arch, dims)
    a = REGISTRY.get(arch, REGISTRY["llama"])
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    tokens, types = tokens + list(a.tiny_tokens), types + [3] * len(a.tiny_tokens)
    path = str(path)
    w = gguf.GGUFWriter(pathlib.Path(path), arch, split_max_tensors=split_max_tensors)
    add_model_keys(w, arch, d, "tiny-test", n_ctx_train, freq_base, eps, arch_keys)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index(a.tiny_eos))
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    if extra is not None:
        extra(w)
    for name, kind, shape in _plan(arch, d, len(tokens), tied, biases, fused_qkv, options):
        n_in = shape[-1]
        if kind in ("w", "router"):
            emb = name == "token_embd.weight"
            t = "F32" if kind == "router" else embd_qtype if emb else qtype
            _add_weight(w, rng, name, int(np.prod(shape[:-1], dtype=np.int64)), n_in, t,
                        1.0 if emb else 1.0 / np.sqrt(n_in), lead=shape[:-2])
        elif kind == "norm":
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n_in)).astype(np.float32))
        elif kind == "bias":
            w.add_tensor(name, (0.1 * rng.standard_normal(n_in)).astype(np.float32))
        else:   # LongRoPE factors (>= 1 in real files)
            w.add_tensor(name, ((1.0 if kind == "rope_long" else 0.5) + rng.random(n_in) * 3).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(w.format_shard_names(pathlib.Path(path))[0])
