"""Split GGUFs (cpufuse.llama.gguf_split): PREFIX-00001-of-0000N.gguf loads as one model, with the
same logits as the single file; every part is checked, and a missing or foreign part is a
ValueError naming it."""
import os
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.gguf_file import GGUFFile  # noqa: E402
from cpufuse.llama.gguf_split import split_paths  # noqa: E402
from cpufuse.llama.tiny import write_tiny_gguf  # noqa: E402

TOKENS = [5, 17, 280, 42, 99, 7, 256, 3, 128, 64, 11]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_split_loads_as_the_single_file(tmp_path, arch):
    one = write_tiny_gguf(tmp_path / "one.gguf", qtype="Q8_0", arch=arch, seed=3)
    first = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0", arch=arch, seed=3, split_max_tensors=7)
    parts = split_paths(first)
    assert first.endswith("m-00001-of-%05d.gguf" % len(parts)) and len(parts) > 2
    assert all(os.path.exists(p) for p in parts)
    gf = GGUFFile(first)
    assert len(gf.parts) == len(parts) and set(gf.tensors) == set(GGUFFile(one).tensors)
    assert len(GGUFFile(first, split=False).tensors) == 7
    for repack in (True, False):
        a = Model.load(one, n_ctx=64, n_threads=1, repack=repack)
        b = Model.load(first, n_ctx=64, n_threads=1, repack=repack)
        assert np.array_equal(a.logits(TOKENS), b.logits(TOKENS))
        assert a.generate(TOKENS, max_tokens=5, temperature=0).tokens == b.generate(TOKENS, max_tokens=5,
                                                                                   temperature=0).tokens


@pytest.fixture
def split3(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    first = write_tiny_gguf(d / "m.gguf", qtype="Q8_0", split_max_tensors=8)
    parts = split_paths(first)
    assert len(parts) == 3
    return parts


def test_missing_and_wrong_parts(tmp_path, split3):
    with pytest.raises(ValueError, match=r"is part 2 of 3: load the first part"):
        GGUFFile(split3[1])
    moved = split3[2] + ".away"
    os.rename(split3[2], moved)
    with pytest.raises(ValueError, match=r"part 3 of 3 is missing: .*m-00003-of-00003\.gguf"):
        Model.load(split3[0], n_ctx=64)
    os.rename(moved, split3[2])
    # a part of another split (4 parts) in place of part 2
    d = tmp_path / "b"
    d.mkdir()
    other = split_paths(write_tiny_gguf(d / "m.gguf", qtype="Q8_0", split_max_tensors=6))
    assert len(other) > 3
    keep = split3[1] + ".keep"
    shutil.copy(split3[1], keep)
    shutil.copy(other[1], split3[1])
    with pytest.raises(ValueError, match=r"part 2 of 3 .*split.no/count/tensors.count = \(1, \d+, \d+\), expected "
                                         r"\(1, 3, \d+\)"):
        GGUFFile(split3[0])
    # a truncated part: GGUFFile's own checks, naming the part
    data = open(keep, "rb").read()
    open(split3[1], "wb").write(data[:len(data) - 100])
    with pytest.raises(ValueError, match=r"split GGUF part 2 of 3 .*truncated"):
        GGUFFile(split3[0])
    # the first part under another name
    shutil.copy(keep, split3[1])
    renamed = str(tmp_path / "a" / "model.gguf")
    shutil.copy(split3[0], renamed)
    with pytest.raises(ValueError, match="not named PREFIX-00001-of-00003.gguf"):
        GGUFFile(renamed)
    GGUFFile(split3[0])                 # restored: loads


def _write_part(path, no, count, total, tensors, keys=True, no_type="uint16"):
    w = gguf.GGUFWriter(path, "llama")
    if keys:
        (w.add_uint16 if no_type == "uint16" else w.add_string)("split.no", no if no_type == "uint16" else str(no))
        w.add_uint16("split.count", count)
        w.add_int32("split.tensors.count", total)
    for name in tensors:
        w.add_tensor(name, np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_split_keys_are_checked(tmp_path):
    p1, p2 = (str(tmp_path / f"x-0000{i}-of-00002.gguf") for i in (1, 2))
    _write_part(p1, 0, 2, 2, ["a"])
    _write_part(p2, 1, 2, 2, ["a"])
    with pytest.raises(ValueError, match="tensor 'a' is also in an earlier part"):
        GGUFFile(p1)
    _write_part(p2, 1, 2, 2, ["b"])
    assert sorted(GGUFFile(p1).tensors) == ["a", "b"]
    _write_part(p2, 1, 2, 2, ["b", "c"])
    with pytest.raises(ValueError, match="split.tensors.count = 2, but the parts hold 3 tensors"):
        GGUFFile(p1)
    _write_part(p2, 1, 2, 2, ["b"], keys=False)
    with pytest.raises(ValueError, match="key 'split.no' is missing"):
        GGUFFile(p1)
    _write_part(p1, 0, 2, 2, ["a"], no_type="string")
    with pytest.raises(ValueError, match=r"split.no = '0' \(string\), expected an integer"):
        GGUFFile(p1)
    _write_part(p1, 5, 2, 2, ["a"])
    with pytest.raises(ValueError, match=r"split.no = 5 .*\[0, 1\]"):
        GGUFFile(p1)
    one = str(tmp_path / "single.gguf")       # split.count 1: a plain file, its count checked
    _write_part(one, 0, 1, 1, ["a"])
    assert list(GGUFFile(one).tensors) == ["a"]
    _write_part(one, 0, 1, 2, ["a"])
    with pytest.raises(ValueError, match="split.tensors.count = 2, but the parts hold 1 tensors"):
        GGUFFile(one)
