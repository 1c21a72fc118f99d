"""`--tool-call-parser granite`: tool calls as IBM Granite 3.0 and 3.1 write them, the whole
reply being a JSON array of calls after Granite's marker:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, ...]

The marker is `<|tool_call|>` (Granite 3.0's token; where the tokenizer marks it special
it is skipped and the reply opens at the `[`, so a bare array reads too) and then, or
instead, `<tool_call>` (Granite 3.1 writes the string), whitespace around each. The reply
is calls when, after them, it is one array whose every item names one of the request's
tools with an "arguments" object, and only whitespace follows it; otherwise it is text,
whole (whole_reply.py says how it streams).
"""

from __future__ import annotations

from pdserve.cluster.tool_parsers.base import Call, loads
from pdserve.cluster.tool_parsers.json_end import JsonEnd
from pdserve.cluster.tool_parsers.whole_reply import ListEnd, WholeReplyParser


class GraniteParser(WholeReplyParser):
    TAGS = ("<|tool_call|>", "<tool_call>")

    def scanner(self) -> ListEnd:
        return JsonEnd()

    def read(self, value: str) -> tuple[Call, ...] | None:
        ok, calls = loads(value)
        return self.array_calls(calls, ("arguments",)) if ok else None
