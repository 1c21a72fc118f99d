"""A request's prompts as token ids: a chat through its template (cluster/chat_template.py),
a completion's prompt or batch of prompts as given, with vLLM's special-token rules.

The routes call them through `off_loop`: encoding runs on a thread (the fast tokenizer
lets go of the GIL while it works), so one long prompt does not stall every stream the
router relays: a 4 MB body, the most `max_body_bytes` lets in by default, takes ~3 s to
encode on one core here, and a 1 MB one ~0.7 s. Encoding only reads the tokenizer's state
(no truncation or padding is ever set on it), so calls on several threads do not clash.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.cluster.chat_template import render_chat
from pdserve.cluster.openai_api import ApiError, typed
from pdserve.cluster.sampling_api import check_vocab

ENCODE_TIMEOUT_S = 120.0  # far past what the largest body allowed takes to encode
T = TypeVar("T")


def prompt_token_ids(
    body: dict, kind: str, tok: Any, chat_template: str | None = None, count_only: bool = False
) -> list[int]:
    """A request's prompt as token ids. Chat: the chat template's text, encoded without
    special tokens unless `add_special_tokens` (the template places them); completions:
    a string encoded with them (a BOS where the tokenizer adds one), as vLLM and the
    offline `LLM` do, or token ids as given. A prompt of no tokens is refused, except
    an empty string with `count_only` (/tokenize: 0 tokens)."""
    special = typed(body, "add_special_tokens", (bool,), kind != "chat")
    if kind == "chat":
        # The same text-then-encode path as the offline LLM.chat, so both agree.
        text = render_chat(body, tok, chat_template)
        return list(tok(text, add_special_tokens=special).input_ids)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = tok(prompt, add_special_tokens=special).input_ids
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids = prompt
    else:
        raise ApiError("'prompt' must be a string or an array of token ids", param="prompt")
    if not ids and not (count_only and prompt == ""):
        raise ApiError("'prompt' is empty", param="prompt")
    return list(ids)


def completion_prompts(
    body: dict, tok: Any, vocab_size: int | None = None
) -> list[tuple[list[int], str | None]]:
    """A completion's prompts, each as (token ids, its text for `echo`): one prompt (a
    string or token ids) or a batch (an array of strings or of token-id arrays), which
    becomes choices `prompt index * n + i`, as in OpenAI's API and vLLM's. Token ids
    outside the model's vocabulary (`vocab_size`) are a 400, before anything decodes
    them."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    out = []
    for one in prompt if batch else [prompt]:
        ids = prompt_token_ids({**body, "prompt": one}, "completion", tok)
        check_vocab("prompt", ids, vocab_size)
        out.append((ids, one if isinstance(one, str) else tok.decode(ids)))
    return out


async def off_loop(fn: Callable[..., T], *args: Any, timeout_s: float = ENCODE_TIMEOUT_S) -> T:
    """`fn(*args)` on a thread, awaited for at most `timeout_s`; its ApiError passes through."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout_s)
    except TimeoutError as e:
        raise ApiError(f"the prompt was not tokenized within {timeout_s:.0f} s") from e
