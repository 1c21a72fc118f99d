"""A Responses API request (`POST /v1/responses`, OpenAI's and vLLM 0.25's) read as the chat
completion it asks for: `instructions` and `input` become `messages`, `max_output_tokens`
becomes `max_tokens`, flat function tools become chat's nested ones, `text.format` becomes
`response_format`; the sampling fields pass through. The chat path then does all the
work (template, constraints, tool and reasoning parsers), so both APIs answer alike.

`previous_response_id` is resolved before this (cluster/responses_routes.py puts the
stored conversation's items ahead of `input`); `conversation` objects are not kept and
are refused (send the history in `input`, or continue a stored response; output items a
client sends back are read as its turns). Fields whose work pdserve does not do (prompt
templates, built-in tools, `truncation: "auto"`, `max_tool_calls`) are refused by name,
never ignored; `background` is the route's (cluster/responses_routes.py).
"""

from __future__ import annotations

from typing import Any

from pdserve.cluster.openai_api import ApiError

# Responses fields read as the same chat field, unchanged.
_SAME = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
    "ignore_eos", "priority", "user", "parallel_tool_calls", "structured_outputs",
    "skip_special_tokens", "include_stop_str_in_output", "min_tokens", "bad_words",
    "stop_token_ids", "chat_template_kwargs", "cache_salt",
)  # fmt: skip

# field -> why it is refused when set (not null, not false)
_REFUSED = {
    "conversation": "conversations are not stored here; send the conversation in 'input'",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "a limit on tool calls is not carried out",
    "previous_response": "send the conversation in 'input'",
}

# chat field a check may name -> the Responses field it came from
CHAT_TO_RESPONSES_PARAM = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "logprobs": "include",
}


def chat_body(body: dict) -> dict:
    """The chat completion request a Responses request stands for; a 400 naming the
    Responses field for what cannot be read or is not carried out."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise ApiError(f"'{name}': {why} by this server", param=name, code="unsupported")
    if body.get("truncation") not in (None, "disabled"):
        raise ApiError(
            "'truncation' other than \"disabled\" is not supported by this server",
            param="truncation", code="unsupported",
        )  # fmt: skip
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError("'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    messages += input_messages(body.get("input"))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    effort = reasoning_effort(body.get("reasoning"))
    if effort is not None:  # chat's field: read by templates that take it, as on vLLM
        chat["reasoning_effort"] = effort
    top = output_logprobs(body)
    if top is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    return chat


def input_messages(items: Any) -> list[dict]:
    """`input` as chat messages: a string is one user message; an array holds messages
    (`{"role", "content"}`, with or without `"type": "message"`), the function calls the
    model made (`function_call`, joined into one assistant turn) and their results
    (`function_call_output`, a tool message). Reasoning items a client sends back are
    dropped, as chat templates drop past thinking."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError("'input' must be a string or a non-empty array of items", param="input")
    out: list[dict] = []
    for item in items:
        if not isinstance(item, dict):
            raise ApiError("each 'input' item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item))
        elif kind == "function_call":
            call = _call(item)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls made in one turn stay in one turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id"),
                        "content": _output(item.get("output"))})  # fmt: skip
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(
                f"input items of type {kind!r} are not supported by this server (messages, "
                "function_call, function_call_output and reasoning are)",
                param="input", code="unsupported",
            )  # fmt: skip
    if not out:
        raise ApiError("'input' holds no message", param="input")
    return out


def _message(item: dict) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(
            "an input message's 'role' must be user, assistant, system or developer",
            param="input",
        )
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(_text(part) for part in content)
    if not isinstance(content, str):
        raise ApiError("an input message's 'content' must be a string or an array of text "
                       "parts", param="input")  # fmt: skip
    # Chat templates know system, not OpenAI's newer name for it.
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(kind, str) and kind not in ("input_text", "output_text", "text"):
        raise ApiError(
            f"content parts of type {kind!r} are not supported: the model reads text only",
            param="input", code="unsupported",
        )  # fmt: skip
    raise ApiError("a content part must be {'type': 'input_text', 'text': <string>}",
                   param="input")  # fmt: skip


def _call(item: dict) -> dict:
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise ApiError("a function_call item's 'arguments' must be a JSON string", param="input")
    return {"id": _string(item, "call_id"), "type": "function",
            "function": {"name": _string(item, "name"), "arguments": arguments}}  # fmt: skip


def _output(output: Any) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):  # an array of output text parts
        return "".join(_text(part) for part in output)
    raise ApiError("a function_call_output item's 'output' must be a string", param="input")


def _string(item: dict, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(f"a {item.get('type')} item needs a string '{name}'", param="input")
    return value


def chat_tools(tools: Any) -> list[dict]:
    """Responses' flat function tools (`{"type": "function", "name", "parameters", ...}`)
    as chat's (`{"type": "function", "function": {...}}`); other tool types (web search,
    file search, MCP, ...) run on OpenAI's side and are refused."""
    if not isinstance(tools, list):
        raise ApiError("'tools' must be an array", param="tools")
    out = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(
                f"tools of type {kind!r} are not supported by this server (function tools are)",
                param="tools", code="unsupported",
            )  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}  # fmt: skip
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """`tool_choice`: "auto", "none" and "required" as they are; a named function
    (`{"type": "function", "name"}`) as chat's `{"type": "function", "function": {"name"}}`."""
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise ApiError("a named 'tool_choice' needs a string 'name'", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError(
        '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", '
        '"name": ...} on this server',
        param="tool_choice",
    )


def text_format(text: Any) -> dict | None:
    """`text.format` as chat's `response_format`: plain text (None), JSON mode, or a JSON
    schema (`{"type": "json_schema", "name", "schema", "strict"}`)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ApiError("'text.format' must be of type text, json_object or json_schema", param="text")


def reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise ApiError("'reasoning' must be an object", param="reasoning")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise ApiError("'reasoning.effort' must be a string", param="reasoning")
    return effort


def output_logprobs(body: dict) -> int | None:
    """The number of top logprobs per output token when `include` asks for
    "message.output_text.logprobs" (`top_logprobs`, default 0); None otherwise."""
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise ApiError("'include' must be an array of strings", param="include")
    if "message.output_text.logprobs" not in include:
        return None
    top = body.get("top_logprobs")
    return 0 if top is None else top


def in_responses_terms(e: ApiError) -> ApiError:
    """A chat check's 400 in the Responses API's words: its `param`, and the field names
    its message quotes, the Responses fields they came from."""
    if e.param is not None:
        e.param = CHAT_TO_RESPONSES_PARAM.get(e.param, e.param)
    for chat, field in CHAT_TO_RESPONSES_PARAM.items():
        e.message = e.message.replace(f"'{chat}'", f"'{field}'")
    e.args = (e.message,)
    return e
