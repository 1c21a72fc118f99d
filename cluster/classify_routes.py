"""vLLM's `/classify` for sequence classifiers (runner/classify.py), and the pieces the
pooling routes share: their parameters, their inputs, and the cross-encoder scoring that
`/score` and `/rerank` use on a one-label classifier (cluster/embedding_routes.py).

    POST /classify {"input": str | [str] | [ids] | [[ids]], "model", "activation"}
      -> {"object": "list", "data": [{"index", "label", "probs", "num_classes"}],
          "model", "usage": {"prompt_tokens", "total_tokens"}}

A cross-encoder reads a (query, document) pair as one prompt, joined as its tokenizer
joins a text pair, and scores it by its one label's probability.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import FastAPI, Request

from pdserve.cluster.http_app import AppState, check_model, json_object, read_body
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.prompts import completion_prompts, off_loop
from pdserve.cluster.response_shapes import now
from pdserve.runner.pooling import PoolingParams


def add_classify_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/classify")
    @app.post("/classify")
    async def classify(request: Request) -> dict:
        start = time.monotonic()
        body = json_object(await read_body(request, state.max_body_bytes))
        lora = check_model(state, body)
        params = pooling_params(state, "classify", body)
        prompts = await input_prompts(state, body)
        deltas = await asyncio.gather(
            *(state.router.pool(ids, lora, "classify", params) for ids, _ in prompts)
        )
        labels = state.pooling.classifier.labels if state.pooling is not None else ()
        data = []
        for i, d in enumerate(deltas):
            best = max(range(len(d.embedding)), key=d.embedding.__getitem__)
            label = labels[best] if best < len(labels) else f"LABEL_{best}"
            data.append({"index": i, "label": label, "probs": d.embedding,
                         "num_classes": len(d.embedding)})  # fmt: skip
        lens = [len(ids) for ids, _ in prompts]
        state.metrics.pooled("classify", lens, time.monotonic() - start)
        return {
            "id": f"classify-{secrets.token_hex(12)}", "object": "list", "created": now(),
            "model": lora or state.model_name, "data": data,
            "usage": {"prompt_tokens": sum(lens), "total_tokens": sum(lens)},
        }  # fmt: skip


POOLING_KEYS = ("normalize", "dimensions", "activation")


def pooling_params(state: AppState, task: str, body: dict) -> PoolingParams:
    """The request's pooling parameters, checked against `task` (each takes its own) and
    what the model serves: a 400 naming the problem."""
    try:
        params = PoolingParams(**{k: body.get(k) for k in POOLING_KEYS})
        params.check_task(task)
        if state.pooling is not None:
            state.pooling.for_request(params, task)
    except ValueError as e:
        bad = next((k for k in POOLING_KEYS if k in str(e)), None)
        raise ApiError(str(e), param=bad) from None
    return params


async def input_prompts(state: AppState, body: dict) -> list[tuple[list[int], str | None]]:
    """A pooling request's `input`: one text or token-id array, or an array of them."""
    if "input" not in body:
        raise ApiError("'input' is required", param="input")
    prompt_body = {"prompt": body["input"]}
    if "add_special_tokens" in body:
        prompt_body["add_special_tokens"] = body["add_special_tokens"]
    try:
        prompts = await off_loop(completion_prompts, prompt_body, state.tokenizer, state.vocab_size)
    except ApiError as e:  # the completions' words for the same checks
        raise ApiError(str(e).replace("'prompt'", "'input'"), param="input") from None
    check_lengths(prompts, state.max_model_len, "input")
    return prompts


def cross_encoder(state: AppState) -> bool:
    """The model scores pairs itself (a classifier); refused unless it has one label."""
    pooling = state.pooling
    if pooling is None or pooling.task != "classify":
        return False
    if pooling.classifier.num_labels != 1:
        raise ApiError(
            f"score and rerank need a classifier with one label (this one has "
            f"{pooling.classifier.num_labels}); use /classify"
        )
    return True


async def cross_encode(
    state: AppState, pairs: list[tuple[str, str]], lora: str | None, kind: str
) -> tuple[list[float], int]:
    """Each pair's probability from the one-label classifier, and the token count;
    counted in /metrics as a request of `kind`."""
    start = time.monotonic()

    def encode() -> list[list[int]]:
        return [list(state.tokenizer(a, text_pair=b).input_ids) for a, b in pairs]

    prompts = [(ids, None) for ids in await off_loop(encode)]
    check_lengths(prompts, state.max_model_len, None)
    deltas = await asyncio.gather(
        *(state.router.pool(ids, lora, "classify", None) for ids, _ in prompts)
    )
    lens = [len(ids) for ids, _ in prompts]
    state.metrics.pooled(kind, lens, time.monotonic() - start)
    return [float(d.embedding[0]) for d in deltas], sum(lens)


def check_lengths(prompts: list, max_model_len: int, param: str | None) -> None:
    for ids, _ in prompts:
        if not 0 < len(ids) <= max_model_len:
            raise ApiError(
                f"a text of {len(ids)} tokens: each must have 1 to max_model_len "
                f"({max_model_len}) tokens",
                param=param,
            )
