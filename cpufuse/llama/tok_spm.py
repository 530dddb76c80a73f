"""SentencePiece BPE (``tokenizer.ggml.model == "llama"``) for cpufuse.llama.tokenizer: a
pure-Python port of llama.cpp's score-heap SPM session (``<0xXX>`` byte fallback)."""
from __future__ import annotations

import heapq

__all__ = ["spm_byte_token", "spm_tokenize"]

_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)  # llama.cpp unicode_len_utf8


def spm_byte_token(token_to_id: dict, b: int) -> int:
    """the id of byte b: its ``<0xXX>`` token, else (ASCII) the one-character token"""
    tid = token_to_id.get("<0x%02X>" % b)
    if tid is None and b < 0x80:
        tid = token_to_id.get(chr(b))
    if tid is None:
        raise ValueError(f"SPM vocab has no byte token for 0x{b:02X}")
    return tid

def spm_tokenize(data: bytes, vocab: dict, scores: list, token_to_id: dict, out: list) -> None:
    """llama.cpp llm_tokenizer_spm_session::tokenize (score-heap BPE, byte fallback): appends to
    out the ids of data (UTF-8, spaces already escaped as U+2581); vocab maps a token's UTF-8 bytes
    to its id, scores[id] is its merge score, token_to_id (text -> id) gives the byte tokens."""
    start, size = [], []
    offs, L = 0, len(data)
    while offs < L:
        k = min(_UTF8_LEN[data[offs] >> 4], L - offs)
        start.append(offs)
        size.append(k)
        offs += k
    N = len(start)
    if N == 0:
        return
    prev = list(range(-1, N - 1))
    nxt = list(range(1, N + 1))
    nxt[-1] = -1
    heap: list = []
    rev: dict = {}

    def try_add(left, right):
        if left == -1 or right == -1:
            return
        txt = data[start[left]:start[left] + size[left] + size[right]]
        tid = vocab.get(txt)
        if tid is None:
            return
        heapq.heappush(heap, (-scores[tid], left, right, len(txt)))
        rev[txt] = (left, right)

    for i in range(1, N):
        try_add(i - 1, i)
    while heap:
        _, left, right, sz = heapq.heappop(heap)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != sz:
            continue
        size[left] += size[right]
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add(prev[left], left)
        try_add(left, nxt[left])

    def resegment(i, depth=0):
        txt = data[start[i]:start[i] + size[i]]
        tid = vocab.get(txt)
        if tid is not None:
            out.append(tid)
            return
        p = rev.get(txt)
        if p is None or depth > 64:
            out.extend(spm_byte_token(token_to_id, b) for b in txt)
            return
        resegment(p[0], depth + 1)
        resegment(p[1], depth + 1)

    i = 0
    while i != -1:
        resegment(i)
        i = nxt[i]
