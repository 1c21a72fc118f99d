"""Tool calls that are the whole reply: whitespace, the family's markers (each optional), one
list holding the calls, whitespace (granite.py, pythonic.py). As llama3_json's, the calls
are all or nothing: a reply is calls when its list is one whose every item is a call of
the request's tools, with nothing but whitespace after it, and its content is then null;
any other reply is text, returned whole.

Streamed, the calls go out at the end (text after the list would make the whole reply
text, and a call already sent cannot be taken back); the reply goes out as text the moment
it cannot be calls, and from then on as it comes: its first character after the whitespace
and markers is not `[`, the list cannot be calls (its scanner may tell before it closes:
pythonic.py), the list once its brackets close is not calls, or a character after it is
not whitespace. What this module does not know: the list's syntax (a subclass's scanner
and reader).
"""

from __future__ import annotations

import re
from typing import Protocol

from pdserve.cluster.tool_parsers.base import (
    AllOrNothingStream,
    Call,
    ParsedReply,
    ReplyStream,
    ToolParser,
)

REJECT = -1  # a scanner's answer: the list cannot be calls, whatever follows
_SPACE = re.compile(r"\s*")


class ListEnd(Protocol):
    def end(self, text: str, pos: int) -> int | None:
        """Scans on through `text` from `pos` (the list's `[` first): where the list ends
        once its brackets close, REJECT when it cannot be calls, None when neither shows."""


class WholeReplyParser(ToolParser):
    TAGS: tuple[str, ...] = ()  # the markers that may open the reply, in this order

    def scanner(self) -> ListEnd:
        """A scanner for one reply's list."""
        raise NotImplementedError

    def read(self, value: str) -> tuple[Call, ...] | None:
        """The list's text (its brackets closed) as its calls, all of them; None otherwise."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedReply:
        stream = self.stream()
        calls = stream.feed(text).then(stream.finish()).calls
        return ParsedReply(None, tuple(calls)) if calls else ParsedReply(text, ())

    def stream(self) -> ReplyStream:
        return _WholeReplyStream(self)

    def opening(self, head: str) -> int | None:
        """Where the list opens in `head`, the reply so far after its leading whitespace:
        its index; REJECT when the reply cannot be calls; None while markers may come."""
        pos = 0
        for tag in self.TAGS:
            if head.startswith(tag, pos):
                pos = _SPACE.match(head, pos + len(tag)).end()
            elif tag.startswith(head[pos:]):
                return None
        if pos == len(head):
            return None
        return pos if head[pos] == "[" else REJECT


class _WholeReplyStream(AllOrNothingStream):
    """Reads each piece once, the state carried from the one before it: what is held is
    kept as its pieces and joined once, when let out."""

    def __init__(self, parser: WholeReplyParser) -> None:
        super().__init__()
        self._parser = parser
        self._head = ""  # start: its text after the leading whitespace (markers)
        # start | list | after | text (AllOrNothingStream)
        self._scan = parser.scanner()
        self._list: list[str] = []  # list: its pieces so far
        self._calls: tuple[Call, ...] = ()  # after: the list's calls

    def _read(self, text: str) -> None:
        """Reads on through the new piece as far as it decides anything, moving the phase."""
        pos = 0
        if self._phase == "start":
            # The reply so far is whitespace, then self._head (markers, whitespace).
            head = self._head + text if self._head else text.lstrip()
            opens = self._parser.opening(head)
            if opens is None:
                self._head = head
                return
            if opens == REJECT:
                self._phase = "text"
                return
            pos = len(text) - (len(head) - opens)  # head ends as the piece does
            self._head, self._phase = "", "list"
        if self._phase == "list":
            end = self._scan.end(text, pos)
            if end is None:
                self._list.append(text[pos:])
                return
            if end == REJECT:
                self._phase = "text"
                return
            self._list.append(text[pos:end])
            calls = self._parser.read("".join(self._list))
            self._list, pos = [], end
            if calls is None:
                self._phase = "text"
                return
            self._calls, self._phase = calls, "after"
        if _SPACE.match(text, pos).end() < len(text):  # text after the list
            self._phase = "text"
