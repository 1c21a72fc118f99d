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
