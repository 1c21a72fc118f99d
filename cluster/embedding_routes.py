"""OpenAI's and vLLM's `/v1/embeddings`: each input's pooled final hidden states
(runner/pooling.py), computed on a decode worker as a prompt with nothing generated; and
vLLM's `/score` and `/rerank` for embedding models on top of them (cosine similarity).

    POST /v1/embeddings {"input": str | [str] | [ids] | [[ids]], "model",
                         "encoding_format": "float" | "base64", "normalize" (vLLM's)}
      -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
          "model", "usage": {"prompt_tokens", "total_tokens"}}

`base64` is the vector's little-endian float32 bytes, as OpenAI's clients decode it.
`dimensions` (Matryoshka truncation) is refused: no served model declares it.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time

import numpy as np
from fastapi import FastAPI, Request

from pdserve.cluster.http_app import AppState, check_model, json_object, read_body
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.prompts import completion_prompts, off_loop
from pdserve.cluster.response_shapes import now


def add_embedding_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        start = time.monotonic()
        body = json_object(await read_body(request, state.max_body_bytes))
        lora = check_model(state, body)
        if "input" not in body:
            raise ApiError("'input' is required", param="input")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
        if body.get("dimensions") is not None:
            raise ApiError(
                "'dimensions' is not supported: this model is not a Matryoshka model",
                param="dimensions",
            )
        normalize = body.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise ApiError("'normalize' must be a boolean", param="normalize")
        prompt_body = {"prompt": body["input"]}
        if "add_special_tokens" in body:
            prompt_body["add_special_tokens"] = body["add_special_tokens"]
        try:
            prompts = await off_loop(
                completion_prompts, prompt_body, state.tokenizer, state.vocab_size
            )
        except ApiError as e:  # the completions' words for the same checks
            raise ApiError(str(e).replace("'prompt'", "'input'"), param="input") from None
        _check_lengths(prompts, state.max_model_len, "input")
        deltas = await asyncio.gather(
            *(state.router.embed(ids, lora, normalize) for ids, _ in prompts)
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
        _check_lengths(prompts, state.max_model_len, None)
        deltas = await asyncio.gather(*(state.router.embed(ids, lora, True) for ids, _ in prompts))
        lens = [len(ids) for ids, _ in prompts]
        state.metrics.pooled(kind, lens, time.monotonic() - start)
        return np.array([d.embedding for d in deltas]), sum(lens)

    def texts(body: dict, key: str) -> list[str]:
        value = body.get(key)
        items = [value] if isinstance(value, str) else value
        if not (isinstance(items, list) and items and all(isinstance(t, str) for t in items)):
            raise ApiError(f"'{key}' must be a string or a non-empty array of strings", param=key)
        return items

    @app.post("/v1/score")
    @app.post("/score")
    async def score(request: Request) -> dict:
        """vLLM's score API for embedding models: the cosine similarity of `text_1` with
        each of `text_2` (one text against many, or pairs of equal-length lists)."""
        body = json_object(await read_body(request, state.max_body_bytes))
        lora = check_model(state, body)
        left, right = texts(body, "text_1"), texts(body, "text_2")
        if len(left) != 1 and len(left) != len(right):
            raise ApiError("'text_1' must be one text or as many as 'text_2'", param="text_1")
        vectors, tokens = await embed_texts(left + right, lora, "score")
        a, b = vectors[: len(left)], vectors[len(left) :]
        scores = (a * b).sum(1) if len(left) == len(right) else b @ a[0]
        data = [{"index": i, "object": "score", "score": float(x)} for i, x in enumerate(scores)]
        return {
            "id": f"score-{secrets.token_hex(12)}", "object": "list", "created": now(),
            "model": lora or state.model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }  # fmt: skip

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank(request: Request) -> dict:
        """vLLM's (Jina's and Cohere's) rerank for embedding models: `documents` by the
        cosine similarity of their embedding with `query`'s, best first, `top_n` of them."""
        body = json_object(await read_body(request, state.max_body_bytes))
        lora = check_model(state, body)
        query = body.get("query")
        if not isinstance(query, str):
            raise ApiError("'query' must be a string", param="query")
        documents = texts(body, "documents")
        top_n = body.get("top_n", len(documents))
        if type(top_n) is not int or top_n < 0:
            raise ApiError("'top_n' must be an integer >= 0", param="top_n")
        vectors, tokens = await embed_texts([query, *documents], lora, "rerank")
        scores = vectors[1:] @ vectors[0]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[: top_n or None]
        results = [
            {"index": i, "document": {"text": documents[i]}, "relevance_score": float(scores[i])}
            for i in order
        ]
        return {
            "id": f"rerank-{secrets.token_hex(12)}", "model": lora or state.model_name,
            "results": results, "usage": {"total_tokens": tokens},
        }  # fmt: skip


def _check_lengths(prompts: list, max_model_len: int, param: str | None) -> None:
    for ids, _ in prompts:
        if not 0 < len(ids) <= max_model_len:
            raise ApiError(
                f"a text of {len(ids)} tokens: each must have 1 to max_model_len "
                f"({max_model_len}) tokens",
                param=param,
            )


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
