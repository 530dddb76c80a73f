"""The server's metrics and request log: HTTP counters by path and status, the Prometheus text of
/metrics (engine counters and gauges, cpufuse.serve.engine.EngineStats), and llama-server's kind of
one-line request log.
"""
from __future__ import annotations

import time

__all__ = ["Metrics", "log_line", "log_user"]


class Metrics:
    """HTTP counters of one app; `prometheus(engine)` is the /metrics text."""

    def __init__(self):
        self.http = {}                       # (path, status) -> count

    def count(self, path: str, status: int) -> None:
        k = (path, int(status))
        self.http[k] = self.http.get(k, 0) + 1

    def prometheus(self, engine) -> str:
        s = engine.stats()
        lines = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP cpufuse_{name} {help_}")
            lines.append(f"# TYPE cpufuse_{name} {kind}")
            for labels, v in samples:
                lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
                lines.append(f"cpufuse_{name}{{{lab}}} {v}" if lab else f"cpufuse_{name} {v}")

        metric("http_requests_total", "counter", "HTTP requests answered, by path and status",
               [({"path": p, "status": st}, n) for (p, st), n in sorted(self.http.items())])
        metric("requests_submitted_total", "counter", "requests submitted to the engine",
               [({}, s.requests_submitted)])
        metric("requests_finished_total", "counter", "engine requests finished, by finish reason",
               [({"reason": r}, s.requests_finished.get(r, 0)) for r in ("stop", "length", "cancelled", "error")])
        metric("prompt_tokens_total", "counter", "prompt tokens of the requests started", [({}, s.prompt_tokens)])
        metric("prompt_tokens_cached_total", "counter", "prompt tokens served from the prompt cache",
               [({}, s.cached_prompt_tokens)])
        metric("generation_tokens_total", "counter", "tokens generated", [({}, s.generated_tokens)])
        metric("draft_tokens_total", "counter", "ids drafted (speculative decoding)", [({}, s.draft_tokens)])
        metric("draft_tokens_accepted_total", "counter", "drafted ids accepted", [({}, s.draft_accepted)])
        metric("decode_steps_total", "counter", "engine decode steps", [({}, s.steps)])
        metric("context_shifts_total", "counter", "context shifts (--context-shift)", [({}, s.context_shifts)])
        metric("requests_waiting", "gauge", "requests queued, not started (queue depth)", [({}, s.queue_depth)])
        metric("requests_running", "gauge", "sequences running (active)", [({}, s.active)])
        metric("batch_size", "gauge", "sequences in the last decode step", [({}, s.batch_size)])
        metric("parallel", "gauge", "the most sequences run at once", [({}, s.parallel)])
        metric("n_ctx", "gauge", "context size of one sequence", [({}, engine.n_ctx)])
        return "\n".join(lines) + "\n"



def log_user(st: dict, *ids) -> None:
    """a request's `user` (and `safety_identifier`) go into its log line"""
    who = [x for x in ids if x]
    if who:
        st["user"] = " / ".join(who)


def log_line(method, path, status, st, reason=None) -> str:
    """llama-server's kind of request line: status, the reason of an error, tokens, timings"""
    now = time.perf_counter()
    parts = [f"{method} {path} {status}"]
    if st.get("user"):
        parts.append(f"user {st['user']!r}")
    if reason:
        parts.append(reason)
    u = st.get("usage")
    if u:
        tf = st.get("t_first", now)
        ttft, gen = (tf - st["t0"]) * 1e3, (now - tf) * 1e3
        c = u["completion_tokens"]
        rate = f", {(c - 1) / (gen / 1e3):.1f} tok/s" if c > 1 and gen > 0 else ""
        why = f" ({st['finish_detail']})" if st.get("finish_detail") else ""
        parts.append(f"prompt {u['prompt_tokens']} tok ({u['prompt_tokens_details']['cached_tokens']} cached), "
                     f"completion {c} tok, {st.get('finish')}{why}")
        parts.append(f"first token {ttft:.1f} ms, generation {gen:.1f} ms{rate}")
    if "t0" in st:
        parts.append(f"total {(now - st['t0']) * 1e3:.1f} ms")
    return " | ".join(parts)
