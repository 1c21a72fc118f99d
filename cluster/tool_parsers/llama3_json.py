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

Streamed, no call can go out before the reply ends: the calls being all or nothing, any
text after a whole call (` and then`, a second call cut short or naming an unknown tool)
turns the whole reply, that call too, into text, and a call already sent cannot be taken
back. So the calls are held and sent together at the end (vLLM streams them as they
come, and its stream of such a reply then differs from its whole reading). What can go
early is the text: the reply goes out as content the moment it is certainly text, and
from then on as it comes. That moment is its first non-space character when it is
neither `{` nor the tag; else the first object that is not a call (read once its brackets
close: JSON that does not parse or a name the tools lack), or the first character after
an object that is not `;`, or after a `;` that is not `{`. Text held that may still be
calls (an object not yet closed included) is let out at the end, as calls or as the text.
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
    loads,
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


# The characters that matter to where a JSON object ends: in a string its close and an
# escape (whose next character is skipped); outside one, a string's open and brackets.
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


class _Llama3Stream(ReplyStream):
    """Reads the reply as it comes, each character once: the phase says what is expected
    next, and the objects are found by their brackets (outside strings) before they are
    decoded, once each. In valid JSON the bracket that brings the count back to zero is the
    object's end, so an object whose text to there does not decode is not JSON whatever
    follows: the reply is text for sure."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        self._parser = parser
        self._held = ""  # the reply so far, while it may be calls
        self._pos = 0  # how far _held has been read
        self._phase = "start"  # start | value | object | after | text
        self._calls: list[Call] = []  # the objects read so far, all calls
        self._start = 0  # the open object's `{`
        self._depth = 0  # the open object's brackets not yet closed
        self._in_string = False

    def feed(self, text: str) -> StreamStep:
        if self._phase == "text":
            return StreamStep(text)
        self._held += text
        self._read()
        if self._phase == "text":
            held, self._held = self._held, ""
            return StreamStep(held)
        return StreamStep()

    def finish(self) -> StreamStep:
        held, self._held = self._held, ""
        if self._phase == "after":  # whole objects, all calls, and only space after them
            return StreamStep("", self._calls)
        return StreamStep(held)  # text: it was, or nothing more came to make it calls

    def _read(self) -> None:
        """Reads on through _held as far as it decides anything, moving the phase."""
        if self._phase == "start":
            decided = may_be_calls(self._held)
            if decided is None:
                return
            if not decided:
                self._phase = "text"
                return
            self._pos = len(self._held) - len(self._held.lstrip())
            if self._held.startswith(PYTHON_TAG, self._pos):
                self._pos += len(PYTHON_TAG)
            self._phase = "value"
        while self._phase != "text":
            if self._phase != "object":
                self._pos = _SPACE.match(self._held, self._pos).end()
                if self._pos == len(self._held):
                    return
            if self._phase == "value":  # an object must open here
                if self._held[self._pos] != "{":
                    self._phase = "text"
                    return
                self._start, self._depth, self._in_string = self._pos, 0, False
                self._phase = "object"
            elif self._phase == "object":
                end = self._object_end()
                if end is None:
                    return
                ok, value = loads(self._held[self._start : end])
                call = self._parser.call(value, ("parameters", "arguments")) if ok else None
                if call is None:
                    self._phase = "text"
                    return
                self._calls.append(call)
                self._phase = "after"
            else:  # after an object: `;` and the next, or nothing
                if self._held[self._pos] != ";":
                    self._phase = "text"
                    return
                self._pos += 1
                self._phase = "value"

    def _object_end(self) -> int | None:
        """Scans on through the open object; where it ends once its brackets close."""
        while True:
            mark = (_IN_STRING if self._in_string else _OUTSIDE).search(self._held, self._pos)
            if mark is None:
                self._pos = len(self._held)
                return None
            char, at = mark.group(), mark.start()
            if char == "\\":
                if at + 1 == len(self._held):
                    self._pos = at  # the escaped character has not come yet
                    return None
                self._pos = at + 2
                continue
            self._pos = at + 1
            if char == '"':
                self._in_string = not self._in_string
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return self._pos
