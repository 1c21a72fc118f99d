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
    AllOrNothingStream,
    Call,
    ParsedReply,
    ReplyStream,
    ToolParser,
    loads,
)
from pdserve.cluster.tool_parsers.json_end import JsonEnd

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


class _Llama3Stream(AllOrNothingStream):
    """Reads the reply as it comes, each character once: the phase says what is expected
    next, and the objects are found by their brackets (json_end.py) before they are
    decoded, once each: an object whose text to its closing bracket does not decode is not
    JSON whatever follows, and the reply is text for sure. Each piece is read on its own,
    the state carried from the one before it, and what is held is kept as its pieces,
    joined once when let out (a 160,000-character call fed 4 characters a time was copied
    whole on each of its 40,000 feeds)."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        super().__init__()
        self._parser = parser
        self._head = ""  # start: its text after the leading whitespace (a piece of the tag)
        # start | value | object | after | text (AllOrNothingStream)
        self._calls: list[Call] = []  # the objects read so far, all calls
        self._object: list[str] = []  # the open object's pieces before this one's
        self._scan = JsonEnd()  # where the open object ends

    def _read(self, text: str) -> None:
        """Reads on through the new piece as far as it decides anything, moving the phase."""
        pos = 0
        if self._phase == "start":
            # The reply so far is whitespace then self._head, a piece of the tag.
            head = self._head + text if self._head else text.lstrip()
            decided = may_be_calls(head)
            if decided is None:
                self._head = head
                return
            if not decided:
                self._phase = "text"
                return
            # head ends the reply so far; the tag, when it opens head, ends in this piece
            tagged = head.startswith(PYTHON_TAG)
            pos = len(text) - (len(head) - len(PYTHON_TAG) if tagged else len(head))
            self._head, self._phase = "", "value"
        start = 0  # the open object's `{` in this piece, or its beginning
        while self._phase != "text":
            if self._phase != "object":
                pos = _SPACE.match(text, pos).end()
                if pos == len(text):
                    return
            if self._phase == "value":  # an object must open here
                if text[pos] != "{":
                    self._phase = "text"
                    return
                start, self._scan = pos, JsonEnd()
                self._phase = "object"
            elif self._phase == "object":
                end = self._scan.end(text, pos)
                if end is None:
                    self._object.append(text[start:])
                    return
                self._object.append(text[start:end])
                ok, value = loads("".join(self._object))
                self._object, pos = [], end
                call = self._parser.call(value, ("parameters", "arguments")) if ok else None
                if call is None:
                    self._phase = "text"
                    return
                self._calls.append(call)
                self._phase = "after"
            else:  # after an object: `;` and the next, or nothing
                if text[pos] != ";":
                    self._phase = "text"
                    return
                pos += 1
                self._phase = "value"
