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
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
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
