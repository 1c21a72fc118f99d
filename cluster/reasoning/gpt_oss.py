"""`--reasoning-parser openai_gptoss`: gpt-oss's harmony replies, split by channel.

gpt-oss's chat template ends the prompt with `<|start|>assistant`; the reply is one or
more messages, each a header and a body:

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.

What is read (the whole reply, or a stream of it, alike):
- A message's header runs from `<|channel|>` to `<|message|>`; its channel is the
  header's first word. Its body runs to `<|end|>`, `<|return|>`, `<|call|>`, `<|start|>`
  or the end of the reply; `<|start|>` and the role after it open the next message.
- A message with a recipient (`to=functions.get_weather`, in its header or after its
  role, `<|start|>assistant to=...`) is a tool call. It goes into the answer in one
  canonical form, `<|channel|>commentary to=RECIPIENT<|message|>ARGUMENTS<|call|>` (no
  `<|call|>` when the reply ends inside it), for `--tool-call-parser openai` to read
  (cluster/tool_parsers/harmony.py); without that parser the client sees it as text.
- Bodies of other `analysis` messages are the reasoning; bodies of every other channel
  (`final`, `commentary` preambles) are the answer, joined in order. Headers and
  markers are dropped.
- A reply that opens with neither `<|channel|>` nor a recipient (a grammar held it from
  its first token, or the model answered plainly) is all answer, verbatim.

The markers are special tokens, so a request read by this parser is detokenized with
them (`needs_special_tokens`).
"""

from __future__ import annotations

import re

from pdserve.cluster.reasoning.base import Reasoned, ReasoningParser, ReasoningStep

CHANNEL, MESSAGE, START, CALL = "<|channel|>", "<|message|>", "<|start|>", "<|call|>"
BODY_ENDS = ("<|end|>", "<|return|>", CALL, START)
_MARKERS = (CHANNEL, MESSAGE, *BODY_ENDS)
ROLE_RECIPIENT = " to="  # how a reply may open: the prompt's role, then its recipient
_RECIPIENT = re.compile(r"to=([^\s<]+)")
TOOL_OPEN = "<|channel|>commentary to="  # a tool call's canonical header, up to its recipient


class GptOssReasoningParser(ReasoningParser):
    needs_special_tokens = True
    grammar_after_reasoning = False  # channels, not tags: a grammar holds the whole reply

    def parse(self, text: str) -> Reasoned:
        stream = self.stream()
        step = stream.feed(text).then(stream.finish())
        return Reasoned(step.reasoning or None, step.content or None)

    def stream(self) -> HarmonyStream:
        return HarmonyStream()


class HarmonyStream:
    """One streamed reply. Held back: the end of a body while it may be the start of a
    marker, a message's role and header until its `<|message|>`."""

    def __init__(self) -> None:
        self._phase = "start"  # start | role | header | body | plain
        self._held = ""
        self._recipient: str | None = None  # from the role, before the header
        self._kind = "content"  # the current body's: reasoning | content | call

    def feed(self, text: str) -> ReasoningStep:
        step = ReasoningStep()
        if self._phase == "plain":
            step.content = text
            return step
        self._held += text
        while True:
            if self._phase == "start":
                opens = (CHANNEL, ROLE_RECIPIENT)
                if any(o.startswith(self._held) and self._held != o for o in opens):
                    return step  # may still open a message
                if not self._held.startswith(opens):  # a plain reply: all answer
                    step.content += self._held
                    self._phase, self._held = "plain", ""
                    return step
                self._phase = "role"
            if self._phase == "role":  # after `<|start|>`: the role, maybe a recipient
                at = self._held.find(CHANNEL)
                if at < 0:
                    return step
                found = _RECIPIENT.search(self._held[:at])
                self._recipient = found.group(1) if found else None
                self._held, self._phase = self._held[at + len(CHANNEL) :], "header"
            if self._phase == "header":
                at = self._held.find(MESSAGE)
                if at < 0:
                    return step
                self._open_body(self._held[:at], step)
                self._held, self._phase = self._held[at + len(MESSAGE) :], "body"
            if self._phase == "body":
                end, marker = _first_marker(self._held)
                if marker is None:
                    keep = _marker_start(self._held)
                    self._emit(step, self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    return step
                self._emit(step, self._held[:end])
                if self._kind == "call":
                    step.content += CALL
                self._held = self._held[end + len(marker) :]
                self._phase = "role"

    def finish(self) -> ReasoningStep:
        """The reply has ended: a body's held end is its text; an unfinished header or
        marker between messages is dropped."""
        step = ReasoningStep()
        if self._phase == "start":
            step.content = self._held
        elif self._phase == "body":
            self._emit(step, self._held)
        self._held = ""
        return step

    def _open_body(self, header: str, step: ReasoningStep) -> None:
        channel = header.strip().split(" ", 1)[0].split("<|", 1)[0]
        found = _RECIPIENT.search(header)
        recipient = found.group(1) if found else self._recipient
        if recipient is not None:
            self._kind = "call"
            step.content += f"{TOOL_OPEN}{recipient}{MESSAGE}"
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"

    def _emit(self, step: ReasoningStep, body: str) -> None:
        if self._kind == "reasoning":
            step.reasoning += body
        else:
            step.content += body


def _first_marker(text: str) -> tuple[int, str | None]:
    """Where the first body-ending marker in `text` starts, and which it is."""
    found = [(text.find(m), m) for m in BODY_ENDS if m in text]
    return min(found) if found else (-1, None)


def _marker_start(text: str) -> int:
    """The length of the longest end of `text` that begins some marker (0 if none)."""
    for n in range(min(len(text), max(map(len, _MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in _MARKERS):
            return n
    return 0
