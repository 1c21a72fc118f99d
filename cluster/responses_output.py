"""A chat completion's answer in the Responses API's shape (OpenAI's, vLLM 0.25's): the
response object with its `output` items, in the order the model wrote them: a `reasoning`
item (with `--reasoning-parser`; its text in `content` as `reasoning_text`), a `message`
item whose `output_text` is the answer, and one `function_call` item per tool call.

Logprobs (`include: ["message.output_text.logprobs"]`) are the reply's tokens' as chat
gives them, thinking included, on the message's text. Usage counts reasoning tokens by
encoding the reasoning text (the reply's tokens are not split by the parser).
"""

from __future__ import annotations

import uuid
from typing import Any

# The request fields a response repeats back (with the value the request gave, else these).
ECHOED = {
    "instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
    "temperature": None, "top_p": None, "tool_choice": "auto", "tools": [],
    "text": {"format": {"type": "text"}}, "reasoning": None, "truncation": "disabled",
    "user": None, "top_logprobs": None, "service_tier": "auto",
}  # fmt: skip


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(
    body: dict, resp_id: str, created: int, model: str, status: str, output: list[dict],
    usage: dict | None, incomplete: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The response object; `body` is the Responses request as answered (its `store`
    what is done, cluster/responses_routes.py)."""
    out: dict[str, Any] = {
        "id": resp_id, "object": "response", "created_at": created, "model": model,
        "status": status, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "output": output, "usage": usage, "store": body.get("store") is True,
        "background": body.get("background") is True,
        "previous_response_id": body.get("previous_response_id"),
    }  # fmt: skip
    for name, default in ECHOED.items():
        value = body.get(name)
        out[name] = default if value is None else value
    return out


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) for how the reply ended."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "incomplete", "cancelled"
    return "completed", None


def response_usage(chat_usage: dict, reasoning_tokens: int) -> dict:
    """Chat's usage in the Responses API's names."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        # Writes are not counted: the prefix cache is the server's own, not billed storage.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": chat_usage["total_tokens"],
    }


def reasoning_item(text: str, rid: str | None = None) -> dict:
    return {
        "type": "reasoning", "id": rid or item_id("rs"), "summary": [],
        "content": [{"type": "reasoning_text", "text": text}], "status": "completed",
    }  # fmt: skip


def text_part(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str, logprobs: list | None, status: str, mid: str | None = None) -> dict:
    return {
        "type": "message", "id": mid or item_id("msg"), "role": "assistant", "status": status,
        "content": [text_part(text, logprobs)],
    }  # fmt: skip


def call_item(call_id: str, name: str, arguments: str, fid: str | None = None) -> dict:
    return {
        "type": "function_call", "id": fid or item_id("fc"), "call_id": call_id, "name": name,
        "arguments": arguments, "status": "completed",
    }  # fmt: skip


def output_items(choice: dict) -> list[dict]:
    """A whole chat choice's message as output items."""
    message = choice["message"]
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    if message.get("content"):
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(message["content"], logprobs, "completed"))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(call_item(call["id"], fn["name"], fn["arguments"]))
    cut = status_of(choice.get("finish_reason"))[1] == "max_output_tokens"
    if cut and items:  # the item the limit cut: text, a call's arguments or the thinking
        items[-1]["status"] = "incomplete"
    return items
