"""`pdserve serve --hf-overrides` making the bundled SmolLM2 a cross-encoder (Qwen3-Reranker's
conversion, runner/classify.py), PD mode: `/classify`, `/score` and `/rerank` answer with
the offline engine's numbers (themselves checked against transformers' LM head in
test_classify.py); generating and embedding requests are refused by name, a bad
parameter is a 400 that loses nothing, and /metrics counts each kind."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from serve_server import KEY, Server
from test_classify import RERANKER

from pdserve import LLM

QUERY = "Does the document answer where Paris is? Answer yes or no."
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Seine runs through Paris"]
HEADERS = {"Authorization": f"Bearer {KEY}"}


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=120)


def test_reranker_server(smollm_dir, tmp_path):
    llm = LLM(model=smollm_dir, device="cpu", hf_overrides=RERANKER)
    want_scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    want_probs = [o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)]
    del llm
    server = Server(tmp_path, "--device", "cpu", "--api-key", KEY,
                    "--hf-overrides", json.dumps(RERANKER))  # fmt: skip
    try:
        r = _post(server, "/classify", {"model": "SmolLM2-135M-Instruct", "input": DOCS}).json()
        assert [d["index"] for d in r["data"]] == [0, 1, 2]
        assert {(d["label"], d["num_classes"]) for d in r["data"]} == {("yes", 1)}
        np.testing.assert_allclose([d["probs"] for d in r["data"]], want_probs, atol=1e-5)
        assert r["usage"]["prompt_tokens"] > 0
        scores = _post(server, "/score", {"text_1": QUERY, "text_2": DOCS}).json()
        np.testing.assert_allclose([d["score"] for d in scores["data"]], want_scores, atol=1e-5)
        ranked = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
        order = [int(i) for i in np.argsort(-np.array(want_scores))[:2]]
        assert [x["index"] for x in ranked.json()["results"]] == order
        for path, body, words in (
            ("/v1/embeddings", {"input": "x"}, "is a classifier"),
            ("/classify", {"input": "x", "normalize": True}, "classify requests take"),
            ("/classify", {"input": "x", "activation": "yes"}, "activation must be"),
            ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "does not generate text"),
        ):
            bad = _post(server, path, body)
            assert bad.status_code == 400 and words in bad.text, (path, bad.text)
        with pytest.raises(openai.BadRequestError, match="does not generate text"):
            server.client().chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}]
            )
        raw = _post(server, "/classify", {"input": DOCS[:1], "activation": False}).json()
        p = want_probs[0][0]  # the raw logit is the probability's log-odds
        np.testing.assert_allclose(raw["data"][0]["probs"], [np.log(p / (1 - p))], atol=1e-4)
        metrics = server.metrics()
        for kind, least in (("classify", 4), ("score", 3), ("rerank", 3)):
            line = next(ln for ln in metrics.splitlines()
                        if ln.startswith("pdserve:request_success_total{")
                        and f'kind="{kind}"' in ln)  # fmt: skip
            assert float(line.rsplit(" ", 1)[1]) >= least, line
    finally:
        server.stop()
