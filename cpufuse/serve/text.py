"""Text on top of the engine's token stream: incremental detokenization, stop strings and the
logprob entries that belong to the text sent.

Stop strings never leak: text that could be the start of a stop string (a suffix of the unsent
text equal to a prefix of one of them) is held back until the next piece decides, across token
boundaries; on a match the text from the stop string on is dropped. Incomplete UTF-8 at the end
of the stream is held back by the decoder (cpufuse.llama.tokenizer.StreamDecoder).

Each token has a start offset: the number of characters of the completion before its text. A
token's logprob entry is released once text past its start has been sent; when a stop string
matches, tokens that start at or after the match are dropped; at the end everything left is
released.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from cpufuse.llama.stops import StopMatcher
from cpufuse.llama.tokenizer import StreamDecoder

__all__ = ["StopMatcher", "TextAssembler"]   # StopMatcher lives in cpufuse.llama.stops


class TextAssembler:
    """One completion's text: push(TokenEvent) -> (text, released events, stopped);
    finish() -> (text, released events). Released events are (start offset, TokenEvent)."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), special: bool = False):
        self._dec = StreamDecoder(tokenizer, special=special)   # special: control tokens' texts too
        self._stop = StopMatcher(stops)
        self.total = 0          # characters decoded
        self.sent = 0           # characters sent
        self.stopped = False
        self._pending: List[tuple] = []

    def _release(self, all_: bool = False) -> list:
        if all_:
            out, self._pending = self._pending, []
            return out
        k = 0
        while k < len(self._pending) and self._pending[k][0] < self.sent:
            k += 1
        out, self._pending = self._pending[:k], self._pending[k:]
        return out

    def push(self, ev) -> Tuple[str, list, bool]:
        if self.stopped:
            return "", [], True
        piece = self._dec.push(ev.token)
        self._pending.append((self.total, ev))
        self.total += len(piece)
        text, self.stopped = self._stop.push(piece)
        self.sent += len(text)
        rel = self._release()
        if self.stopped:
            self._pending = []
        return text, rel, self.stopped

    def finish(self) -> Tuple[str, list]:
        if self.stopped:
            return "", []
        text, self.stopped = self._stop.push(self._dec.flush())
        if not self.stopped:
            text += self._stop.flush()
        self.sent += len(text)
        rel = self._release(all_=not self.stopped)
        self._pending = []
        return text, rel
