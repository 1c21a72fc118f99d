"""`--tool-call-parser mistral`: tool calls as Mistral's models write them (Mistral 7B v0.3,
Mistral Small, Ministral, Magistral, Devstral), after the `[TOOL_CALLS]` control token, in
the form of their tokenizer's version:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, ...]    (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}      (v11 on)

What is read (the whole reply, or a stream of it, alike):
- A call opens at `[TOOL_CALLS]` (whitespace may follow it) and ends where its JSON does:
  either an array of objects, each naming one of the request's tools with an "arguments"
  object (all of them calls, or the array is text), or the name of one of the tools, then
  `[ARGS]` (vLLM takes the name followed directly by the `{` too), then the arguments
  object. Text before, between and after calls is content, by hermes's rules (hermes.py):
  less its trailing whitespace when there are calls, null when nothing else is left.
- Anything else is content, verbatim, `[TOOL_CALLS]` and all: a name the request's tools
  lack, no `[ARGS]` or `{` after the name, JSON that does not parse or is cut short
  (max_tokens), arguments that are not an object. A reply without calls is its text.
vLLM knows from the tokenizer which form to expect; here either is read. It sends a v11
call's text after the name as its arguments even when that is not JSON, and drops what
follows a pre-v11 array: here such a call stays text, and nothing the model wrote is lost.

`[TOOL_CALLS]` is a special token, so requests answered with this parser are detokenized
with special tokens (`needs_special_tokens`; vLLM sets `skip_special_tokens: false` for
them alike). Any other special token the model writes then reaches the text too and stays
in the content as written, as on vLLM: `[/INST]` in a reply that runs on, or `</s>` after
the calls when `include_stop_str_in_output` keeps the stop token's text (otherwise the
EOS's text is dropped, a stop token's: runner/stop_checker.py). After a call's JSON such a
token is content, never part of the arguments.

Streamed, content goes out as it comes until a `[TOOL_CALLS]` may be starting (the tag, or
a piece of it at the end of the text so far); a call is held until its JSON closes
(json_end.py), then sent as a call, or let out as content if it is not one. One that cannot
become a call (a name that no tool's begins with, or not followed by `[ARGS]` or `{`) goes
out as content as soon as that shows.
"""

from __future__ import annotations

import json
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
from pdserve.cluster.tool_parsers.json_end import JsonEnd

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_-]*")  # a function name's characters (OpenAI's rule)
_SPACE = re.compile(r"\s*")


class MistralParser(ToolParser):
    needs_special_tokens = True  # `[TOOL_CALLS]` is one

    def parse(self, text: str) -> ParsedReply:
        stream = self.stream()
        step = stream.feed(text).then(stream.finish())
        if not step.calls:
            return ParsedReply(text, ())
        return ParsedReply(step.content or None, tuple(step.calls))

    def stream(self) -> ReplyStream:
        return _MistralStream(self)

    def head(self, head: str) -> str | None:
        """What follows `[TOOL_CALLS]` and its whitespace, so far (read a character at a
        time): "array" when it is `[`, whitespace and `{` (the JSON is all of it), "object"
        when the arguments' `{` ends it, "text" when it cannot be a call, None while it may
        still be one."""
        if head[0] == "[":
            if len(head) == 1 or head[-1].isspace():
                return None
            return "array" if head[-1] == "{" else "text"
        name = _NAME.match(head).group()
        rest = head[len(name) :]
        if not rest:
            return None if any(t.startswith(name) for t in self.tool_names) else "text"
        if name not in self.tool_names:
            return "text"
        if rest in ("{", ARGS + "{"):
            return "object"
        return None if ARGS.startswith(rest) else "text"

    def read(self, name: str | None, value: str) -> tuple[Call, ...] | None:
        """A call's JSON as its calls: the arguments of `name`, or an array of calls when
        `name` is None; None when it is not calls."""
        ok, decoded = loads(value)
        if not ok:
            return None
        if name is None:
            return self.array_calls(decoded, ("arguments",))
        if not isinstance(decoded, dict):
            return None
        return (Call(name, json.dumps(decoded, ensure_ascii=False)),)


