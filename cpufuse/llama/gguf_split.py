"""Split GGUFs: `PREFIX-00001-of-0000N.gguf` .. `PREFIX-0000N-of-0000N.gguf` read as one model
(llama.cpp's gguf-split layout).

Every part is a complete GGUF file with its own header, keys and tensor infos, read and checked by
GGUFFile as untrusted input. Every part carries `split.no` (uint16, 0-based), `split.count`
(uint16) and `split.tensors.count` (int32, the tensors of all parts). The first part carries the
model's keys, and the tensors are spread over the parts. `join(first)` runs when GGUFFile opens a
file whose `split.count` is above 1. It requires the following, and raises a ValueError naming the
part otherwise:

* the file given is the first part (`split.no` 0), named `PREFIX-00001-of-NNNNN.gguf` with NNNNN =
  `split.count`;
* every other part exists under its name and is a valid GGUF;
* its `split.no` is its index, its `split.count` and `split.tensors.count` are the first part's,
  and its GGUF version is the first part's;
* no tensor name appears in two parts, and the parts hold `split.tensors.count` tensors in all.

The joined GGUFFile has the first part's keys and every part's tensors, each a view of its own
part's mapping. `parts` lists the part GGUFFiles, the first part first.
"""
from __future__ import annotations

import os
import re

__all__ = ["join", "split_path", "split_paths", "SPLIT_RE", "MAX_SPLITS"]

KEY_NO, KEY_COUNT, KEY_TENSORS = "split.no", "split.count", "split.tensors.count"
MAX_SPLITS = 9999                      # the name has 5 digits; llama.cpp's writer stops far below
SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_path(prefix, i, n):
    """llama.cpp's name of part i (1-based) of n: PREFIX-0000i-of-0000n.gguf"""
    return f"{prefix}-{i:05d}-of-{n:05d}.gguf"


def split_paths(path):
    """the paths of every part of the split GGUF whose part `path` is, or [path] if its name is not
    a part's"""
    m = SPLIT_RE.search(path)
    if not m:
        return [path]
    n = int(m.group(2))
    return [split_path(path[:m.start()], i, n) for i in range(1, n + 1)]


def _int_key(gf, key, lo, hi, part):
    if key not in gf.kv:
        raise ValueError(f"split GGUF {part}: key {key!r} is missing")
    v = gf.kv[key]
    if not gf.is_int(key) or not lo <= v <= hi:
        raise ValueError(f"split GGUF {part}: {key} = {v!r} ({gf.value_type(key)}), expected an integer in "
                         f"[{lo}, {hi}]")
    return int(v)


def join(first):
    """Add the other parts' tensors to GGUFFile `first` (the first part; see the module docstring).
    The parts are read with first's own class (GGUFFile(path, split=False))."""
    GGUFFile = type(first)
    path = first.path
    n = _int_key(first, KEY_COUNT, 1, MAX_SPLITS, path)
    no = _int_key(first, KEY_NO, 0, n - 1, path)
    total = _int_key(first, KEY_TENSORS, 0, 1 << 31, path)
    first.parts = [first]
    if n == 1:
        _check_total(first, total)
        return
    if no != 0:
        raise ValueError(f"split GGUF {path} is part {no + 1} of {n}: load the first part "
                         f"(...-00001-of-{n:05d}.gguf), which names the others")
    m = SPLIT_RE.search(path)
    if not m or int(m.group(1)) != 1 or int(m.group(2)) != n:
        raise ValueError(f"split GGUF {path}: split.count = {n}, but the file is not named "
                         f"PREFIX-00001-of-{n:05d}.gguf, so its other parts cannot be found")
    prefix = path[:m.start()]
    for i in range(2, n + 1):
        p = split_path(prefix, i, n)
        if not os.path.exists(p):
            raise ValueError(f"split GGUF: part {i} of {n} is missing: {p}")
        try:
            part = GGUFFile(p, split=False)
        except ValueError as e:
            raise ValueError(f"split GGUF part {i} of {n} ({p}): {e}") from None
        got = (_int_key(part, KEY_NO, 0, n - 1, p), _int_key(part, KEY_COUNT, 1, MAX_SPLITS, p),
               _int_key(part, KEY_TENSORS, 0, 1 << 31, p))
        if got != (i - 1, n, total):
            raise ValueError(f"split GGUF part {i} of {n} ({p}): split.no/count/tensors.count = {got}, expected "
                             f"{(i - 1, n, total)} (a part of another split?)")
        if part.version != first.version:
            raise ValueError(f"split GGUF part {i} of {n} ({p}): GGUF version {part.version}, the first part's "
                             f"is {first.version}")
        for name, t in part.tensors.items():
            if name in first.tensors:
                raise ValueError(f"split GGUF part {i} of {n} ({p}): tensor {name!r} is also in an earlier part")
            first.tensors[name] = t
        first.parts.append(part)
    _check_total(first, total)


def _check_total(gf, total):
    if len(gf.tensors) != total:
        raise ValueError(f"split GGUF {gf.path}: split.tensors.count = {total}, but the parts hold "
                         f"{len(gf.tensors)} tensors")
