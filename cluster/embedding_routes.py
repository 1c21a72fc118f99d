"""OpenAI's and vLLM's `/v1/embeddings`: each input's pooled final hidden states
(runner/pooling.py), computed on a decode worker as a prompt with nothing generated; and
vLLM's `/score` and `/rerank` on top of them: the cosine similarity of embeddings, or on a
cross-encoder (a one-label classifier, cluster/classify_routes.py) its probability for
each (query, document) pair.

    POST /v1/embeddings {"input": str | [str] | [ids] | [[ids]], "model",
                         "encoding_format": "float" | "base64", "normalize" (vLLM's),
                         "dimensions" (a Matryoshka model's width)}
      -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
          "model", "usage": {"prompt_tokens", "total_tokens"}}

`base64` is the vector's little-endian float32 bytes, as OpenAI's clients decode it.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time

import numpy as np
from fastapi import FastAPI, Request

from pdserve.cluster.classify_routes import (
    check_lengths,
    cross_encode,
    cross_encoder,
    input_prompts,
    pooling_params,
)
from pdserve.cluster.http_app import AppState, check_model, json_object, read_body
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.prompts import completion_prompts, off_loop
from pdserve.cluster.response_shapes import now
from pdserve.runner.pooling import PoolingParams


def add_embedding_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        start = time.monotonic()
        body = json_object(await read_body(request, state.max_body_bytes))
        lora = check_model(state, body)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        params = pooling_params(state, "embed", body)
        prompts = await input_prompts(state, body)
        deltas = await asyncio.gather(
            *(state.router.pool(ids, lora, "embed", params) for ids, _ in prompts)
        )
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(d.embedding, fmt)}
            for i, d in enumerate(deltas)
        ]
        tokens = sum(len(ids) for ids, _ in prompts)
        state.metrics.pooled(
            "embedding", [len(ids) for ids, _ in prompts], time.monotonic() - start
        )
        return {
            "id": f"embd-{secrets.token_hex(12)}",
            "object": "list",
            "created": now(),
            "model": lora or state.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    async def embed_texts(texts: list[str], lora: str | None, kind: str) -> tuple[np.ndarray, int]:
        """Unit vectors [n, hidden] of `texts` (cosine similarity is then a dot product)
        and their token count; counted in /metrics as a request of `kind`."""
        start = time.monotonic()
        prompts = await off_loop(completion_prompts, {"prompt": texts}, state.tokenizer)
        check_lengths(prompts, state.max_model_len, None)
        unit = PoolingParams(normalize=True)
        deltas = await asyncio.gather(
            *(state.router.pool(ids, lora, "embed", unit) for ids, _ in prompts)
        )
        lens = [len(ids) for ids, _ in prompts]
        state.metrics.pooled(kind, lens, time.monotonic() - start)
        return np.array([d.embedding for d in deltas]), sum(lens)

    async def similarities(
        queries: list[str], docs: list[str], lora: str | None, kind: str
    ) -> tuple[list[float], int]:
        """Each (query, doc) pair's score (one query for all docs, or pairs) and the token
        count: a cross-encoder's probability, else the cosine of their embeddings."""
        if cross_encoder(state):
            firsts = queries * len(docs) if len(queries) == 1 else queries
            return await cross_encode(state, list(zip(firsts, docs, strict=True)), lora, kind)
        vectors, tokens = await embed_texts(queries + docs, lora, kind)
        a, b = vectors[: len(queries)], vectors[len(queries) :]
        scores = (a * b).sum(1) if len(queries) == len(docs) else b @ a[0]
        return [float(x) for x in scores], tokens

    def texts(body: dict, key: str) -> list[str]:
        value = body.get(key)
        items = [value] if isinstance(value, str) else value
        if not (isinstance(items, list) and items and all(isinstance(t, str) for t in items)):
            raise ApiError(f"'{key}' must be a string or a non-empty array of strings", param=key)
        return items

    @app.post("/v1/score")
    @app.post("/score")
    async def score(request: Request) -> dict:
        """vLLM's score API: `text_1` against each of `text_2` (one text against many, or
        pairs of equal-length lists), by a cross-encoder or the cosine of embeddings."""
        body = json_object(await read_body(request, state.max_body_bytes))
        lora = check_model(state, body)
        left, right = texts(body, "text_1"), texts(body, "text_2")
        if len(left) != 1 and len(left) != len(right):
            raise ApiError("'text_1' must be one text or as many as 'text_2'", param="text_1")
        scores, tokens = await similarities(left, right, lora, "score")
        data = [{"index": i, "object": "score", "score": x} for i, x in enumerate(scores)]
        return {
            "id": f"score-{secrets.token_hex(12)}", "object": "list", "created": now(),
            "model": lora or state.model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }  # fmt: skip

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank(request: Request) -> dict:
        """vLLM's (Jina's and Cohere's) rerank: `documents` by their score against
        `query` (a cross-encoder's, or the cosine of embeddings), best first, `top_n`."""
        body = json_object(await read_body(request, state.max_body_bytes))
        lora = check_model(state, body)
        query = body.get("query")
        if not isinstance(query, str):
            raise ApiError("'query' must be a string", param="query")
        documents = texts(body, "documents")
        top_n = body.get("top_n", len(documents))
        if type(top_n) is not int or top_n < 0:
            raise ApiError("'top_n' must be an integer >= 0", param="top_n")
        scores, tokens = await similarities([query], documents, lora, "rerank")
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[: top_n or None]
        results = [
            {"index": i, "document": {"text": documents[i]}, "relevance_score": float(scores[i])}
            for i in order
        ]
        return {
            "id": f"rerank-{secrets.token_hex(12)}", "model": lora or state.model_name,
            "results": results, "usage": {"total_tokens": tokens},
        }  # fmt: skip


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
