"""`POST /v1/responses`: OpenAI's Responses API (vLLM 0.25 serves it too), answered by the
chat path. The request is read as its chat completion (cluster/responses_input.py), runs
exactly as /v1/chat/completions would (the same template, constraints, tool-call and
reasoning parsers, metrics and request log), and its reply is put into the Responses
shapes: a response object (cluster/responses_output.py) or, with `stream: true`, the
semantic events (cluster/responses_stream.py).

Responses are stored (`store`, true unless the request says false) in the router's memory
(cluster/response_store.py): `previous_response_id` continues one, `GET` and `DELETE
/v1/responses/{id}` read and drop one. With `--responses-store-bytes 0` nothing is stored:
`store` comes back false and those are a 404 that says so.

`background: true` (with `store`, not with `stream`) answers at once with the response
`queued` and runs it in the router (cluster/background_responses.py); `GET` reads how far
it is, `POST /v1/responses/{id}/cancel` stops it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.cluster.completion_request import parse_body
from pdserve.cluster.completion_routes import whole_reply
from pdserve.cluster.completion_stream import chunk_stream
from pdserve.cluster.disconnect import unless_disconnected
from pdserve.cluster.http_app import AppState, json_object, read_body
from pdserve.cluster.openai_api import ApiError, ParsedRequest
from pdserve.cluster.response_shapes import now
from pdserve.cluster.response_store import MissingResponse, ResponseStore, as_items
from pdserve.cluster.responses_input import chat_body, in_responses_terms
from pdserve.cluster.responses_output import (
    item_id,
    output_items,
    response_object,
    response_usage,
    status_of,
)
from pdserve.cluster.responses_stream import ResponseEvents, sse_event

logger = logging.getLogger(__name__)


def add_responses_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request):
        body, history = answered_body(
            state.responses, json_object(await read_body(request, state.max_body_bytes))
        )
        background = _background(body, state.responses.enabled)
        reply = _Reply(state, body, await _chat_requests(state, body, history))
        if state.request_log is not None:
            state.request_log.received(reply.rid, reply.reqs)
        if background:
            return reply.start_in_background()
        if reply.reqs[0].stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return await unless_disconnected(request, reply.whole())

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        try:
            return state.responses.get(response_id).response
        except MissingResponse:
            raise _not_stored(state.responses, response_id, "response_id") from None

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        """A background response's run stopped (`cancelled`); one already ended comes back
        as it ended (cancelling is idempotent, as on OpenAI's API)."""
        try:
            stored = state.responses.get(response_id).response
        except MissingResponse:
            raise _not_stored(state.responses, response_id, "response_id") from None
        if not stored.get("background"):
            raise ApiError(
                f"response {response_id!r} did not run in the background: only a background "
                "response can be cancelled", param="response_id",
            )  # fmt: skip
        await state.background.cancel(response_id)
        try:
            entry = state.responses.get(response_id)
        except MissingResponse:  # evicted while it ran
            raise _not_stored(state.responses, response_id, "response_id") from None
        if entry.response["status"] in ("queued", "in_progress"):  # the run stopped short
            cancelled = dict(entry.response, status="cancelled")
            state.responses.put(cancelled, entry.input_items, entry.previous_id)
            return cancelled
        return entry.response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        # A background run still going is stopped first: it would store its response again
        # when it ends.
        await state.background.cancel(response_id)
        if not state.responses.delete(response_id):
            raise _not_stored(state.responses, response_id, "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def answered_body(store: ResponseStore, body: dict) -> tuple[dict, list[dict]]:
    """The request as it is answered, with `store` as it will be done (false when the
    server stores nothing), and the items of the conversation it continues (none without
    `previous_response_id`); a 400 for a `store` or `previous_response_id` of the wrong
    type, a 404 when the response it continues (or an earlier one of that conversation) is
    not stored."""
    wanted = body.get("store")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError("'store' must be a boolean", param="store")
    previous, history = body.get("previous_response_id"), []
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError("'previous_response_id' must be a string", param="previous_response_id")
        try:
            history = store.conversation(previous)
        except MissingResponse as e:
            raise _not_stored(store, e.response_id, "previous_response_id") from None
    return dict(body, store=store.enabled and wanted is not False), history


def _background(body: dict, store_enabled: bool) -> bool:
    """Whether the request runs in the background (`body` as answered); a 400 for a
    `background` that is not a boolean, or that cannot be done (nothing stored to read it
    from, or a stream)."""
    wanted = body.get("background")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError("'background' must be a boolean", param="background")
    if not wanted:
        return False
    if not body["store"]:
        raise ApiError(
            "'background' needs 'store': a background response is read back with GET "
            "/v1/responses/{id}" + (" (the request says 'store': false)" if store_enabled
                                    else " (this server stores none: --responses-store-bytes 0)"),
            param="background",
        )  # fmt: skip
    if body.get("stream"):
        raise ApiError(
            "'background' with 'stream' is not supported by this server: stream the "
            "response, or run it in the background and read it with GET",
            param="background", code="unsupported",
        )  # fmt: skip
    return True


async def _chat_requests(state: AppState, body: dict, history: list[dict]) -> list[ParsedRequest]:
    """The chat requests a Responses body stands for, after the `history` it continues;
    a check's 400 names the Responses field (`input` for `messages`, `max_output_tokens`
    for `max_tokens`, ...)."""
    try:
        if history:
            body = dict(body, input=history + as_items(body.get("input")))
        chat = chat_body(body)
        if chat.get("stream"):  # the usage the final event carries
            chat["stream_options"] = {"include_usage": True}
        return await parse_body(state, chat, "chat")
    except ApiError as e:
        raise in_responses_terms(e) from None


@dataclass
class _Reply:
    """One Responses request's answer, from the chat path's reply."""

    state: AppState
    body: dict  # the Responses request
    reqs: list[ParsedRequest]  # the chat request it stands for (one prompt)
    rid: str = field(default_factory=lambda: item_id("resp"))
    created: int = field(default_factory=now)
    start: float = field(default_factory=time.monotonic)

    async def whole(self) -> dict[str, Any]:
        out = await whole_reply(self.state, self.reqs, self.rid, self.start, self._decode)
        choice = out["choices"][0]
        status, why = status_of(choice["finish_reason"])
        usage = response_usage(out["usage"], self._count(choice["message"].get("reasoning")))
        return self._stored(self._response(status, output_items(choice), usage, why))

    async def events(self) -> AsyncIterator[str]:
        stream = ResponseEvents(self.body, self.rid, self.created, self.reqs[0].model)
        for event in stream.start():
            yield sse_event(event)
        usage, reasoning = None, ""
        try:
            async for chunk in chunk_stream(self.state, self.reqs, self.rid, self.start,
                                            self._decode):  # fmt: skip
                for choice in chunk["choices"]:
                    reasoning += (choice.get("delta") or {}).get("reasoning") or ""
                    for event in stream.feed(choice):
                        yield sse_event(event)
                if chunk.get("usage") is not None:
                    usage = chunk["usage"]
        except ApiError as e:
            yield sse_event(stream.error(e.body()))
            return
        assert usage is not None, "the chat stream ends with its usage chunk"
        events = stream.finish(response_usage(usage, self._count(reasoning)))
        self._stored(events[-1]["response"])
        for event in events:
            yield sse_event(event)

    def start_in_background(self) -> dict[str, Any]:
        """The response `queued`, stored; its run goes on in the router."""
        queued = self._stored(self._response("queued", [], None, None))
        self.state.background.start(self.rid, self._run())
        return queued

    async def _run(self) -> None:
        self._stored(self._response("in_progress", [], None, None))
        try:  # a cancel is stored by whoever cancels (the cancel route)
            await self.whole()  # stores the response as it ended
        except ApiError as e:  # a stopping server, a worker gone
            self._failed("server_error" if e.status >= 500 else "invalid_prompt", e.message)
        except Exception as e:  # a fault of ours: the response says so, the log says where
            logger.exception("background response %s failed", self.rid)
            self._failed("server_error", f"internal error ({type(e).__name__})")

    def _failed(self, code: str, message: str) -> None:
        failed = self._response("failed", [], None, None)
        failed["error"] = {"code": code, "message": message}
        self._stored(failed)

    def _stored(self, response: dict) -> dict:
        """Keep the whole response when the request asked for it to be stored."""
        if self.body["store"]:
            own = as_items(self.body.get("input"))
            self.state.responses.put(response, own, self.body.get("previous_response_id"))
        return response

    def _response(self, status: str, items: list, usage: dict, why: str | None) -> dict:
        return response_object(self.body, self.rid, self.created, self.reqs[0].model,
                               status, items, usage, why)  # fmt: skip

    def _decode(self, t: int) -> str:
        return self.state.tokenizer.decode([t])

    def _count(self, reasoning: str | None) -> int:
        """The reasoning's text counted in tokens (encoded again: the parser splits text,
        not the reply's tokens)."""
        tok = self.state.tokenizer
        return len(tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0


def _not_stored(store: ResponseStore, response_id: str, param: str) -> ApiError:
    why = (
        "not stored (deleted, evicted from the store, or never stored)"
        if store.enabled
        else "not found: this server stores no responses (--responses-store-bytes 0; send "
        "the conversation in 'input')"
    )
    return ApiError(f"response {response_id!r} {why}", 404, param=param, code="not_found")
