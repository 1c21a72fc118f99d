"""`--tool-call-parser seed_oss`: tool calls as Seed-OSS writes them, qwen3_coder's tagged
arguments (xml_calls.py) in blocks of Seed's own tags:

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </seed:tool_call>

Blocks, their arguments typed by the tool's parameters schema, the text around them and the
streaming are qwen3_coder's. What Seed-OSS adds is its thinking: a reply that opens (after
whitespace) with `<seed:think>` thinks up to the first `</seed:think>`, and that part is
content, verbatim, never read for calls (a call drafted while thinking is not made); the
calls are read after it. Thinking never closed (cut by max_tokens) is all content. vLLM
reads the calls after the thinking alike when both tags are there (it reads all of a reply
whose thinking never closed).
"""

from __future__ import annotations

from pdserve.cluster.tool_parsers.base import ParsedReply, ReplyStream, StreamStep
from pdserve.cluster.tool_parsers.xml_calls import Qwen3CoderParser

THINK, THINK_END = "<seed:think>", "</seed:think>"


class SeedOssParser(Qwen3CoderParser):
    OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"

    def parse(self, text: str) -> ParsedReply:
        thinking, answer = split_thinking(text)
        reply = super().parse(answer)
        if not reply.calls:
            return ParsedReply(text, ())
        return ParsedReply(thinking + (reply.content or "") or None, reply.calls)

    def stream(self) -> ReplyStream:
        return _ThinkingFirst(super().stream())


def split_thinking(text: str) -> tuple[str, str]:
    """A reply as its thinking (up to and with the first `</seed:think>`, all of it when
    none follows; "" when the reply does not open with `<seed:think>`) and the rest."""
    if not text.lstrip().startswith(THINK):
        return "", text
    end = text.find(THINK_END)
    if end < 0:
        return text, ""
    end += len(THINK_END)
    return text[:end], text[end:]


class _ThinkingFirst(ReplyStream):
    """Lets the thinking out as content as it comes, and hands what follows it to the
    blocks' stream (`answer`)."""

    def __init__(self, answer: ReplyStream) -> None:
        self._answer = answer
        self._phase = "start"  # start | think | answer
        self._head = ""  # start: the reply so far, whitespace then a piece of <seed:think>
        self._tail = ""  # think: its last characters, where </seed:think> may begin

    def feed(self, text: str) -> StreamStep:
        if self._phase == "answer":
            return self._answer.feed(text)
        if self._phase == "start":
            head = self._head + text
            opening = head.lstrip()
            if len(opening) < len(THINK) and THINK.startswith(opening):
                self._head = head
                return StreamStep()
            self._head = ""
            if not opening.startswith(THINK):
                self._phase = "answer"
                return self._answer.feed(head)
            self._phase, text = "think", head
        seam = self._tail + text  # an end tag across the pieces' seam
        end = seam.find(THINK_END)
        if end < 0:
            self._tail = seam[1 - len(THINK_END) :]
            return StreamStep(text)
        end += len(THINK_END) - len(self._tail)  # where the thinking ends in `text`
        self._phase, self._tail = "answer", ""
        return StreamStep(text[:end]).then(self._answer.feed(text[end:]))

    def finish(self) -> StreamStep:
        head, self._head = self._head, ""
        step = self._answer.feed(head) if head else StreamStep()
        return step.then(self._answer.finish())
