"""A chat request's prompt text: the tokenizer's chat template (or `--chat-template`'s) over
its messages, with vLLM's request fields: `add_generation_prompt` (default true),
`continue_final_message` (the last message left open, for prefilling the answer) and
`chat_template_kwargs` (variables the template reads, e.g. Qwen3's `enable_thinking`).

Templates are the operator's (the model's files or the flag), never the client's. A
template that refuses a conversation (`raise_exception`, e.g. roles that must alternate)
is a 400 with its message; a model without one is a 400 that names the flag.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from pdserve.cluster.chat_messages import chat_messages
from pdserve.cluster.openai_api import ApiError, typed


def load_chat_template(arg: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the template itself when it is written out
    (it holds Jinja markup); anything else is a mistake, said at start."""
    if arg is None:
        return None
    path = Path(arg).expanduser()
    if path.is_file():
        return path.read_text()
    if "{%" in arg or "{{" in arg:
        return arg
    raise ValueError(f"--chat-template {arg!r} is neither a file nor a Jinja template")


def render_chat(body: dict, tok: Any, template: str | None = None) -> str:
    messages = chat_messages(body)
    add_prompt = typed(body, "add_generation_prompt", (bool,), True)
    continue_final = typed(body, "continue_final_message", (bool,), False)
    if add_prompt and continue_final and "add_generation_prompt" in body:
        raise ApiError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            param="continue_final_message",
        )
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    taken = sorted(set(extra) & (_rendered_names() | _parameters(tok)))
    if taken:
        raise ApiError(
            f"chat_template_kwargs may not set {taken}: they are request fields or fixed here",
            param="chat_template_kwargs",
        )
    if template is None and not getattr(tok, "chat_template", None):
        raise ApiError(
            "this model has no chat template; use /v1/completions, or start the server with "
            "--chat-template",
            param="messages",
        )
    from jinja2 import TemplateError

    # Tools reach the template whatever tool_choice says, as on vLLM (templates that know
    # tools describe them to the model; the others ignore them); so do vLLM's `documents`
    # (for templates that ground answers in them) and `reasoning_effort` (for templates
    # that take it), unless chat_template_kwargs sets it.
    tools = body.get("tools") or None
    documents = typed(body, "documents", (list,)) or None
    effort = typed(body, "reasoning_effort", (str,))
    if effort is not None:
        extra = {"reasoning_effort": effort, **extra}
    try:
        return tok.apply_chat_template(
            messages,
            tokenize=False,
            chat_template=template,
            add_generation_prompt=add_prompt and not continue_final,
            continue_final_message=continue_final,
            tools=tools,
            documents=documents,
            **extra,
        )
    except (TemplateError, TypeError) as e:  # a TypeError: the template tripped on a value
        raise ApiError(f"the chat template refused the conversation: {e}") from e
    except ValueError as e:  # transformers' own checks (e.g. no final message to continue)
        raise ApiError(str(e), param="messages") from e


def _parameters(tok: Any) -> set[str]:
    return set(inspect.signature(tok.apply_chat_template).parameters)


def _rendered_names() -> set[str]:
    """Names the renderer binds itself: the conversation, and the functions a template
    calls (Jinja's `range`, `namespace`, ...; transformers' `raise_exception`,
    `strftime_now`). A kwarg by one of those names would replace it (a 500 before)."""
    from jinja2.defaults import DEFAULT_NAMESPACE

    return {"messages", "raise_exception", "strftime_now", *DEFAULT_NAMESPACE}
