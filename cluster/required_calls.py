"""A `tool_choice: "required"` reply read as it streams: which call each piece of it
belongs to, the call's name once whole, and its arguments' text as it comes.

Structured output holds such a reply to `[{"name": "...", "parameters": {...}}, ...]`
(cluster/tool_calls.py; JSON with at most one space between tokens, the properties in
the schema's order), so a character scan with a little state knows at every point where
it is: inside a call object (depth 2), reading a key or the name string, or inside the
parameters value, whose characters are the call's `arguments`, as the model wrote them
(whitespace around the value left out). The whole reply is read by the same scan, so a
stream's arguments joined equal the whole reply's, however it was cut into pieces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class CallPiece:
    """What a piece of the reply adds to one call: its name when first seen (the call's
    first piece), and argument text."""

    index: int  # the call's position in the reply
    name: str | None = None
    arguments: str = ""


@dataclass
class RequiredReader:
    _depth: int = 0
    _in_str: bool = False
    _escaped: bool = False
    _literal: str | None = None  # a key or the name string being read (depth 2)
    _key: str | None = None  # the last key read in the current call
    _value_of: str | None = None  # after a ':' at depth 2: whose value comes next
    _in_arguments: bool = False
    _index: int = -1  # the current call
    closed: bool = False  # the array has ended: the reply is whole
    _pieces: list[CallPiece] = field(default_factory=list)

    def feed(self, text: str) -> list[CallPiece]:
        """The next piece of the reply -> what it adds, call by call, in order."""
        self._pieces = []
        for ch in text:
            self._step(ch)
        return self._pieces

    def _step(self, ch: str) -> None:
        if self._in_str:
            if self._in_arguments:
                self._add(ch)
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_str = False
                if self._literal is not None:
                    self._end_literal()
                return
            if self._literal is not None:
                self._literal += ch
            return
        if ch in " \t\r\n" and self._depth <= 2:
            return  # between tokens (inside the parameters value, depth > 2, it is kept)
        if self._value_of not in (None, "name"):  # a value's first character (depth 2);
            # the name's value is read as a string literal, which `_end_literal` ends
            self._in_arguments = self._value_of == "parameters"
            self._value_of = None
        if self._in_arguments and self._depth == 2 and ch in ",}":
            self._in_arguments = False  # the parameters value ended before this
        if self._in_arguments:
            self._add(ch)
        if ch == '"':
            self._in_str = True
            if self._depth == 2 and not self._in_arguments:
                self._literal = ""
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2 and ch == "{":
                self._index += 1
                self._key = None
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self.closed = True
        elif ch == ":" and self._depth == 2 and not self._in_arguments:
            self._value_of = self._key

    def _end_literal(self) -> None:
        text, self._literal = json.loads(f'"{self._literal}"'), None
        if self._value_of == "name":
            self._value_of = None
            self._pieces.append(CallPiece(self._index, name=text))
        else:
            self._key = text

    def _add(self, ch: str) -> None:
        last = self._pieces[-1] if self._pieces else None
        if last is None or last.index != self._index:
            last = CallPiece(self._index)
            self._pieces.append(last)
        last.arguments += ch


def read_required(text: str) -> list[tuple[str, str]]:
    """A whole reply's calls as (name, arguments text)."""
    return [(p.name or "", p.arguments) for p in RequiredReader().feed(text)]
