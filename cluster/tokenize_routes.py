"""vLLM's `/tokenize` and `/detokenize`: a prompt or a chat as the server's tokenizer and
chat template turn it into token ids (the same function the completion routes use, so
a count here is the count a request is charged), and token ids back to text.

    POST /tokenize   {"prompt": "..."} or {"messages": [...]}, optional "model",
                     "add_special_tokens", "add_generation_prompt", "return_token_strs"
                  -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize {"tokens": [ids]} -> {"prompt": "..."}
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from pdserve.cluster.http_app import AppState, check_model, json_object, read_body
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.prompts import off_loop, prompt_token_ids


def add_tokenize_routes(app: FastAPI, state: AppState) -> None:
    async def body_of(request: Request) -> dict:
        body = json_object(await read_body(request, state.max_body_bytes))
        check_model(state, body)
        return body

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await body_of(request)
        kind = "chat" if "messages" in body else "completion"
        ids = await off_loop(
            prompt_token_ids, body, kind, state.tokenizer, state.chat_template, True
        )
        want_strs = body.get("return_token_strs", False)
        if not isinstance(want_strs, bool):
            raise ApiError("'return_token_strs' must be a boolean", param="return_token_strs")
        return {
            "count": len(ids),
            "max_model_len": state.max_model_len,
            "tokens": ids,
            "token_strs": state.tokenizer.convert_ids_to_tokens(ids) if want_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await body_of(request)
        tokens = body.get("tokens")
        vocab = len(state.tokenizer)
        if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < vocab for t in tokens
        ):
            raise ApiError(
                f"'tokens' must be an array of token ids in [0, {vocab})", param="tokens"
            )
        return {"prompt": state.tokenizer.decode(tokens)}
