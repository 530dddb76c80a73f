"""A GGUF decoder model (the architectures of cpufuse/llama/arch/) on cpufuse's
fused kernels (docs/semantics.md §10, docs/architectures.md).

    from cpufuse.llama import Model
    m = Model.load("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048, n_threads=2)
    r = m.generate([{"role": "user", "content": "Hi!"}], max_tokens=64, temperature=0)
    print(r.text, r.prompt_tps, r.decode_tps)
    for piece in m.generate("Once upon a time", stream=True): print(piece, end="")
    lg = m.logits(m.tokenize("Hello"))          # (n_tokens, n_vocab) float32, from an empty cache

The GGUF is read by cpufuse's own reader (`cpufuse.llama.gguf_file`: every length, offset and
size checked against the file before it is mapped), then memory-mapped, and every weight stays in
its file bytes as a `cpufuse.QTensor`; nothing is dequantized except the token-embedding rows a
batch needs (`Model.embed`). The hyperparameters and tensor shapes are checked against each other
at load. The parts: `hparams.py` reads the hyperparameters, `loader.py` the weights, this module
holds the Model (its KV cache, the forward pass, eval/logits and the API edge of generate), and
`generate.py` the generation loop and its result.

Token ids are range-checked once, where they enter: eval(), logits(), generate() and token_ids()
(the Llama API goes through them; the server's engines check their requests in submit()).
Everything below (the decoder's Batch, embed) trusts them.

Threads: one Model serializes its calls. generate(), eval(), logits() and reset() calls
from several threads take turns on an internal lock (a call waits while another
runs), so each returns what it would have returned alone. A stream (generate(stream=True)) holds
the lock only while it computes a token, never between tokens: a stream that is closed or simply
dropped leaves the model usable, and a stream resumed after another call changed the KV cache
raises RuntimeError instead of continuing from someone else's cache.

Forward pass: the decoder graph (`cpufuse.llama.decoder`, one builder per architecture) for a
batch of tokens, compiled once per capacity as a cpufuse.graph.DynamicPlan: a prompt micro-batch
(up to n_batch tokens) and a decode step are each ONE C call, whatever their length; a decode step
of eval() runs the plan with its inputs bound once (decoder.Step), so its Python is a few stores.
Per layer:
    q, k, v = matmul_multi(norm(x), Wq, Wk, Wv)   RMS_NORM fused into the matmul's prologue
    rope(q), rope(k) -> K cells; v -> V cells      f16 cache writes (kv_write)
    a = attention per sequence over its own cells  (attn_seqs: flash_attn, causal)
    x = x + a Wo;  x = x + swiglu(norm(x)) Wd      gate/up + SiLU*mul fused
then the logits of the rows wanted: matmul(norm(x[rows]), Whead) (Whead = token_embd when tied).
CPUFUSE_DISABLE_FUSION=1 or Model.load(fusion=False) keeps every node a separate kernel.

Weights: Model.load(repack=True, the default) lays each quantized weight out in cpufuse's P16
panels for the kernels (QTensor.repack; the same results bit for bit) and drops the file pages it
read from the process's memory, so RSS stays near the file size; repack=False keeps the mapping.
KV cache: `Model.kv` (cpufuse.llama.kv.KVCache), n_seq slots of n_ctx cells; the generate/eval
API uses slot 0, the server (cpufuse.serve.batch) all of them. Sliding-window layers (gemma) keep
a ring of window + n_batch cells per slot instead (docs/architectures.md).

Architectures: one module each in cpufuse/llama/arch/ (SUPPORTED_ARCHS, docs/architectures.md).
Anything else is refused with a ValueError naming the architecture.
"""
from __future__ import annotations

import math
import operator
import os
import threading

import numpy as np

from cpufuse import _backend, _dispatch, _registry
from cpufuse.ops.rope import rope
from cpufuse.quant.types import dequantize

from .decoder import Batch, Decoder, Step
from .generate import GenerationResult, Streamer, decode
from .hparams import MAX_N_CTX, SUPPORTED_ARCHS, HParams, read_hparams
from .kv import KVCache, check_type
from .kv import int_arg as _int_arg
from .loader import load_weights, repack_weights

