"""POST /v1/embeddings through the engine (cpufuse.serve.embeddings): OpenAI's shape, L2-normalized
vectors equal to the library's, inputs beside running generations, base64, every bad field a 400
naming it; 501 without --embeddings and for /v1/rerank."""
import base64
import threading

import numpy as np
import pytest

from _tiny_gguf import write_tiny_gguf

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from cpufuse.llama import Model  # noqa: E402
from cpufuse.llama.embedding import embed_ids  # noqa: E402
from cpufuse.serve import create_app  # noqa: E402
from cpufuse.serve.batch import BatchEngine  # noqa: E402


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("emb") / "m.gguf", qtype="Q8_0")


def test_embeddings_route(path):
    ref = Model.load(path, n_ctx=128, n_batch=16)
    tok = ref.tokenizer
    texts = ["hello world", "the cat sat on the mat " * 5]
    want = [embed_ids(ref, tok.tokenize(t, None, True), "mean", 2) for t in texts]
    eng = BatchEngine(Model.load(path, n_ctx=128, n_seq=2, n_batch=16), chunk=16)
    with TestClient(create_app(eng, embeddings="mean")) as http:
        # a generation running meanwhile: the embeddings wait for free slots, its tokens unchanged
        gen = {}
        t = threading.Thread(target=lambda: gen.update(r=http.post("/v1/completions", json={
            "prompt": "hello", "max_tokens": 24, "temperature": 0}).json()))
        t.start()
        r = http.post("/v1/embeddings", json={"input": texts, "model": "x"})
        t.join()
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == eng.model_name
        assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
        for d, w in zip(body["data"], want):
            assert np.array_equal(np.array(d["embedding"], np.float32), w)
        n = sum(len(tok.tokenize(t, None, True)) for t in texts)
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
        alone = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 24, "temperature": 0}).json()
        assert gen["r"]["choices"][0]["text"] == alone["choices"][0]["text"]
        r = http.post("/embeddings", json={"input": texts[0], "encoding_format": "base64"})
        v = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
        assert np.array_equal(v, want[0])
        ids = tok.tokenize(texts[0], None, True)
        for inp in (ids, [ids]):
            r = http.post("/v1/embeddings", json={"input": inp})
            assert np.array_equal(np.array(r.json()["data"][0]["embedding"], np.float32), want[0])
        for bad, param in (({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
                           ({"input": [10 ** 6]}, "input"), ({"input": 5}, "input"), ({"input": [1.5]}, "input"),
                           ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                           ({"input": "x", "dimensions": 3}, "dimensions"),
                           ({"input": list(range(5, 140))}, "input")):
            r = http.post("/v1/embeddings", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        r = http.post("/v1/rerank", json={"query": "a", "documents": ["b"]})
        assert r.status_code == 501 and "classification head" in r.json()["error"]["message"]


def test_embeddings_off_and_pooling_none(path):
    with TestClient(create_app(BatchEngine(Model.load(path, n_ctx=64, n_seq=1)))) as http:
        r = http.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]
    with TestClient(create_app(BatchEngine(Model.load(path, n_ctx=64, n_seq=1)), embeddings=True)) as http:
        r = http.post("/v1/embeddings", json={"input": "x"})      # the file has no pooling_type: none
        assert r.status_code == 400 and "--pooling" in r.json()["error"]["message"]
    with pytest.raises(NotImplementedError, match="classification head"):
        create_app(BatchEngine(Model.load(path, n_ctx=64, n_seq=1)), embeddings="rank")
