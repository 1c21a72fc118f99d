"""One choice of a completion or chat response, in OpenAI's shape: its text, logprobs
and finish reason, and for chat the reply's reasoning split off (`--reasoning-parser`)
and its tool calls read (tools and tool_choice).

The routes (cluster/completion_routes.py) build whole choices with it and the stream
(cluster/completion_stream.py) each chunk's; nothing here knows the router or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.cluster.auto_tools import auto_reply
from pdserve.cluster.openai_api import ParsedRequest
from pdserve.cluster.reasoning_api import split_message
from pdserve.cluster.response_shapes import chat_logprobs, completion_logprobs


def choice(
    req: ParsedRequest,
    index: int,
    text: str,
    toks,
    lps,
    finish,
    stop_reason,
    delta: bool,
    decode_tok: Callable[[int], str],
) -> dict:
    """One choice (a whole one, or a stream chunk's with `delta`) without tool calls or
    reasoning split off; `decode_tok` names a logprob's token unless the request asked
    for token ids."""
    name = _token_id if req.tokens_as_ids else decode_tok
    if req.kind == "chat":
        body: dict[str, Any] = {"index": index}
        if delta:
            body["delta"] = {"content": text} if text or toks else {}
        else:
            body["message"] = {"role": req.role, "content": text}
        body["logprobs"] = (
            {"content": chat_logprobs(toks, lps, req.echo_logprobs or 0, name)}
            if lps is not None
            else None
        )
    else:
        body = {"index": index, "text": text}
        body["logprobs"] = (
            completion_logprobs(toks, lps, req.echo_logprobs or 0, name)
            if lps is not None
            else None
        )
    body["finish_reason"] = _finish(finish)
    if finish is not None and stop_reason is not None:
        body["stop_reason"] = stop_reason
    return body


def chat_reply(req: ParsedRequest, body: dict, echoed: str, text: str) -> dict:
    """A whole chat choice: its reasoning split off (`--reasoning-parser`), then the
    tool calls of its answer."""
    reasoning = None
    if req.reasoning is not None:
        reasoning, text = split_message(req.reasoning, body, echoed, text)
    if req.tool_choice is not None:
        body = tool_reply(req, body, echoed, text)
    if req.reasoning is not None:  # `include_reasoning: false`: parsed off, not returned
        body["message"]["reasoning"] = reasoning if req.include_reasoning else None
    return body


def tool_reply(req: ParsedRequest, body: dict, echoed: str, text: str) -> dict:
    """A whole chat choice with tools: under auto, the calls the parser reads in the
    generated `text`; under required or named, its text as tool calls (content null), as a
    stream sends them: when cut short, the calls so far with finish_reason length (a named
    call's arguments cut, as on OpenAI's API and vLLM), or the text when no call began;
    finish_reason tool_calls when the model ended the calls itself."""
    choice = req.tool_choice
    if choice.kind == "auto":
        return auto_reply(choice, body, echoed, text)
    reply = echoed + text
    calls = choice.calls(reply)
    if calls is not None:
        body["message"] = {"role": req.role, "content": None, "tool_calls": calls}
        # A named reply ended by a stop string counts as ended, as in the stream.
        if body["finish_reason"] == "stop" and (choice.kind == "named" or choice.whole(reply)):
            body["finish_reason"] = "tool_calls"
    return body


def _token_id(t: int) -> str:
    return f"token_id:{t}"


def _finish(reason: str | None) -> str | None:
    return None if reason is None else {"abort": "abort", "error": "error"}.get(reason, reason)