__all__ = ["Model", "HParams", "GenerationResult", "SUPPORTED_ARCHS"]

F32 = np.float32
DEFAULT_N_CTX = 2048
DEFAULT_N_BATCH = 512
MAX_N_SEQ = 1024           # KV slots


# ------------------------------------------------------------------------------------------------

class Model:
    """A loaded GGUF model with its KV cache (one sequence). Calls from several threads are
    serialized (see the module docstring); a paused stream is invalidated by any other call."""

    def __init__(self):
        raise TypeError("use Model.load(path, ...)")

    # -------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, path, n_ctx=DEFAULT_N_CTX, n_threads=None, kv_dtype="f16", act=None,
             n_batch=DEFAULT_N_BATCH, rope_ggml_compat=False, isa=None, repack=True, fusion=None, n_seq=1,
             progress=None, type_k=None, type_v=None):
        """Memory-map the GGUF at `path` and prepare a KV cache of n_ctx cells per sequence.

        n_ctx: the context size (KV cells); 0 or None = the model's context_length.
        n_threads: threads for every kernel (None: cpufuse's default, see cpufuse.set_num_threads).
        type_k, type_v: the K and V cells' types, "f16" (llama.cpp's default), "f32", "q8_0" or "q4_0"
        (blocks of 32 along each head; llama.cpp's -ctk / -ctv; docs/kv.md); None: kv_dtype, the
        shorthand for both ("f16" or "f32"; or a block type). act: the matmul activation mode, "q8"
        (default, as llama.cpp) or "f32" (exact f32 activations). n_batch: the largest micro-batch
        a prompt is processed in (longer prompts are split). rope_ggml_compat: use ggml's f32
        angle chain (bit-compatible with llama.cpp) instead of cpufuse's float64 angles.
        isa: force a cpufuse ISA for every kernel (None = auto). repack: lay the quantized
        weights out for the kernels (QTensor.repack: P16 panels, the same results bit for bit) and
        release the file pages they were read from; False keeps them in the memory-mapped file. A
        mixture of experts whose weights would not fit the available memory keeps its stacked
        experts mapped even with repack (experts_mapped; docs/moe.md).
        fusion: False (or CPUFUSE_DISABLE_FUSION=1 with None) runs every op of the decoder graph as
        its own kernel. n_seq: KV slots (sequences held at once; the server's --parallel).
        progress: None, or a callable(done, total) called as the weights are repacked, layer by
        layer (the CLI draws its progress line with it).

        The file is read with cpufuse's own GGUF reader (cpufuse.llama.gguf_file), which checks
        its layout before mapping it; then the hyperparameters and every tensor's shape are
        checked against each other. Bad files and arguments raise ValueError (NotImplementedError
        for a weight type or tokenizer cpufuse does not support) naming the key or tensor."""
        from .gguf_file import GGUFFile

        check_type(kv_dtype, "kv_dtype")
        type_k = kv_dtype if type_k is None else check_type(type_k, "type_k")
        type_v = kv_dtype if type_v is None else check_type(type_v, "type_v")
        if act not in (None, "q8", "f32"):
            raise ValueError(f"act must be None, 'q8' or 'f32', got {act!r}")
        n_threads = None if n_threads is None else _dispatch._check_threads(n_threads, "n_threads")
        if isa is not None:
            _dispatch.check_isa(isa)
        n_ctx = 0 if n_ctx is None else _int_arg(n_ctx, "n_ctx", 0, MAX_N_CTX)
        n_batch = _int_arg(n_batch, "n_batch", 1, MAX_N_CTX)
        n_seq = _int_arg(n_seq, "n_seq", 1, MAX_N_SEQ)
        if fusion is not None and not isinstance(fusion, (bool, np.bool_)):
            raise TypeError(f"fusion must be None, True or False, got {type(fusion).__name__}")

        self = object.__new__(cls)
        path = os.fspath(path)
        gf = GGUFFile(path)
        self.path = path
        self.act, self.isa, self.kv_dtype = act, isa, kv_dtype
        self.rope_ggml_compat = bool(rope_ggml_compat)
        self.n_threads = n_threads
        hp = self.hparams = read_hparams(gf)
        self.n_ctx = n_ctx = n_ctx or hp.n_ctx_train
        if n_ctx * n_seq > MAX_N_CTX:
            raise ValueError(f"n_ctx * n_seq must be <= {MAX_N_CTX} KV cells, got {n_ctx} * {n_seq}")
        self.n_seq = n_seq
        self.n_batch = min(n_batch, n_ctx)
        w = load_weights(gf, hp, n_ctx)
        self.repacked = bool(repack)
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be None or a callable(done, total), got {type(progress).__name__}")
        if repack:
            repack_weights(w, gf, isa, progress)
        # the weights: tok_embd, output_norm, output (tok_embd when tied), output_bias, n_logits,
        # rope_freqs, layers (cpufuse.llama.loader)
        for k, v in vars(w).items():
            setattr(self, k, v)
        te = self.tok_embd        # embed(): the C row decoder for a quantized GGUF-layout table
        native = (te.block_size > 1 and te.layout == "gguf" and te.raw.flags.c_contiguous
                  and _backend.lib is not None)
        self._dequant_rows = _registry.table("dequant_rows") if native else None
        self._embd_ptr = _backend.ffi.from_buffer("uint8_t[]", te.raw) if native else None

        # tokenizer (built from the same file's metadata)
        self._tokenizer = None
        self._tokenizer_error = None
        try:
            from .tokenizer import Tokenizer
            self._tokenizer = Tokenizer(gf)
        except (ValueError, NotImplementedError, ImportError) as e:   # a model without (supported)
            self._tokenizer_error = e                                  # tokenizer metadata runs on ids
        self._max_text = None if self._tokenizer is None else n_ctx * self._tokenizer.max_piece_bytes

        # cpufuse.rope's keyword arguments for this model's layers (the decoder's SWA layers swap in
        # their own base and scale)
        self.rope_kw = dict(n_dims=hp.n_rot, mode=hp.rope_mode, freq_base=hp.freq_base,
                            freq_scale=hp.freq_scale, ext_factor=hp.ext_factor, attn_factor=hp.attn_factor,
                            n_ctx_orig=hp.n_ctx_orig, freq_factors=self.rope_freqs,
                            ggml_compat=self.rope_ggml_compat, isa=isa, n_threads=self.n_threads)
        self.decoder = Decoder(self, fusion=fusion, isa=isa)
        self._step = None                # decoder.Step, made at the first decode step
        # Keep no reference to the parsed metadata (the vocabulary's strings, tens of MB on a large
        # vocab): the weights are views of the file's memory map, which keeps it alive; the
        # tokenizer has its copy. gguf_version/alignment/data_offset stay for inspection.
        self.gguf_version, self.gguf_alignment = gf.version, gf.alignment
        self._lock = threading.RLock()   # every call that touches the KV cache or the buffers
        self._epoch = 0                  # bumped by every such call: a paused stream checks it
        # the KV cells: n_seq slots of n_ctx, rings on sliding-window layers (cpufuse.llama.kv)
        self.kv = KVCache.for_model(hp, n_ctx, n_seq, self.n_batch, type_k, type_v)
        self.reset()
        return self

    @property
    def kv_bytes(self):
        """bytes of the KV cache (K and V, every layer)"""
        return self.kv.nbytes

    @property
    def k_cache(self):
        """the K cells (KVCache.k): an (n_layer, n_seq * n_ctx, n_kv_heads, head_dim) array, or a
        list of per-layer arrays when sliding-window layers keep rings"""
        return self.kv.k

    @property
    def v_cache(self):
        """the V cells (KVCache.v), laid out as k_cache"""
        return self.kv.v

    def plan(self, n_tokens=1, all_logits=False):
        """The compiled decoder plan (cpufuse.graph.DynamicPlan) a micro-batch of n_tokens runs on,
        e.g. to read `.plan.describe()`: which ops were fused and the C calls."""
        return self.decoder.plan(*self._cap(int(n_tokens), all_logits))

    def _cap(self, n, all_logits):
        """plan capacities (tokens, logits rows, sequences): one exact plan for decode steps, one
        dynamic plan of n_batch tokens for prompts (last token's logits, or all of them)"""
        if n == 1:
            return 1, 1, 1
        B = self.n_batch
        return B, (B if all_logits else 1), 1

    # ------------------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise RuntimeError(f"this GGUF has no usable tokenizer: {self._tokenizer_error}")
        return self._tokenizer

    @property
    def n_vocab(self):
        return self.hparams.n_vocab

    @property
    def n_past(self):
        """tokens currently held in the KV cache"""
        return self._n_past

    @property
    def eog_ids(self):
        return self.tokenizer.eog_ids if self._tokenizer is not None else frozenset()

    def __repr__(self):
        hp, kv = self.hparams, self.kv
        kvt = kv.type_k if kv.type_k == kv.type_v else f"{kv.type_k}/{kv.type_v}"
        return (f"Model({os.path.basename(self.path)!r}, arch={hp.arch}, n_layer={hp.n_layer}, "
                f"n_embd={hp.n_embd}, heads={hp.n_head}/{hp.n_head_kv}, n_ff={hp.n_ff}, n_vocab={hp.n_vocab}, "
                f"n_ctx={self.n_ctx}, kv={kvt}, weights={self.layers[0].wq.qtype})")

    # ------------------------------------------------------------------------------- tokenizer
    def tokenize(self, text, add_bos=None, special=False):
        """Token ids of `text` (str or bytes). Text longer than the context could ever hold is
        refused before it is tokenized: ValueError when it has more than n_ctx x the longest
        token piece (`max_text_len`) characters (bytes for bytes): each token stands for at most
        that many bytes of text, each character for at least one."""
        tok = self.tokenizer
        self._check_text(text)
        return tok.tokenize(text, add_bos=add_bos, special=special)

    @property
    def max_text_len(self):
        """the longest prompt text (characters, or bytes) tokenize() and generate() accept"""
        return self._max_text

    def _check_text(self, text, what="text"):
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"{what} must be a str or bytes, got {type(text).__name__}")
        if len(text) > self._max_text:
            raise ValueError(f"{what} is too long for the context: {len(text)} {'characters' if isinstance(text, str) else 'bytes'} "
                             f"> n_ctx {self.n_ctx} x {self.tokenizer.max_piece_bytes} (the longest token "
                             f"piece, in bytes) = {self._max_text}; it could never fit in n_ctx tokens")

    def detokenize(self, ids, special=False):
        return self.tokenizer.detokenize(ids, special=special)

    # --------------------------------------------------------------------------------- forward
    def reset(self):
        """Forget the KV cache contents (cells are overwritten lazily)."""
        with self._lock:
            self._epoch += 1
            self._n_past = 0
            self._cached = []        # the token ids whose K/V are in the cache, in order

    def shift_context(self, n_keep=0):
        """llama.cpp's context shift on the full cache: keep the first n_keep positions, drop half of the
        rest (n_discard = (n_past - n_keep) // 2), move the later cells down and re-rotate their K by
        -n_discard positions (RoPE with unit magnitude: the angle is linear in the position, YaRN's
        ramp included). Returns n_discard. ValueError where it cannot apply: a cache with
        sliding-window rings, or n_keep >= n_past - 1."""
        n_keep = _int_arg(n_keep, "n_keep", 0, self.n_ctx)
        with self._lock:
            n_discard = self.shift_slot(0, n_keep, self._n_past)
            self._epoch += 1
            self._n_past -= n_discard
            del self._cached[n_keep:n_keep + n_discard]
            return n_discard

    def shift_slot(self, slot, n_keep, n_past):
        """shift_context's cell work on KV slot `slot` holding n_past positions, for an owner of the
        slots (the server's BatchEngine): the Model's own sequence state is not touched. Returns
        n_discard = (n_past - n_keep) // 2; ValueError when that is 0 or the cache has rings."""
        n_discard = (n_past - n_keep) // 2
        if n_discard < 1:
            raise ValueError(f"context shift: n_keep={n_keep} leaves nothing to drop of {n_past} positions")
        kw = dict(self.rope_kw, attn_factor=1.0)
        if kw["ext_factor"] != 0.0:   # rope_yarn multiplies by 1 + 0.1 ln(1/freq_scale): undo it
            kw["attn_factor"] = 1.0 / (1.0 + 0.1 * math.log(1.0 / kw["freq_scale"]))

        def rotate(k, delta):
            return rope(k, np.full(len(k), delta, np.int32), **kw)
        self.kv.shift(slot, n_keep, n_discard, n_past, rotate)
        return n_discard

    def embed(self, ids, out=None):
        """The token-embedding rows of `ids` (GET_ROWS: only these rows are dequantized), as
        float32 (len(ids), n_embd), written into `out` when given. The ids' range is not checked
        here (the API edges did: eval, logits, generate, token_ids, the engines' submit); the C
        path refuses an id outside the table (IndexError) rather than read past it. Quantized
        rows are decoded by the C kernel cf_dequant_rows_f32, float ones (and isa="numba") by
        cpufuse.quant.types.dequantize: the same values bit for bit."""
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        n, K = ids.shape[0], self.tok_embd.n_in
        direct = out is not None and out.dtype == F32 and out.shape == (n, K) and out.flags.c_contiguous
        res = out if direct else np.empty((n, K), F32)
        self.embedder(ids, res)()
        if out is not None and res is not out:
            out[...] = res
        return out if out is not None else res

    def embedder(self, ids, out):
        """embed() bound to these arrays, an int64 vector `ids` and a C-contiguous float32
        (len(ids), n_embd) array `out`: a callable that writes into out the rows of the ids that
        ids holds when it is called (decoder.Step writes each token's id into ids)."""
        te = self.tok_embd
        fn = self._dequant_rows.get(_dispatch.resolve(self.isa)) if self._dequant_rows else None
        if fn is None:
            def rows():
                out[...] = dequantize(te.raw[ids], te.qtype, te.n_in)
            return rows
        ffi = _backend.ffi
        args = (te.type_id, te.n_in, self._embd_ptr, te.n_out, te.row_bytes, ffi.from_buffer("int64_t[]", ids),
                ids.shape[0], ffi.from_buffer("float[]", out, require_writable=True))

        def rows():
            if fn(*args):
                raise IndexError(f"token id outside the embedding table [0, {te.n_out})")
        return rows

    def _forward(self, tokens, all_logits_out=None, step_out=None):
        """Run one micro-batch (len(tokens) <= n_batch) at positions n_past.. of slot 0 through the
        decoder graph and append it to the cache. Returns the last position's logits (1, n_vocab)
        (the plan's buffer; with step_out, that (1, n_logits) array: for one token the head writes
        it, else the row is copied in), or writes every position's into all_logits_out (n, n_vocab)."""
        n = len(tokens)
        pos0 = self._n_past
        if pos0 + n > self.n_ctx:
            raise ValueError(f"context overflow: {pos0} cached + {n} new tokens = {pos0 + n} > n_ctx = "
                             f"{self.n_ctx} (load the model with a larger n_ctx, or call reset())")
        if n == 1 and all_logits_out is None:   # a decode step: the plan's inputs bound once
            if self._step is None:
                self._step = Step(self)
            out = self._step(tokens[0], pos0, self.n_threads, step_out)
            self._n_past = pos0 + 1
            self._cached.append(int(tokens[0]))
            return out
        b = Batch(self)
        b.add(0, tokens, pos0, logits=False)
        b.idx = list(range(n)) if all_logits_out is not None else [n - 1]
        out = b.run(self.decoder, self._cap(n, all_logits_out is not None), n_threads=self.n_threads)
        self._n_past = pos0 + n
        self._cached.extend(int(t) for t in tokens)
        if all_logits_out is not None:
            all_logits_out[...] = out
            return all_logits_out
        if step_out is not None:
            step_out[...] = out
            return step_out
        return out

    def eval(self, tokens, logits_all=False):
        """Append `tokens` to the cache (in micro-batches of n_batch) and return the logits as a
        new float32 array: of the last token, (n_vocab,), or with logits_all (len(tokens),
        n_vocab)."""
        if type(tokens) is list and len(tokens) == 1 and not logits_all:
            t = tokens[0]   # a decode step: its one id checked here, straight to _forward (each line of the
            if type(t) is int and 0 <= t < self.hparams.n_vocab:   # general path is cache misses after a token)
                with self._lock:
                    self._epoch += 1   # the head writes the returned array itself (no copy of the row)
                    row = np.empty(self.n_logits, F32)
                    self._forward(tokens, step_out=row.reshape(1, -1))
                    return row
        tokens = self.token_ids(tokens, "tokens")
        with self._lock:
            self._epoch += 1
            out = self._eval(tokens, logits_all)
            return out if logits_all else out.copy()

    def token_ids(self, tokens, what="tokens"):
        """`tokens` (a sequence of integers, or an integer array) as a list of ints, each checked to
        be in [0, n_vocab): TypeError / ValueError naming `what`. The one range check of every id
        entering the model (eval, logits, generate and the Llama API go through it)."""
        if isinstance(tokens, np.ndarray):
            tokens = tokens.tolist()
        try:
            tokens = [operator.index(t) for t in tokens]
        except TypeError:
            raise TypeError(f"{what} must be a sequence of integer token ids, got "
                            f"{type(tokens).__name__}") from None
        n = self.hparams.n_vocab
        if tokens and not (0 <= min(tokens) and max(tokens) < n):
            bad = next(t for t in tokens if not 0 <= t < n)
            raise ValueError(f"token id {bad} out of range [0, {n})")
        return tokens

    def _eval(self, tokens, logits_all=False):
        """eval() under the lock: the last token's logits are a view of the model's buffer"""
        if not tokens:
            raise ValueError("eval: no tokens")
        if self._n_past + len(tokens) > self.n_ctx:
            raise ValueError(f"context overflow: {self._n_past} cached + {len(tokens)} new tokens = "
                             f"{self._n_past + len(tokens)} > n_ctx = {self.n_ctx} "
                             f"(load the model with a larger n_ctx, or call reset())")
        B = self.n_batch
        if logits_all:
            res = np.empty((len(tokens), self.n_logits), F32)
            for s in range(0, len(tokens), B):
                self._forward(tokens[s:s + B], all_logits_out=res[s:s + B])
            return res
        for s in range(0, len(tokens), B):
            out = self._forward(tokens[s:s + B])
        return out[0]

    def save_kv(self, path):
        """Write slot 0's tokens and KV cells to `path` (cpufuse.llama.state: the format, and the
        checks load_kv makes). Returns the bytes written."""
        from .state import save_file
        with self._lock:
            return save_file(self, path)

    def load_kv(self, path):
        """Restore a save_kv file of this model into slot 0 (the file is untrusted input: a
        ValueError names what does not match); the next eval continues bit for bit as if the
        saved sequence had never stopped. Returns the number of tokens restored."""
        from .state import load_file
        with self._lock:
            self._epoch += 1
            return len(load_file(self, path))

    def logits(self, tokens):
        """(len(tokens), n_vocab) float32 logits of every position, from an empty cache."""
        tokens = self.token_ids(tokens, "tokens")
        with self._lock:
            self.reset()
            return self._eval(tokens, logits_all=True)

    # ------------------------------------------------------------------------------ generation
    def prompt_ids(self, prompt):
        """The token ids of a generate() prompt: text (tokenized with special=True), token ids
        (checked: token_ids), or chat messages (rendered with the GGUF chat template)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_bos=None, special=True)
        if isinstance(prompt, (bytes, bytearray)):
            return self.tokenize(bytes(prompt), add_bos=None, special=True)
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            if prompt and all(isinstance(m, dict) for m in prompt):
                from .chat import chat_prompt
                text = chat_prompt(self.tokenizer, list(prompt), add_generation_prompt=True,
                                   max_chars=self._max_text)
                return self.tokenize(text, add_bos=False, special=True)
            if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
                return self.token_ids(prompt, "prompt")
        raise TypeError("prompt must be a str, a list of token ids, or a list of chat messages "
                        "({'role': ..., 'content': ...} dicts)")

    def generate(self, prompt, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                 repeat_penalty=1.0, seed=None, stream=False, penalty_last_n=64, stop_at_eog=True,
                 reuse_cache=True, sampler=None, stop=None, response_format=None, grammar=None, tools=None,
                 tool_choice=None, parallel_tool_calls=None, logit_bias=None, draft=None, context_shift=False,
                 n_keep=0):
        """Generate up to max_tokens after `prompt` (text; token ids; or chat messages rendered with
        the GGUF chat template and tokenized with special=True). Sampling is llama.cpp's common
        chain (penalties, top-k, top-p, min-p, temperature, dist; see cpufuse.llama.sampling);
        temperature 0 is greedy. Stops at an end-of-generation token (not included).

        stream=False: returns a GenerationResult (.tokens, .text, .prompt_tps, .decode_tps, ...).
        stream=True: returns an iterator of text pieces; its .result is set when it is exhausted.
        reuse_cache: keep the KV cells of the longest common prefix with the previous sequence.
        stop: a string or a list of strings; the text ends before the first one that appears (it
        never shows, not even in a stream: text that could begin one is held back until it is
        decided) and generation stops there with stop_reason "stop". The tokens that made it stay
        in .tokens (and count in decode_tokens), as llama-cpp-python counts them.
        Arguments are checked here, before anything runs (ValueError naming the argument).
        response_format / grammar (GBNF) / tools + tool_choice (+ parallel_tool_calls) constrain the output and
        logit_bias ({token id: bias}) shifts it (see cpufuse.llama.guide); with tools, chat messages are
        rendered with them and the result's .tool_calls holds the calls parsed from the text (a stream's
        .tool_spec is the ToolSpec, for cpufuse.llama.tools.ToolStream).

        draft: speculative decoding, which changes no token (cpufuse.llama.speculative): None, an
        int N (prompt lookup of up to N tokens), a LlamaPromptLookupDecoding or a DraftModel. The
        result's draft_tokens / draft_accepted count the drafted and accepted ids.

        Threads: a call waits while another call on this Model runs. A stream computes each token
        under the model's lock and releases it before yielding the text; if another call changes
        the KV cache between two of its tokens, the stream raises RuntimeError on its next step.
        """
        from .sampling import Sampler
        from .stops import check_stop
        max_tokens = _int_arg(max_tokens, "max_tokens", 0, 1 << 31)
        stop = check_stop(stop)
        if draft is not None:
            from .speculative import check_draft
            draft = check_draft(draft, self)
        if sampler is None:
            sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, penalty_last_n=penalty_last_n, seed=seed)
        spec = None
        if any(a is not None for a in (response_format, grammar, tools, tool_choice, parallel_tool_calls,
                                       logit_bias)):
            from .guide import guide_generate
            prompt, sampler, spec = guide_generate(self, prompt, sampler, response_format=response_format,
                                                   grammar=grammar, tools=tools, tool_choice=tool_choice,
                                                   parallel_tool_calls=parallel_tool_calls, logit_bias=logit_bias)
        ids = self.prompt_ids(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) > self.n_ctx:
            raise ValueError(f"context overflow: the prompt has {len(ids)} tokens > n_ctx = {self.n_ctx}")
        if not isinstance(context_shift, bool):
            raise TypeError(f"context_shift must be a bool, got {type(context_shift).__name__}")
        n_keep = _int_arg(n_keep, "n_keep", 0, self.n_ctx)
        shift = (lambda: self.shift_context(n_keep)) if context_shift else None
        gen = decode(self, ids, max_tokens, sampler, stop_at_eog, reuse_cache, stop, draft, shift)
        if spec is not None:
            from .guide import with_tool_calls
            gen = with_tool_calls(gen, spec, self.tokenizer)
        if stream:
            st = Streamer(gen)
            st.tool_spec = spec
            return st
        with self._lock:            # the whole generation at once: no other call in between
            try:
                while True:
                    next(gen)
            except StopIteration as e:
                return e.value

