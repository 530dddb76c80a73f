"""Stop strings on a stream of text pieces (Model.generate(stop=...), the server's `stop`).

Text that could be the start of a stop string (a suffix of the unsent text equal to a prefix of one
of them) is held back until the next piece decides, across piece boundaries; on a match the text
from the stop string on is dropped, so a stop string never leaks.
"""
from __future__ import annotations

from typing import Sequence, Tuple

__all__ = ["StopMatcher", "check_stop"]


def check_stop(stop, what="stop"):
    """None, a str or a sequence of str -> a list of non-empty strings (TypeError/ValueError
    naming `what` otherwise)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (list, tuple)):
        stop = list(stop)
    else:
        raise TypeError(f"{what} must be None, a str or a list of str, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"{what} must be None, a str or a list of str, got a list holding "
                            f"{type(s).__name__} {s!r}")
        if not s:
            raise ValueError(f"{what}: stop strings must not be empty")
    return stop


class StopMatcher:
    """push(text) -> (text to send now, stopped); flush() -> the held-back rest (no match)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, text: str) -> Tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        first = -1
        for s in self.stops:
            k = self.buf.find(s)
            if k >= 0 and (first < 0 or k < first):
                first = k
        if first >= 0:
            out, self.buf = self.buf[:first], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.buf) - hold
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
