"""A chat request's `messages` as the chat template reads them, and what the reply's role
and echo follow from them.

Each message's content becomes one string: a string, or an array of text parts joined by
newlines (as vLLM does); other parts are refused, the models read text only. An
assistant turn that made tool calls may have no content (OpenAI's clients send
`"content": null` with `tool_calls`); it reads as "", and each call's `arguments`, which
the API carries as JSON text, reaches the template as the object it encodes, as on vLLM,
since templates write it out with `tojson`.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.cluster.openai_api import ApiError, typed, wants_echo


def chat_messages(body: dict) -> list[dict]:
    """`messages`, each with its content as one string (see the module's docstring)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("each message needs a string 'role' and 'content'", param="messages")
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and m["role"] == "assistant":
            m = {**m, "tool_calls": _tool_calls(calls)}
            if content is None:
                content = ""
        if isinstance(content, list):
            content = "\n".join(_text_part(part) for part in content)
        if not isinstance(content, str):
            raise ApiError("each message needs a string 'role' and 'content'", param="messages")
        out.append({**m, "content": content})
    return out


def _tool_calls(calls: Any) -> list[dict]:
    """An assistant turn's `tool_calls`, each call's JSON `arguments` read into its object."""
    if not isinstance(calls, list):
        raise ApiError("an assistant message's 'tool_calls' must be an array", param="messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(
                "each tool call needs a 'function' with a string 'name'", param="messages"
            )
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise ApiError(
                    f"tool call {fn['name']!r}: 'arguments' is not valid JSON ({e.msg} at "
                    f"character {e.pos})",
                    param="messages",
                ) from e
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out


def chat_role(body: dict, response_role: str = "assistant") -> str:
    """The role of a chat reply (vLLM's rule): `response_role` (--response-role, the
    assistant's by default), or with `add_generation_prompt: false` the last message's,
    whose turn the reply continues."""
    if typed(body, "add_generation_prompt", (bool,), True):
        return response_role
    return chat_messages(body)[-1]["role"]


def chat_echo(body: dict, role: str) -> str | None:
    """Chat's `echo` (vLLM's): the last message's content, put before each choice's, when
    that message has the reply's role, as when `continue_final_message` continues an
    answer the client began; None otherwise (nothing to join)."""
    if not wants_echo(body):
        return None
    last = chat_messages(body)[-1]
    return (last["content"] or None) if last["role"] == role else None


def _text_part(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(kind, str) and kind != "text":
        raise ApiError(
            f"content parts of type {kind!r} are not supported: the model reads text only",
            param="messages",
        )
    raise ApiError("a content part must be {'type': 'text', 'text': <string>}", param="messages")
