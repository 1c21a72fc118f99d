"""OpenAI's and vLLM's `/v1/embeddings`: each input's pooled final hidden states
(runner/pooling.py), computed on a decode worker as a prompt with nothing generated.

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

import numpy as np
from fastapi import FastAPI, Request

from pdserve.cluster.http_app import AppState, check_model, json_object, read_body
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.prompts import completion_prompts, off_loop
from pdserve.cluster.response_shapes import now


def add_embedding_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
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
        for ids, _ in prompts:
            if not ids:
                raise ApiError("an input must not be empty", param="input")
            if len(ids) > state.max_model_len:
                raise ApiError(
                    f"an input of {len(ids)} tokens is longer than max_model_len "
                    f"({state.max_model_len})",
                    param="input",
                )
        deltas = await asyncio.gather(
            *(state.router.embed(ids, lora, normalize) for ids, _ in prompts)
        )
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(d.embedding, fmt)}
            for i, d in enumerate(deltas)
        ]
        tokens = sum(len(ids) for ids, _ in prompts)
        return {
            "id": f"embd-{secrets.token_hex(12)}",
            "object": "list",
            "created": now(),
            "model": lora or state.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
