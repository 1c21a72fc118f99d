"""`--tool-call-parser pythonic`: tool calls as Llama 3.2 and Llama 4 (and ToolACE) write
them with pythonic tools, the whole reply being a Python list of calls:

    [get_weather(city="Oslo", unit="celsius"), get_time()]

The reply, but for whitespace around it, is calls when it is exactly such a list: each item
one of the request's tools called by its bare name with keyword arguments only, each value
a Python literal (strings, numbers, True/False/None, lists, tuples, dicts) that JSON can
hold; the keywords are the arguments object. The list is read with `ast`, never evaluated.
Anything else is text, whole (whole_reply.py, which says how it streams): text before or
after the list, a tool the request lacks, a positional argument or `**kwargs`, a keyword
given twice, a value that is an expression (`f()`, `a + b`, a bare name) or has no JSON
form (a set, bytes, NaN). vLLM reads the same lists but takes only constants, lists and
dicts as values (not `-1` or a tuple), drops positional arguments, and wants the `[` first.

Where the list ends is found by its brackets, outside strings (quoted by `'` or `"`, or
triple-quoted, escapes skipped); a `#` comment is not read as one. Streamed, the list is
text as soon as its head cannot begin a call: `[`, whitespace, a name no tool's begins with.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Set

from pdserve.cluster.tool_parsers.base import Call
from pdserve.cluster.tool_parsers.whole_reply import REJECT, ListEnd, WholeReplyParser

_SPACE = " \t\r\n\f"  # Python's whitespace between tokens
_NAME_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
_NAME_CHARS = _NAME_START + "0123456789"
# The characters that matter to where the list ends: outside strings, a string's open and
# brackets; in a string, its quote and an escape (whose next character is skipped).
_OUTSIDE = re.compile(r"""["'()\[\]{}]""")
_IN_STRING = {"'": re.compile(r"['\\]"), '"': re.compile(r'["\\]')}


class PythonicParser(WholeReplyParser):
    def scanner(self) -> ListEnd:
        return _CallListEnd(self.tool_names)

    def read(self, value: str) -> tuple[Call, ...] | None:
        try:
            tree = ast.parse(value, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None  # not Python, a null byte, nesting past the parser's limit
        items = tree.body.elts if isinstance(tree.body, ast.List) else []
        calls = [self._call(item) for item in items]
        return tuple(calls) if calls and None not in calls else None

    def _call(self, node: ast.expr) -> Call | None:
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in self.tool_names
            and not node.args
        ):
            return None
        keys = [k.arg for k in node.keywords]
        if None in keys or len(set(keys)) < len(keys):  # `**kwargs`, a keyword twice
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None  # not a literal, or one JSON cannot hold (a set, bytes, NaN)
        return Call(node.func.id, text)


class _CallListEnd:
    """Scans a list of calls from its `[`, each character once (regexes jump to the next
    one that matters; only a string's quotes are looked at one by one, to tell `''` from
    `'''`). Before the first call's `(` the head is read: `[`, whitespace, a name that
    begins a tool's, whitespace; anything else there cannot be calls."""

    def __init__(self, tool_names: Set[str]) -> None:
        self._tools = tool_names
        self._head = "open"  # open | lead | name | gap | done
        self._name = ""  # the first call's name, so far
        self._depth = 0  # brackets open
        self._quote = ""  # the open string's quote; "" outside strings
        self._opening = 0  # quotes in a row that opened a string, while 1 or 2
        self._triple = False
        self._run = 0  # quotes in a row inside a triple-quoted string
        self._escaped = False  # a `\\` in a string ended the last piece

    def end(self, text: str, pos: int) -> int | None:
        if self._head != "done":
            pos = self._read_head(text, pos)
            if pos < 0 or self._head != "done":
                return REJECT if pos < 0 else None
        while pos < len(text):
            if self._opening:
                pos = self._open_string(text, pos)
            elif self._quote:
                pos = self._in_string(text, pos)
            else:
                mark = _OUTSIDE.search(text, pos)
                if mark is None:
                    return None
                char, pos = mark.group(), mark.end()
                if char in "'\"":
                    self._quote, self._opening = char, 1
                elif char in "([{":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        return pos
        return None

    def _read_head(self, text: str, pos: int) -> int:
        """Reads the head on from `pos`: where it ended (after the `(`), or the piece's end;
        REJECT when it cannot begin a call."""
        for at in range(pos, len(text)):  # a few characters, but for whitespace
            char = text[at]
            if self._head == "open":
                assert char == "[", text[at : at + 20]
                self._head, self._depth = "lead", 1
            elif char in _SPACE and self._head != "name":
                continue
            elif self._head == "lead" and char in _NAME_START:
                self._head, self._name = "name", char
            elif self._head == "name" and char in _NAME_CHARS:
                self._name += char
            elif char in _SPACE or char == "(":  # the name ends
                if self._name not in self._tools:
                    return REJECT
                if char == "(":
                    self._head, self._depth = "done", 2
                    return at + 1
                self._head = "gap"
                continue
            else:
                return REJECT
            if self._head == "name" and not any(t.startswith(self._name) for t in self._tools):
                return REJECT
        return len(text)

    def _open_string(self, text: str, pos: int) -> int:
        """After one or two quotes outside a string: a third opens a triple-quoted string,
        anything else after two closes an empty one, after one begins the string's text."""
        if text[pos] == self._quote:
            self._opening += 1
            if self._opening == 3:
                self._opening, self._triple, self._run = 0, True, 0
            return pos + 1
        if self._opening == 2:
            self._quote = ""
        self._opening = 0
        return pos

    def _in_string(self, text: str, pos: int) -> int:
        if self._escaped:  # the escaped character, skipped
            self._escaped = False
            return pos + 1
        mark = _IN_STRING[self._quote].search(text, pos)
        if mark is None:
            self._run = 0 if pos < len(text) else self._run
            return len(text)
        at = mark.start()
        if mark.group() == "\\":
            self._run = 0
            self._escaped = at + 1 == len(text)
            return at + 2 if not self._escaped else len(text)
        self._run = self._run + 1 if at == pos else 1
        if not self._triple or self._run == 3:
            self._quote, self._triple, self._run = "", False, 0
        return at + 1
