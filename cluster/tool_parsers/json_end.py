"""Where a JSON object or array that arrives in pieces ends, found by its brackets before it
is decoded: the streams of llama3_json, mistral and granite hold a call's JSON until then.

In valid JSON the bracket that brings the count back to zero (outside strings) is the
value's end, so a value whose text to there does not decode is not JSON whatever follows.
This module does not decode: it only says where to.
"""

from __future__ import annotations

import re

# The characters that matter to where a value ends: in a string its close and an escape
# (whose next character is skipped); outside one, a string's open and brackets.
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


class JsonEnd:
    """Scans one value, from its opening bracket on, piece by piece, each character once
    (a regex jumps to the next one that matters): the state is carried from piece to piece."""

    def __init__(self) -> None:
        self._depth = 0  # brackets open
        self._in_string = False
        self._escaped = False  # a `\\` in a string ended the last piece

    def end(self, text: str, pos: int = 0) -> int | None:
        """Scans on through `text` from `pos`: where the value ends once its brackets close,
        None when they have not yet."""
        if self._escaped and pos < len(text):  # the escaped character, skipped
            self._escaped, pos = False, pos + 1
        while True:
            mark = (_IN_STRING if self._in_string else _OUTSIDE).search(text, pos)
            if mark is None:
                return None
            char, at = mark.group(), mark.start()
            if char == "\\":
                if at + 1 == len(text):
                    self._escaped = True  # the escaped character has not come yet
                    return None
                pos = at + 2
                continue
            pos = at + 1
            if char == '"':
                self._in_string = not self._in_string
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return pos
