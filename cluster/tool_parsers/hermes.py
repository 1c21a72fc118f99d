"""`--tool-call-parser hermes`: tool calls as Hermes, Qwen2.5 and Qwen3 write them, each in a
block of its own:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

What is read (the whole reply, or a stream of it, alike):
- A block runs from `<tool_call>` to the first `</tool_call>` after it, or to the end of the
  reply when none follows (the model stopped at EOS or a stop string right after the JSON,
  as vLLM reads it too). It is a call when what it holds is one JSON object whose "name" is
  one of the request's tools and whose "arguments" is an object.
- Every other part of the reply is content, in order: the text before the first block,
  between blocks and after the last, and, verbatim with their tags, blocks that are not
  calls: JSON that does not parse (an open block cut by max_tokens mid-JSON, or with text
  or a piece of `</tool_call>` after its JSON), a name the request's tools lack, arguments
  that are not an object. Nothing the model wrote is dropped, and a call the client cannot
  use is never sent as one.
- With calls, the content's trailing whitespace goes (the newlines before a block) and
  content that is only whitespace is null. A reply without calls is its text, unchanged:
  one whose only block is malformed comes back whole, as plain text.

Streamed, content goes out as it comes until a `<tool_call>` may be starting (the tag, or
a piece of it at the end of the text so far); the block is held until its `</tool_call>`,
then sent as a call, or as content if it is not one. A block still open when the reply ends
can be read only then: it goes out at the end, as a call or as content. Trailing whitespace
is held until text follows it, since a call after it would drop it.
"""

from __future__ import annotations

import re

from pdserve.cluster.tool_parsers.base import (
    Call,
    ParsedReply,
    ReplyStream,
    StreamStep,
    ToolParser,
    loads,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(f"({re.escape(OPEN)}.*?{re.escape(CLOSE)})", re.DOTALL)


class HermesParser(ToolParser):
    def parse(self, text: str) -> ParsedReply:
        parts = _BLOCK.split(text)  # text, block, text, block, ..., text
        opened = parts[-1].find(OPEN)
        if opened >= 0:  # a block left open at the end: text, block, "" in place of the text
            parts[-1:] = [parts[-1][:opened], parts[-1][opened:], ""]
        calls: list[Call] = []
        rest: list[str] = []
        for i, part in enumerate(parts):
            call = self.block_call(part) if i % 2 else None
            if call is None:
                rest.append(part)
            else:
                calls.append(call)
        if not calls:
            return ParsedReply(text, ())
        return ParsedReply("".join(rest).rstrip() or None, tuple(calls))

    def stream(self) -> ReplyStream:
        return _HermesStream(self)

    def block_call(self, block: str) -> Call | None:
        """A `<tool_call>...</tool_call>` block, or one left open at the end of the reply
        (no `</tool_call>` in it), as a call; None when it is not one."""
        assert block.startswith(OPEN), block[:20]
        ok, value = loads(block[len(OPEN) :].removesuffix(CLOSE))
        return self.call(value, ("arguments",)) if ok else None


class _HermesStream(ReplyStream):
    def __init__(self, parser: HermesParser) -> None:
        self._parser = parser
        # Held: a block from its `<tool_call>` on, or text that may be a tag's beginning.
        self._held = ""
        self._searched = 0  # an open block's text already searched for `</tool_call>`
        self._space = ""  # whitespace after the content let out so far
        self._calls = 0

    def feed(self, text: str) -> StreamStep:
        self._held += text
        step = StreamStep()
        while self._held:
            if self._held.startswith(OPEN):
                start = max(len(OPEN), self._searched - len(CLOSE) + 1)
                end = self._held.find(CLOSE, start)
                if end < 0:
                    self._searched = len(self._held)
                    break
                end += len(CLOSE)
                block, self._held, self._searched = self._held[:end], self._held[end:], 0
                call = self._parser.block_call(block)
                if call is None:
                    self._content(block, step)
                else:
                    step.calls.append(call)
                    self._calls += 1
                continue
            start = self._held.find(OPEN)
            if start < 0:
                start = len(self._held) - _tag_start(self._held)
            self._content(self._held[:start], step)
            self._held = self._held[start:]
            if not self._held.startswith(OPEN):
                break
        return step

    def finish(self) -> StreamStep:
        step = StreamStep()
        call = self._parser.block_call(self._held) if self._held.startswith(OPEN) else None
        if call is None:
            self._content(self._held, step)  # an open block that is no call, a tag's beginning
        else:
            step.calls.append(call)
            self._calls += 1
        if not self._calls:  # a reply without calls is its text, whole
            step.content += self._space
        self._held, self._space = "", ""
        return step

    def _content(self, text: str, step: StreamStep) -> None:
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        step.content += kept


def _tag_start(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>` (0 if none)."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