class _MistralStream(ReplyStream):
    """Reads each piece once: outside calls it looks for `[TOOL_CALLS]`; after one, at the
    few characters of the name and `[ARGS]`, one by one; then for the JSON's end, by its
    brackets. A call's text is kept as its pieces, joined once, when it is read."""

    def __init__(self, parser: MistralParser) -> None:
        self._parser = parser
        self._phase = "text"  # text | head | value
        self._held = ""  # text: what may be a `[TOOL_CALLS]`'s beginning (< 12 chars)
        self._block: list[str] = []  # head, value: the call's text before its JSON
        self._head = ""  # head: what follows `[TOOL_CALLS]` and its whitespace
        self._name: str | None = None  # value: the call's name; None for an array of calls
        self._value: list[str] = []  # value: the JSON's pieces
        self._scan = JsonEnd()
        self._space = HeldSpace()
        self._calls = 0

    def feed(self, text: str) -> StreamStep:
        content: list[str] = []
        calls: list[Call] = []
        pos = 0  # how far `text` has been read
        while pos < len(text):
            if self._phase == "text":
                if self._held:
                    text, pos, self._held = self._held + text[pos:], 0, ""
                pos = self._read_text(text, pos, content)
            elif self._phase == "head":
                pos = self._read_head(text, pos, content)
            else:
                pos = self._read_value(text, pos, content, calls)
        return StreamStep("".join(content), calls)

    def finish(self) -> StreamStep:
        content: list[str] = []
        if self._phase == "text":  # a tag's beginning
            rest = self._held
        else:  # a call that never became one: no `[ARGS]`, its JSON cut short
            rest = "".join(self._block) + self._head + "".join(self._value)
        self._space.out(rest, content)
        content += self._space.end(called=self._calls > 0)
        self._phase, self._held, self._block, self._head, self._value = "text", "", [], "", []
        return StreamStep("".join(content))

    def _read_text(self, text: str, pos: int, content: list[str]) -> int:
        start = text.find(TOOL_CALLS, pos)
        if start < 0:
            start = len(text) - tag_start(text, TOOL_CALLS, pos)
            self._space.out(text[pos:start], content)
            self._held = text[start:]
            return len(text)
        self._space.out(text[pos:start], content)
        self._phase, self._block, self._head = "head", [TOOL_CALLS], ""
        return start + len(TOOL_CALLS)

    def _read_head(self, text: str, pos: int, content: list[str]) -> int:
        while pos < len(text):
            space = _SPACE.match(text, pos).end() if not self._head else pos
            if space > pos:  # the whitespace after `[TOOL_CALLS]`
                self._block.append(text[pos:space])
                pos = space
                continue
            self._head += text[pos]
            pos += 1
            form = self._parser.head(self._head)
            if form is None:
                continue
            if form == "text":
                # Content; the head holds no whole tag (it is text at a tag's second
                # character), but may end with the beginning of one.
                head = self._head
                keep = tag_start(head, TOOL_CALLS)
                self._space.out("".join(self._block) + head[: len(head) - keep], content)
                self._phase, self._held = "text", head[len(head) - keep :]
                self._block, self._head = [], ""
                return pos
            json_at = 0 if form == "array" else len(self._head) - 1  # where the JSON opens
            self._name = None if form == "array" else _NAME.match(self._head).group()
            self._block.append(self._head[:json_at])
            self._value, self._scan = [self._head[json_at:]], JsonEnd()
            opened = self._scan.end(self._value[0])  # the JSON's opening brackets
            assert opened is None, self._head
            self._phase, self._head = "value", ""
            return pos
        return pos

    def _read_value(self, text: str, pos: int, content: list[str], calls: list[Call]) -> int:
        end = self._scan.end(text, pos)
        if end is None:
            self._value.append(text[pos:])
            return len(text)
        self._value.append(text[pos:end])
        value = "".join(self._value)
        found = self._parser.read(self._name, value)
        if found is None:
            self._space.out("".join(self._block) + value, content)
        else:
            calls += found
            self._calls += len(found)
        self._phase, self._block, self._value = "text", [], []
        return end
