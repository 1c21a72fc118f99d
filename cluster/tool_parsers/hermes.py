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
    HeldSpace,
    ParsedReply,
    ReplyStream,
    StreamStep,
    ToolParser,
    loads,
    tag_start,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    # A block's tags (subclasses with other tags: harmony.py, deepseek.py, seed_oss.py)
    OPEN, CLOSE = OPEN, CLOSE

    def parse(self, text: str) -> ParsedReply:
        block = re.compile(f"({re.escape(self.OPEN)}.*?{re.escape(self.CLOSE)})", re.DOTALL)
        parts = block.split(text)  # text, block, text, block, ..., text
        opened = parts[-1].find(self.OPEN)
        if opened >= 0:  # a block left open at the end: text, block, "" in place of the text
            parts[-1:] = [parts[-1][:opened], parts[-1][opened:], ""]
        calls: list[Call] = []
        rest: list[str] = []
        for i, part in enumerate(parts):
            found = self.block_calls(part) if i % 2 else None
            if found is None:
                rest.append(part)
            else:
                calls += found
        if not calls:
            return ParsedReply(text, ())
        return ParsedReply("".join(rest).rstrip() or None, tuple(calls))

    def stream(self) -> ReplyStream:
        return _HermesStream(self)

    def block_calls(self, block: str) -> tuple[Call, ...] | None:
        """A block's calls (a block holds one, unless a subclass reads more: deepseek.py);
        None when it is not calls, and stays text."""
        call = self.block_call(block)
        return None if call is None else (call,)

    def block_call(self, block: str) -> Call | None:
        """A `<tool_call>...</tool_call>` block, or one left open at the end of the reply
        (no `</tool_call>` in it), as a call; None when it is not one."""
        assert block.startswith(OPEN), block[:20]
        ok, value = loads(block[len(OPEN) :].removesuffix(CLOSE))
        return self.call(value, ("arguments",)) if ok else None


class _HermesStream(ReplyStream):
    """Reads each piece once: an open block is kept as its pieces, searched for
    `</tool_call>` only in the new piece and the 11 characters before it, and joined once,
    when it closes or the reply ends (a 160,000-character block fed 4 characters a time
    was copied whole on each of its 40,000 feeds)."""

    def __init__(self, parser: HermesParser) -> None:
        self._parser = parser
        self._open, self._close = parser.OPEN, parser.CLOSE
        self._block: list[str] | None = None  # an open block's pieces, `<tool_call>` first
        self._tail = ""  # its last characters after `<tool_call>`: where a close may begin
        self._held = ""  # outside a block: text that may be a tag's beginning (< 11 chars)
        self._space = HeldSpace()
        self._calls = 0

    def feed(self, text: str) -> StreamStep:
        content: list[str] = []
        calls: list[Call] = []
        pos = 0  # how far `text` has been read
        while True:
            if self._block is not None:
                end = self._close_end(text, pos)
                if end is None:
                    self._block.append(text[pos:])
                    break
                block = "".join(self._block) + text[pos:end]
                self._block, pos = None, end
                found = self._parser.block_calls(block)
                if found is None:
                    self._space.out(block, content)
                else:
                    calls += found
                    self._calls += len(found)
                continue
            if self._held:
                text, pos = self._held + text[pos:], 0
            start = text.find(self._open, pos)
            if start < 0:
                start = len(text) - tag_start(text, self._open, pos)
                self._space.out(text[pos:start], content)
                self._held = text[start:]
                break
            self._space.out(text[pos:start], content)
            self._held, self._block, self._tail = "", [self._open], ""
            pos = start + len(self._open)
        return StreamStep("".join(content), calls)

    def finish(self) -> StreamStep:
        content: list[str] = []
        calls: list[Call] = []
        block = "".join(self._block) if self._block is not None else None
        found = self._parser.block_calls(block) if block is not None else None
        if found is None:
            # an open block that is no call, a tag's beginning
            self._space.out(block if block is not None else self._held, content)
        else:
            calls += found
            self._calls += len(found)
        content += self._space.end(called=self._calls > 0)
        self._block, self._tail, self._held = None, "", ""
        return StreamStep("".join(content), calls)

    def _close_end(self, text: str, pos: int) -> int | None:
        """Where in `text` the open block's `</tool_call>` ends, searching from `pos`; a
        close may begin in the tail. None when it has not come (the tail moves on)."""
        close = self._close
        keep = len(close) - 1
        seam = self._tail + text[pos : pos + keep]  # a close across the pieces' seam
        at = seam.find(close)
        if at >= 0:
            return pos + at + len(close) - len(self._tail)
        at = text.find(close, pos)
        if at >= 0:
            return at + len(close)
        self._tail = text[-keep:] if len(text) - pos >= keep else seam[-keep:]
        return None
