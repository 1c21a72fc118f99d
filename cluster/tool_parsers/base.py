"""What every tool-call parser gives (`--tool-call-parser`, vLLM's names): a whole reply read
into its text and its calls, and the same reading done piece by piece as a reply streams.

A parser knows one model family's tool-call syntax and the names of the request's tools;
it knows nothing of OpenAI's message shapes, ids or finish reasons (cluster/auto_tools.py
puts its findings into those). Its one promise: whatever the pieces, a stream's content
joined and its calls in order equal what `parse` finds in the whole text (null content
joins as "").
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    name: str  # one of the request's tools
    arguments: str  # the arguments object as JSON text (json.dumps, ensure_ascii=False)


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # the text that is not a call; None when calls left none
    calls: tuple[Call, ...]


@dataclass
class StreamStep:
    """What a piece of a streamed reply lets out: text that is content for sure, and calls
    that are whole."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)

    def then(self, later: StreamStep) -> StreamStep:
        return StreamStep(self.content + later.content, self.calls + later.calls)


class ReplyStream(ABC):
    """One streamed reply: text that may still turn into a call is held back."""

    @abstractmethod
    def feed(self, text: str) -> StreamStep:
        """The next piece of the reply; what it lets out."""

    @abstractmethod
    def finish(self) -> StreamStep:
        """The reply has ended: what was held back, as calls or content."""


class ToolParser(ABC):
    # Whether the parser reads special tokens (gpt-oss's harmony markers): its requests
    # are then detokenized with them.
    needs_special_tokens = False

    def __init__(self, tools: Mapping[str, dict] | Iterable[str]) -> None:
        """`tools`: the request's tools, name -> parameters schema (names alone: no schema,
        which only the parsers that type XML-style arguments use)."""
        self.schemas: dict[str, dict] = (
            dict(tools) if isinstance(tools, Mapping) else {name: {} for name in tools}
        )
        self.tool_names = frozenset(self.schemas)

    @abstractmethod
    def parse(self, text: str) -> ParsedReply:
        """A whole reply. Without calls its content is the text as it is."""

    @abstractmethod
    def stream(self) -> ReplyStream:
        """A reader for one reply that arrives in pieces."""

    def call(self, value: object, argument_keys: tuple[str, ...]) -> Call | None:
        """`value` (decoded JSON) as a call: an object naming one of the request's tools,
        its arguments an object under the first of `argument_keys` it has; None otherwise."""
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        if not (isinstance(name, str) and name in self.tool_names):
            return None
        key = next((k for k in argument_keys if k in value), None)
        arguments = value[key] if key is not None else None
        if not isinstance(arguments, dict):
            return None
        return Call(name, json.dumps(arguments, ensure_ascii=False))

    def array_calls(self, value: object, argument_keys: tuple[str, ...]) -> tuple[Call, ...] | None:
        """`value` (decoded JSON) as a non-empty array of calls (`call`), all of them; None
        when it is not one or any of its items is not a call."""
        if not isinstance(value, list):
            return None
        calls = [self.call(item, argument_keys) for item in value]
        return tuple(calls) if calls and None not in calls else None


def typed_argument(schema: dict, key: str, raw: str) -> object:
    """An argument written as text (XML-style calls), as the tool's parameters schema types
    it: a string property (or one the schema does not list) stays the text; any other type
    is the text read as JSON when it reads, else the text (a model that writes `yes` for a
    boolean gets its string back rather than a lost argument)."""
    prop = (schema.get("properties") or {}).get(key)
    kind = prop.get("type") if isinstance(prop, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return raw
    ok, value = loads(raw.strip())
    return value if ok else raw


def loads(text: str) -> tuple[bool, object]:
    """(True, value) when `text` is one JSON value; (False, None) otherwise (nesting too deep
    for the decoder included: a model can write 100,000 brackets)."""
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def tag_start(text: str, tag: str, pos: int = 0) -> int:
    """The length of the longest end of `text[pos:]` that begins `tag` (0 if none): what a
    stream holds back, since the rest of the tag may come in the next piece."""
    for n in range(min(len(text) - pos, len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HeldSpace:
    """Streamed content let out as it comes but for its trailing whitespace, held until text
    follows it: a reply with calls loses the whitespace its content ends with (the newlines
    before a call), one without them gets it back at the end, its text whole."""

    def __init__(self) -> None:
        self._space: list[str] = []  # whitespace after the content let out so far

    def out(self, text: str, content: list[str]) -> None:
        """Lets `text` out into `content`, its trailing whitespace held."""
        kept = text.rstrip()
        if not kept:
            if text:
                self._space.append(text)
            return
        content += self._space
        content.append(kept)
        self._space = [text[len(kept) :]] if len(kept) < len(text) else []

    def end(self, called: bool) -> list[str]:
        """The reply has ended: the whitespace held, unless the reply had calls."""
        space, self._space = self._space, []
        return [] if called else space


def back_to_back(pattern: re.Pattern[str], body: str) -> list[tuple[str, str]] | None:
    """`body` read as back-to-back matches of `pattern` (its two groups each); None if
    anything else is in it."""
    pairs, pos = [], 0
    while pos < len(body):
        match = pattern.match(body, pos)
        if match is None or match.end() == pos:
            return None if body[pos:].strip() else pairs
        pairs.append((match.group(1), match.group(2)))
        pos = match.end()
    return pairs


class AllOrNothingStream(ReplyStream):
    """A reply whose calls are all or nothing (llama3_json.py, whole_reply.py): held while
    it may still be calls, let out whole as text the moment it cannot, its calls given at
    the end when it is. A subclass's `_read` moves `_phase` to "text" (not calls) or
    "after" (calls in `_calls`, only whitespace since)."""

    def __init__(self) -> None:
        self._held: list[str] = []  # the reply so far, in pieces, while it may be calls
        self._phase = "start"  # "text" and "after" are this class's; the rest a subclass's
        self._calls: Sequence[Call] = ()

    def _read(self, text: str) -> None:
        raise NotImplementedError

    def feed(self, text: str) -> StreamStep:
        if self._phase == "text":
            return StreamStep(text)
        self._held.append(text)
        self._read(text)
        if self._phase == "text":
            held, self._held = "".join(self._held), []
            return StreamStep(held)
        return StreamStep()

    def finish(self) -> StreamStep:
        held, self._held = "".join(self._held), []
        if self._phase == "after":  # all calls, and only whitespace after them
            return StreamStep("", list(self._calls))
        return StreamStep(held)  # text: it was, or nothing more came to make it calls
