"""`/v1/embeddings` on the shared PD server (bundled SmolLM2, a plain checkpoint: last
token, normalised): each input's vector is the offline engine's `LLM.embed` (itself
checked against transformers in test_embeddings.py), as floats or base64, with usage
counting the inputs' tokens; bad requests are 400s naming their field."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from pdserve import LLM

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors of numbers."]


@pytest.fixture(scope="module")
def offline(smollm_dir) -> tuple[list[list[float]], list[int]]:
    llm = LLM(model=smollm_dir, device="cpu")
    outs = llm.embed(TEXTS, use_tqdm=False)
    return [o.outputs.embedding for o in outs], [len(o.prompt_token_ids) for o in outs]


def test_embeddings_match_the_offline_engine(pd, offline):
    vectors, lens = offline
    client = pd.client()
    r = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS)
    assert [d.index for d in r.data] == [0, 1] and r.model == "SmolLM2-135M-Instruct"
    for got, want in zip(r.data, vectors, strict=True):
        # float32 on the CPU both ways; a batch of other rows changes reduction order only
        torch.testing.assert_close(torch.tensor(got.embedding), torch.tensor(want), atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
        assert abs(np.linalg.norm(got.embedding) - 1.0) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(lens)
    # /metrics counts each input as a finished request of kind embedding
    line = next(ln for ln in pd.metrics().splitlines()
                if ln.startswith("pdserve:request_success_total{") and 'kind="embedding"' in ln)  # fmt: skip
    assert float(line.rsplit(" ", 1)[1]) >= 2
    raw = client.embeddings.with_raw_response.create(
        model="SmolLM2-135M-Instruct", input=TEXTS[0], encoding_format="base64"
    ).http_response.json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.tensor(decoded), torch.tensor(vectors[0]), atol=1e-5, rtol=0)


def test_bad_embedding_requests_are_400s(pd):
    client = pd.client()
    for kwargs, field in (
        (dict(input=TEXTS[0], dimensions=8), "dimensions"),
        (dict(input=TEXTS[0], encoding_format="int8"), "encoding_format"),
        (dict(input=[[10**9]]), "input"),
    ):
        with pytest.raises(openai.BadRequestError, match=field):
            client.embeddings.create(model="SmolLM2-135M-Instruct", **kwargs)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="x")
    # The server still answers.
    assert client.embeddings.create(model="SmolLM2-135M-Instruct", input="ok").data


def test_score_and_rerank_are_cosine_similarities(pd, smollm_dir):
    """vLLM's /score and /rerank for embedding models: cosine similarity of the texts'
    embeddings (offline engine's), rerank sorted best first and cut to top_n."""
    import httpx

    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "Cats purr."]
    llm = LLM(model=smollm_dir, device="cpu")
    vecs = np.array([o.outputs.embedding for o in llm.embed([query, *docs], use_tqdm=False)])
    want = vecs[1:] @ vecs[0]  # unit vectors: the dot product is the cosine
    headers = {"Authorization": "Bearer test-key"}
    r = httpx.post(pd.url + "/score", json={"text_1": query, "text_2": docs}, headers=headers,
                   timeout=120).json()  # fmt: skip
    got = [d["score"] for d in r["data"]]
    np.testing.assert_allclose(got, want, atol=1e-5)
    pairs = httpx.post(pd.url + "/v1/score", json={"text_1": docs[:2], "text_2": docs[1:]},
                       headers=headers, timeout=120).json()  # fmt: skip
    np.testing.assert_allclose(
        [d["score"] for d in pairs["data"]], [vecs[1] @ vecs[2], vecs[2] @ vecs[3]], atol=1e-5
    )
    ranked = httpx.post(pd.url + "/v1/rerank", json={"query": query, "documents": docs,
                        "top_n": 2}, headers=headers, timeout=120).json()  # fmt: skip
    order = [int(i) for i in np.argsort(-want)[:2]]
    assert [x["index"] for x in ranked["results"]] == order
    assert ranked["results"][0]["document"]["text"] == docs[order[0]]
    bad = httpx.post(pd.url + "/v1/score", json={"text_1": docs[:2], "text_2": docs},
                     headers=headers, timeout=120)  # fmt: skip
    assert bad.status_code == 400 and "text_1" in bad.text


def test_score_and_rerank_sit_behind_the_api_key():
    """Like /v1: a server with --api-key answers them only with it (they compute)."""
    import asyncio

    import httpx

    from pdserve.cluster.http_app import AppState, build_app
    from pdserve.cluster.metrics import Metrics
    from pdserve.cluster.route_policy import RouterConfig
    from pdserve.cluster.router import Router

    router = Router(RouterConfig(mode="colocated"), [], [])
    app = build_app(AppState(router, None, "m", 64, Metrics("m"), api_key="k"))
    paths = ("/score", "/rerank", "/v2/rerank", "/v1/rerank", "/v1/score", "/v1/embeddings",
             "/classify", "/v1/classify")  # fmt: skip

    async def run(headers: dict) -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [(await c.post(p, json={}, headers=headers)).status_code for p in paths]

    assert asyncio.run(run({})) == [401] * len(paths)
    assert asyncio.run(run({"Authorization": "Bearer k"})) == [400] * len(paths)
