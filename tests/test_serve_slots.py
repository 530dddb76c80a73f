"""llama-server's slot save / restore (cpufuse.serve.slots): a saved slot restored into another
serves the same prompt from the prompt cache with the same tokens; bad ids, actions, file names
and files are 400s naming them; 501 without --slot-save-path."""
import pytest

from _tiny_gguf import write_tiny_gguf

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from cpufuse.llama import Model  # noqa: E402
from cpufuse.serve import create_app  # noqa: E402
from cpufuse.serve.batch import BatchEngine  # noqa: E402


def test_slot_save_restore_erase(tmp_path):
    p = write_tiny_gguf(tmp_path / "m.gguf", qtype="Q8_0")
    d = tmp_path / "slots"
    d.mkdir()
    eng = BatchEngine(Model.load(p, n_ctx=128, n_seq=2), chunk=8)
    prompt = list(range(5, 45))
    req = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    with TestClient(create_app(eng, slot_save_path=str(d))) as http:
        first = http.post("/v1/completions", json=req).json()["choices"][0]["text"]
        used = [i for i, s in enumerate(eng.slots) if s.tokens]
        assert len(used) == 1
        i, j = used[0], 1 - used[0]
        r = http.post(f"/slots/{i}?action=save", json={"filename": "a.bin"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id_slot"] == i and body["filename"] == "a.bin" and body["n_saved"] == len(prompt) + 7
        assert body["n_written"] == (d / "a.bin").stat().st_size and "save_ms" in body["timings"]
        assert http.post(f"/slots/{i}?action=erase").json() == {"id_slot": i, "n_erased": len(prompt) + 7}
        r = http.post(f"/slots/{j}?action=restore", json={"filename": "a.bin"}).json()
        assert r["n_restored"] == len(prompt) + 7 and r["n_read"] == body["n_written"]
        cached = eng.stats().cached_prompt_tokens
        again = http.post("/v1/completions", json=req).json()
        assert again["choices"][0]["text"] == first
        assert eng.stats().cached_prompt_tokens - cached == len(prompt) // 8 * 8 - (8 if len(prompt) % 8 == 0 else 0)
        for url, body, status, what in (
                ("/slots/0?action=save", {"filename": "../x"}, 400, "filename"),
                ("/slots/0?action=save", {"filename": ""}, 400, "filename"),
                ("/slots/0?action=frob", {"filename": "a"}, 400, "action"),
                ("/slots/7?action=save", {"filename": "a"}, 400, "slot id"),
                ("/slots/x?action=save", {"filename": "a"}, 400, "integer"),
                ("/slots/0?action=restore", {"filename": "nope.bin"}, 404, "nope.bin")):
            r = http.post(url, json=body)
            assert r.status_code == status and what in r.json()["error"]["message"], (url, body, r.text)
        (d / "junk.bin").write_bytes(b"CFKV" + b"\0" * 20)
        r = http.post("/slots/0?action=restore", json={"filename": "junk.bin"})
        assert r.status_code == 400 and "version" in r.json()["error"]["message"]
        other = BatchEngine(Model.load(write_tiny_gguf(tmp_path / "o.gguf", qtype="Q8_0", seed=9), n_ctx=128))
        with TestClient(create_app(other, slot_save_path=str(d))) as http2:
            r = http2.post("/slots/0?action=restore", json={"filename": "a.bin"})
            assert r.status_code == 400 and "another model" in r.json()["error"]["message"]
    with TestClient(create_app(BatchEngine(Model.load(p, n_ctx=64)))) as http:
        r = http.post("/slots/0?action=save", json={"filename": "a.bin"})
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="existing directory"):
        create_app(eng, slot_save_path=str(tmp_path / "missing"))
