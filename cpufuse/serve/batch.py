"""`BatchEngine`: continuous batching on the multi-sequence decoder graph (docs/serve.md).

One engine thread owns the model. Each step it builds ONE batch for one decoder call
(`cpufuse.llama.decoder.Batch`): the next token of every sequence that is decoding, plus prompt
chunks of sequences still prefilling, up to a token budget per step, so running streams never
wait for a whole prompt. Each sequence has its own KV slot (`parallel` slots of n_ctx cells).

Batch invariance: a request's tokens are the same alone, with 15 others, or joining mid-way. Every
kernel computes a row independently of the other rows of its call (matmul, norms, RoPE: per row;
attention: per sequence, over exactly its own cells), and the only thing left that could depend on
the company is how a prompt is cut into chunks, since attention over a chunk of N tokens rounds
differently for small and large N. So chunks are a function of the request alone: they are aligned
to absolute positions (multiples of `chunk`), and the prompt cache reuses whole chunks only.

Prompt cache: a slot keeps the KV of the tokens it last evaluated after its request ends. A new
request takes the free slot whose cached tokens share the longest prefix with its prompt (the
least recently used one when none does) and skips the shared whole chunks (`cached_tokens`). A
running sequence that holds a longer shared prefix lends it: its cells are copied into the new
slot. A request whose prefix a running sequence is still evaluating waits until it is evaluated,
then copies it: the n choices of one request (n > 1) evaluate their prompt once. The memory
budget is the slots: parallel * n_ctx cells, allocated once.

Context: a sequence holds at most n_ctx positions (its slot's cells). By default (as llama-server)
a request asks for no more (Engine.check_request) and one that fills the context ends with
"length". With context_shift=True a decoding sequence whose next token would not fit shifts its
slot (Model.shift_slot, llama.cpp's --context-shift: keep n_keep, drop half of the rest, re-rotate
K) and goes on: its tokens are those of Model.generate(context_shift=True, n_keep=) alone, since
the shift happens at the same token and moves the same cells. The shifted cells are no longer
what evaluating their tokens writes, so the prompt cache (and a slot save) reuses only the first
n_keep tokens of a shifted slot.

Cancellation (`Handle.cancel`, a client that disconnects, a stop string) is seen at the start of
the next step: the sequence is dropped and its slot freed within one step.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import List, Optional

from .engine import Engine, EngineStopped, FinishEvent, Handle, TokenEvent, deliver, make_sampler, token_logprobs

__all__ = ["BatchEngine", "SerialEngine"]

DEFAULT_CHUNK = 128   # prompt chunk (tokens), aligned to absolute positions
DEFAULT_STEP_TOKENS = 128   # prompt tokens per step at most, besides the decoding sequences
_WAIT = object()            # a job that cannot run yet (_run_jobs)


@dataclasses.dataclass
class _Slot:
    index: int
    tokens: List[int] = dataclasses.field(default_factory=list)   # ids whose K/V the slot holds (positions 0..)
    busy: bool = False
    last_used: float = 0.0
    written: int = 0            # positions written past `tokens` (rejected drafts), for the rings' reuse
    exact: Optional[int] = None  # after a context shift: the leading tokens whose cells evaluation wrote

    def cached(self):
        """the tokens a later request may reuse (not the cells a context shift moved)"""
        return self.tokens if self.exact is None else self.tokens[:self.exact]

    def reset(self, tokens=()):
        self.tokens, self.exact, self.written = list(tokens), None, 0


class _Seq:
    __slots__ = ("h", "slot", "prompt", "done", "last", "n_gen", "sampler", "cached", "spec_cap", "shifted",
                 "n_shift")

    def __init__(self, h, slot, done):
        self.h, self.slot = h, slot
        self.prompt = [int(t) for t in h.request.prompt_ids]
        self.done = done            # prompt tokens evaluated (their K/V in the slot)
        self.last = None            # the last sampled token, to evaluate next (decode)
        self.n_gen = 0
        self.sampler = make_sampler(h.request.sampling, h.request.constraint)
        self.sampler.accept_prompt(self.prompt)
        self.cached = done
        self.spec_cap = 1 << 30     # the most ids to draft next (speculative decoding; adapts)
        self.shifted = 0            # positions context shifts dropped
        self.n_shift = 0            # context shifts

    @property
    def decoding(self):
        return self.done >= len(self.prompt)

    @property
    def pos(self):              # position of the next token to evaluate
        return len(self.prompt) + self.n_gen - 1 - self.shifted if self.decoding else self.done


class BatchEngine(Engine):
    """Continuous batching over `parallel` sequences of a `cpufuse.llama.Model` loaded with
    n_seq = parallel (see the module docstring). chunk: prompt chunk (tokens); step_tokens: the
    most prompt tokens evaluated per step besides the decoding sequences (>= chunk); mask_thread:
    fill the grammar masks of constrained sequences in a worker thread during the decoder step
    (False: before it, on the engine thread; the tokens are the same); slots: how many of the
    model's KV slots to use (None: all n_seq), the most sequences run at once. draft: speculative
    decoding per sequence (cpufuse.llama.speculative: an int N for prompt lookup of N ids, a
    LlamaPromptLookupDecoding or a DraftModel): each decoding sequence's drafted ids join the step
    as one-row groups, and the tokens are the same as without it (docs/speculative.md).
    context_shift: a sequence that fills its slot shifts it, keeping the first n_keep positions
    (see the module docstring); False: requests fit the context (llama-server's default)."""

    def __init__(self, model, model_name: Optional[str] = None, chunk: int = DEFAULT_CHUNK,
                 step_tokens: Optional[int] = DEFAULT_STEP_TOKENS, mask_thread: bool = True,
                 slots: Optional[int] = None, draft=None, context_shift: bool = False, n_keep: int = 0):
        name = model_name or os.path.splitext(os.path.basename(getattr(model, "path", "model")))[0]
        tok = model.tokenizer
        parallel = int(model.n_seq if slots is None else slots)
        if not 1 <= parallel <= model.n_seq:
            raise ValueError(f"slots must be in [1, the model's n_seq = {model.n_seq}], got {slots!r}")
        super().__init__(name, tok, model.n_ctx, model.n_vocab, model.eog_ids, parallel,
                         getattr(tok, "chat_template", None))
        if int(chunk) < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk!r}")
        if model.kv.ring_cells and int(chunk) > model.n_batch:
            raise ValueError(f"chunk must be <= the model's n_batch ({model.n_batch}) for its sliding-window "
                             f"layers' KV rings (window + n_batch cells), got {chunk!r}")
        self.model, self.model_path = model, getattr(model, "path", name)
        if not isinstance(context_shift, bool):
            raise TypeError(f"context_shift must be a bool, got {type(context_shift).__name__}")
        if isinstance(n_keep, bool) or not isinstance(n_keep, int) or not 0 <= n_keep <= model.n_ctx - 2:
            raise ValueError(f"n_keep must be an int in [0, n_ctx - 2 = {model.n_ctx - 2}] (a shift keeps n_keep "
                             f"positions and drops half of the rest), got {n_keep!r}")
        if context_shift and model.kv.ring_cells:
            raise ValueError("context_shift: this model's KV cache has sliding-window rings, which hold the last "
                             "window positions only and cannot shift; serve it without --context-shift")
        self.context_shift, self.n_keep = context_shift, n_keep
        self.chunk = int(chunk)
        self.step_tokens = max(self.chunk, int(step_tokens or self.chunk))
        from cpufuse.llama.speculative import check_draft
        self.draft = check_draft(draft, model)
        # a decoding sequence's step: its last token and up to draft_max drafted ids, one row each
        self.draft_max = 0 if self.draft is None else min(getattr(self.draft, "num_pred_tokens", 16),
                                                          model.n_batch - 1)
        rows = parallel * (1 + self.draft_max)
        self.cap = (self.step_tokens + rows, rows, rows)
        self.slots = [_Slot(i) for i in range(parallel)]
        self.seqs: List[_Seq] = []
        self._pool = None                  # the mask worker thread (made on the first constrained step)
        self.mask_thread = bool(mask_thread)   # False: the grammar masks are filled before the step, serially
        self._jobs = []                    # (future, fn): embeddings and slot actions (_job)

    @classmethod
    def load(cls, path: str, n_ctx: int = 2048, n_threads: Optional[int] = None, kv_dtype: str = "f16",
             model_name: Optional[str] = None, parallel: int = 4, chunk: int = DEFAULT_CHUNK,
             step_tokens: Optional[int] = DEFAULT_STEP_TOKENS, **load_kw):
        from cpufuse.llama import Model
        kw = {k: load_kw.pop(k) for k in ("draft", "context_shift", "n_keep") if k in load_kw}
        m = Model.load(path, n_ctx=n_ctx, n_threads=n_threads, kv_dtype=kv_dtype, n_seq=parallel, **load_kw)
        return cls(m, model_name=model_name, chunk=chunk, step_tokens=step_tokens, **kw)

    # ------------------------------------------------------------------ engine thread
    def stop(self, drain: float = 0.0) -> None:
        super().stop(drain)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for fut, *_ in jobs:
            fut.set_exception(EngineStopped("the engine stopped"))

    def _job(self, fn):
        """a concurrent.futures.Future of fn() run on the engine thread between steps (fn returns
        _WAIT to be tried again after the next step)"""
        import concurrent.futures
        fut = concurrent.futures.Future()
        with self._lock:
            if self._stopping or self._thread is None:
                raise EngineStopped("the engine is not running")
            self._jobs.append((fut, fn))
            self._wake.notify()
        return fut

    def embed(self, ids, pooling, norm=2):
        """A Future of the embedding of the token ids `ids` (checked by the caller: in range, 1..n_ctx
        of them), computed on the engine thread in the least recently used free KV slot between
        steps (cpufuse.llama.embedding.pooled; pooling: a name, not "rank")."""
        from cpufuse.llama.embedding import pooled

        def run():
            free = [s for s in self.slots if not s.busy]
            if not free:
                return _WAIT
            slot = min(free, key=lambda s: s.last_used)
            slot.reset()          # its cells hold this input, cut into other chunks: never a prompt-cache hit
            slot.last_used = time.monotonic()
            return pooled(self.model, slot.index, ids, pooling, norm)
        return self._job(run)

    def slot_action(self, index, action, path=None):
        """A Future of llama-server's slot action on KV slot `index` (on the engine thread): "save"
        its evaluated tokens and cells to `path`, "restore" them from `path` (the file checked
        against the model: cpufuse.llama.state), or "erase" them. The result is llama-server's
        counts ({"n_saved", "n_written"}, {"n_restored", "n_read"} or {"n_erased"}); a slot that
        runs a request is a ValueError."""
        from cpufuse.llama import state
        if action not in ("save", "restore", "erase"):
            raise ValueError(f"action must be 'save', 'restore' or 'erase', got {action!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.slots):
            raise ValueError(f"slot id must be in [0, {len(self.slots)}), got {index!r}")

        def run():
            s = self.slots[index]
            if s.busy:
                raise ValueError(f"slot {index} is running a request")
            if action == "save":       # (a shifted slot: the tokens before its shifted cells)
                toks = s.cached()
                return {"n_saved": len(toks),
                        "n_written": state.save_file(self.model, path, state.dump(self.model, index, toks))}
            if action == "restore":
                toks = state.load_file(self.model, path, index)
                s.reset(toks)
                s.last_used = time.monotonic()
                return {"n_restored": len(toks), "n_read": os.path.getsize(path)}
            n = len(s.tokens)
            s.reset()
            return {"n_erased": n}
        return self._job(run)

    def _run_jobs(self):
        """the waiting jobs, in order (the first that must wait holds the rest back)"""
        while True:
            with self._lock:
                if not self._jobs:
                    return
                fut, fn = self._jobs[0]
            try:
                r = fn()
            except Exception as e:  # noqa: BLE001 -- this job fails, the engine goes on
                r = e
            if r is _WAIT:
                return
            with self._lock:
                self._jobs.pop(0)
            if isinstance(r, Exception):
                fut.set_exception(r)
            else:
                fut.set_result(r)

    def _cancel_running(self) -> None:
        for s in list(self.seqs):
            s.h._cancel.set()
        with self._lock:
            self._wake.notify_all()

    def _shared(self, tokens, prompt):
        """the whole chunks of `prompt` (leaving >= 1 token to evaluate) that `tokens` starts with"""
        n = 0
        lim = min(len(tokens), len(prompt) - 1)
        while n < lim and tokens[n] == prompt[n]:
            n += 1
        return n // self.chunk * self.chunk       # whole chunks only (batch invariance)

    def _waits(self, h) -> bool:
        """h shares whole prompt chunks with a running sequence that has not evaluated them yet:
        it waits for them and copies their KV (n choices of one prompt, a shared system prompt)"""
        prompt = h.request.prompt_ids
        return self._lends() and any(not s.decoding and self._shared(s.prompt, prompt) > s.done for s in self.seqs)

    def _lends(self) -> bool:
        """running sequences lend their KV only with one full-size cache per layer (not with the
        sliding-window layers' rings, whose cells hold the last window positions only)"""
        return not self.model.kv.ring_cells

    def _admit(self):
        """queued requests into free slots. A request takes the free slot whose cached tokens
        share the longest prefix with its prompt; a running sequence's slot that shares more lends
        its KV (the cells are copied: a whole chunk's KV does not depend on its batch, so the copy
        equals evaluating it). A request whose prefix a running sequence is still evaluating waits
        for it (later requests may go first)."""
        while True:
            free = [s for s in self.slots if not s.busy]
            with self._lock:
                if not free or not self._queue:
                    return
                h = next((q for q in self._queue if q.cancelled or not self._waits(q)), None)
                if h is None:
                    return
                self._queue.remove(h)
            if h.cancelled:
                self._finish(h, "cancelled", 0)
                continue
            prompt = h.request.prompt_ids
            best, best_n = None, -1
            for s in free:
                n = self._shared(s.cached(), prompt)
                n = self.model.kv.reusable(n, max(len(s.tokens), s.written))   # 0 where a ring moved on
                if n > best_n or (n == best_n and s.last_used < best.last_used):
                    best, best_n = s, n
            src, src_n = None, best_n
            for q in (self.seqs if self._lends() else ()):   # running sequences: their evaluated tokens
                n = self._shared(q.slot.cached(), prompt)
                if n > src_n:
                    src, src_n = q.slot, n
            best.busy = True
            if src is not None:
                self.model.kv.copy_prefix(src.index, best.index, src_n, len(src.tokens))
                best.tokens = list(src.tokens[:src_n])
                best_n = src_n
            best.tokens, best.exact = best.tokens[:best_n], None
            seq = _Seq(h, best, best_n)
            h.cached_tokens = best_n
            self.seqs.append(seq)
            self._count(prompt_tokens=len(prompt), cached_prompt_tokens=best_n)

    def _release(self, seq):
        s = seq.slot
        s.busy, s.last_used = False, time.monotonic()
        self.seqs.remove(seq)
        self._set(active=len(self.seqs))

    def _run(self) -> None:
        self.model.reset()     # the Model's own API (slot 0) forgets its cache: the engine owns every slot
        while True:
            with self._lock:
                while not self._queue and not self.seqs and not self._stopping and not self._jobs:
                    self._wake.wait()
                if self._stopping and not self.seqs and not self._queue:
                    return
            self._admit()
            self._run_jobs()
            for s in [s for s in self.seqs if s.h.cancelled]:
                self._release(s)
                self._finish(s.h, "cancelled", s.n_gen, s.cached)
            self._set(active=len(self.seqs))
            if not self.seqs:
                continue
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 -- the step's requests fail, the engine goes on
                for s in list(self.seqs):
                    self._release(s)
                    self._finish(s.h, "error", s.n_gen, s.cached, error=f"{type(e).__name__}: {e}")

    def _step(self):
        from cpufuse.llama.decoder import Batch
        m = self.model
        b = Batch(m)
        owners = []
        dec = [s for s in self.seqs if s.decoding]
        for s in dec:                       # every decoding sequence: its next token (and drafts)
            if s.pos >= self.n_ctx:         # only with context_shift (else check_request bounds it)
                self._shift(s)
            d = self._drafts(s)
            for i, t in enumerate([s.last] + d):    # one-row groups: each row's attention is a decode step's
                b.add(s.slot.index, [t], s.pos + i, logits=True)
            s.slot.written = max(s.slot.written, s.pos + 1 + len(d))
            s.slot.tokens.append(s.last)
            owners.append((s, d))
        budget = self.step_tokens
        for s in self.seqs:              # prompt chunks, oldest request first, within the budget
            if s.decoding:
                continue
            end = min(len(s.prompt), (s.done // self.chunk + 1) * self.chunk)
            if end - s.done > budget:
                break
            last = end == len(s.prompt)
            b.add(s.slot.index, s.prompt[s.done:end], s.done, logits=last)
            s.slot.tokens += s.prompt[s.done:end]
            budget -= end - s.done
            s.done = end
            if last:
                owners.append((s, []))
        if not len(b):
            return
        # the grammar masks of this step's samples only depend on tokens already consumed: fill
        # them in a worker thread while the decoder runs (llguidance and cffi release the GIL);
        # those that sample() is likely to need (GuidedSampler.mask_ahead: greedy ones check the
        # top token first and want the mask only after a refusal)
        guided = [s.sampler for s, _ in owners if getattr(s.sampler, "mask_ahead", False)]
        if guided and not self.mask_thread:
            _fill_masks(guided)
            guided = []
        job = self._mask_pool().submit(_fill_masks, guided) if guided else None
        try:
            logits = b.run(m.decoder, self.cap, n_threads=m.n_threads)
        finally:
            if job is not None:
                job.result()
        self._count(steps=1)
        self._set(batch_size=len(b.seqs))
        events = []
        i = 0
        for s, d in owners:
            for j in range(len(d) + 1):      # the rows in order while the drafts match what is sampled
                tok = self._take(s, logits[i + j], events)
                if tok is None or j == len(d) or tok != d[j]:
                    break
                s.slot.tokens.append(tok)    # an accepted draft: its K/V is in the slot
            if d:
                from cpufuse.llama.speculative import next_cap
                s.spec_cap = next_cap(s.spec_cap, len(d), j)
                self._count(draft_tokens=len(d), draft_accepted=j)
            i += len(d) + 1
        deliver(events)

    def _shift(self, s):
        """llama.cpp's context shift of s's slot, whose n_ctx positions are all evaluated"""
        slot, k = s.slot, self.n_keep
        n = self.model.shift_slot(slot.index, k, s.pos)
        del slot.tokens[k:k + n]
        slot.exact = k if slot.exact is None else min(slot.exact, k)
        slot.written = max(0, slot.written - n)
        s.shifted += n
        s.n_shift += 1
        self._count(context_shifts=1)

    def _detail(self, s, reason):
        """the FinishEvent's detail (the request log's words)"""
        if s.n_shift:
            return f"{s.n_shift} context shift{'s' if s.n_shift > 1 else ''}"
        if reason == "length" and len(s.prompt) + s.n_gen >= self.n_ctx:
            return f"context full: n_ctx {self.n_ctx}"
        return None

    def _drafts(self, s):
        """the ids drafted after s.last (none without a draft, under a constraint, or without room)"""
        r = s.h.request
        k = min(self.draft_max, s.spec_cap, r.max_tokens - s.n_gen - 1, self.n_ctx - 1 - s.pos)
        if self.draft is None or k <= 0 or r.constraint is not None:
            return []
        from cpufuse.llama.speculative import draft_ids
        return draft_ids(self.draft, s.slot.tokens + [s.last], k, self.model.n_vocab)

    def _take(self, s, row, events):
        """sample s's next token from its logits row, record its event (and its finish); returns
        the token, or None when s finished without one (a stop id, an error)"""
        row = row.copy()
        r = s.h.request
        try:
            tok = s.sampler.sample(row)
        except Exception as e:  # noqa: BLE001 -- this request fails (its grammar), the others go on
            self._release(s)
            events.append((s.h, self._finish(s.h, "error", s.n_gen, s.cached, deliver_now=False,
                                              error=f"{type(e).__name__}: {e}")))
            return None
        if tok in r.stop_ids:
            self._release(s)
            events.append((s.h, self._finish(s.h, "stop", s.n_gen, s.cached, deliver_now=False,
                                              detail=self._detail(s, "stop"))))
            return None
        if r.logprobs is None:
            ev = TokenEvent(tok)
        else:
            lp, top = token_logprobs(row, tok, r.logprobs)
            ev = TokenEvent(tok, lp, top)
        s.n_gen += 1
        s.last = tok
        self._count(generated_tokens=1)
        events.append((s.h, ev))
        if s.n_gen >= r.max_tokens:
            self._release(s)
            events.append((s.h, self._finish(s.h, "length", s.n_gen, s.cached, deliver_now=False,
                                              detail=self._detail(s, "length"))))
            return None
        if getattr(s.sampler, "done", False):   # the grammar is complete: only a stop id can follow
            self._release(s)
            events.append((s.h, self._finish(s.h, "stop", s.n_gen, s.cached, deliver_now=False,
                                              detail=self._detail(s, "stop"))))
            return None
        return tok

    def _mask_pool(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"cpufuse-masks-{self.model_name}")
        return self._pool


def _fill_masks(samplers):
    """the next masks of GuidedSamplers (worker thread); a failure is left for sample() to report"""
    for g in samplers:
        try:
            g.compute_mask()
        except Exception:  # noqa: BLE001 -- sample() recomputes and raises for that request alone
            g._mask, g._ready = None, False


class SerialEngine(BatchEngine):
    """One request at a time: a BatchEngine on one KV slot, whose prompt chunks are the model's
    n_batch micro-batches (those of Model.eval), with no prompt cache (every request starts from
    an empty slot: cached_tokens 0). So its tokens are exactly
    `Model.generate(prompt_ids, reuse_cache=False, sampler=make_sampler(params))`'s. `parallel`
    is reported only."""

    def __init__(self, model, model_name: Optional[str] = None, parallel: int = 1, draft=None,
                 context_shift: bool = False, n_keep: int = 0):
        if int(parallel) < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel!r}")
        super().__init__(model, model_name, chunk=model.n_batch, step_tokens=model.n_batch, slots=1, draft=draft,
                         context_shift=context_shift, n_keep=n_keep)
        self.parallel = int(parallel)

    @classmethod
    def load(cls, path: str, n_ctx: int = 2048, n_threads: Optional[int] = None, kv_dtype: str = "f16",
             model_name: Optional[str] = None, parallel: int = 1, **load_kw) -> "SerialEngine":
        from cpufuse.llama import Model
        kw = {k: load_kw.pop(k) for k in ("draft", "context_shift", "n_keep") if k in load_kw}
        return cls(Model.load(path, n_ctx=n_ctx, n_threads=n_threads, kv_dtype=kv_dtype, **load_kw),
                   model_name=model_name, parallel=parallel, **kw)

    def _shared(self, tokens, prompt):
        return 0               # no prompt cache: nothing is reused, lent or waited for
