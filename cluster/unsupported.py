"""Request fields that OpenAI or vLLM define and pdserve does not carry out. Unknown fields
are ignored, as OpenAI's API does; these are known, and ignoring them would change what
the client gets without a word (JSON mode answering free text, tool calls that never
come), so a request that uses one is refused (400) by name.

A field at its neutral value (an empty `functions` list,
`suffix: ""`, ...) is accepted: clients that always send the defaults keep working.
"""

from __future__ import annotations

from typing import Any

from pdserve.cluster.openai_api import ApiError

# field -> (is it in use?, why it is refused)
_RULES: dict[str, tuple[Any, str]] = {
    # Structured output (response_format, structured_outputs, guided_json/regex/choice/
    # grammar) is carried out: cluster/structured_api.py.
    # tools and tool_choice are carried out (cluster/tool_calls.py: auto needs the
    # server's tool-call parser); the deprecated functions field is not.
    "functions": (
        bool,
        "the deprecated function calling is not carried out here; send tools instead",
    ),
    "prompt_embeds": (lambda v: v is not None, "prompt embeddings are not carried out here"),
    "suffix": (bool, "suffix (insertion) is not carried out here"),
    # Templates are the operator's (--chat-template), never the client's: vLLM too refuses
    # one sent with a request unless its server trusts request templates.
    "chat_template": (
        lambda v: v is not None,
        "a chat template sent with the request is not used here; the server's (--chat-template) is",
    ),
    "guided_whitespace_pattern": (
        lambda v: v is not None,
        "a whitespace pattern for JSON output is not carried out here",
    ),
    # vLLM's extension points: code the server would load, and its arguments.
    "logits_processors": (bool, "custom logits processors are not carried out here"),
    "vllm_xargs": (
        bool,
        "extension arguments (for custom logits processors) are not carried out here",
    ),
    "repetition_detection": (
        lambda v: v is not None,
        "stopping on detected repetition is not carried out here",
    ),
}


def refuse_unsupported(body: dict) -> None:
    """Raise a 400 naming the first field `body` uses that pdserve does not carry out."""
    for name, (in_use, why) in _RULES.items():
        if name in body and in_use(body[name]):
            raise ApiError(f"'{name}': {why}; leave it out", param=name, code="unsupported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise ApiError(
            "'best_of' other than n is not supported by this server", param="best_of",
            code="unsupported",
        )  # fmt: skip
