"""`--tool-call-parser llama3_json`: tool calls as Llama 3.1 and 3.2 write them with JSON
tools, the whole reply being the calls:

    {"name": "get_weather", "parameters": {"city": "Oslo"}}

What is read (the whole reply, or a stream of it, alike):
- A reply whose first non-space text is `{`, or the `<|python_tag|>` marker, is read as one
  or more JSON objects separated by `;` (whitespace around them allowed). When every one
  names one of the request's tools and carries its arguments as an object under
  "parameters" (Llama's key; "arguments" is taken too), they are the calls and the
  content is null.
- Anything else is text, returned whole as the content: a reply that starts otherwise,
  JSON that does not parse or is cut short (max_tokens), a name the request's tools lack,
  or text after the objects. The calls are all or nothing.

`<|python_tag|>` is a special token of Llama 3's tokenizer: it reaches the reply only when
the request sets `skip_special_tokens: false`; otherwise the reply starts at the `{`.

Streamed, text goes out as it comes once its first non-space character shows it cannot be
calls; a reply that may be calls is held to its end, then sent as calls or as its text.
"""

from __future__ import annotations

import json
import re

from pdserve.cluster.tool_parsers.base import (
    Call,
    ParsedReply,
    ReplyStream,
    StreamStep,
    ToolParser,
)

PYTHON_TAG = "<|python_tag|>"
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


class Llama3JsonParser(ToolParser):
    def parse(self, text: str) -> ParsedReply:
        calls = self._calls(text)
        return ParsedReply(None, calls) if calls else ParsedReply(text, ())

    def stream(self) -> ReplyStream:
        return _Llama3Stream(self)

    def _calls(self, text: str) -> tuple[Call, ...]:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        elif not body.startswith("{"):
            return ()
        calls = []
        pos = _SPACE.match(body).end()
        while True:
            try:
                value, pos = _DECODER.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return ()
            call = self.call(value, ("parameters", "arguments"))
            if call is None:
                return ()
            calls.append(call)
            pos = _SPACE.match(body, pos).end()
            if pos == len(body):
                return tuple(calls)
            if body[pos] != ";":
                return ()
            pos = _SPACE.match(body, pos + 1).end()


def may_be_calls(text: str) -> bool | None:
    """Whether a reply beginning with `text` may be calls: True, False, or None while its
    first non-space text has not decided it (only whitespace, or a piece of the tag)."""
    head = text.lstrip()
    if head.startswith(("{", PYTHON_TAG)):
        return True
    if not head or PYTHON_TAG.startswith(head):
        return None
    return False


class _Llama3Stream(ReplyStream):
    def __init__(self, parser: Llama3JsonParser) -> None:
        self._parser = parser
        self._held = ""  # the reply so far, while it may be calls
        self._calls: bool | None = None  # may_be_calls, once decided

    def feed(self, text: str) -> StreamStep:
        if self._calls is False:
            return StreamStep(text)
        self._held += text
        if self._calls is None:
            self._calls = may_be_calls(self._held)
            if self._calls is False:
                held, self._held = self._held, ""
                return StreamStep(held)
        return StreamStep()

    def finish(self) -> StreamStep:
        held, self._held = self._held, ""
        if not held:
            return StreamStep()
        reply = self._parser.parse(held)
        return StreamStep(reply.content or "", list(reply.calls))
