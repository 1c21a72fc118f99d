"""`--reasoning-parser openai_gptoss`: gpt-oss's harmony replies, split by channel.

gpt-oss's chat template ends the prompt with `<|start|>assistant`; the reply is one or
more messages, each a header and a body:

    <|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final<|message|>Paris.

What is read (the whole reply, or a stream of it, alike):
- A message's header runs from `<|channel|>` to `<|message|>`; its channel is the
  header's first word (a recipient such as ` to=functions.get_weather` or a
  `<|constrain|>` may follow it). Its body runs to `<|end|>`, `<|return|>`, `<|call|>`,
  `<|start|>` or the end of the reply; `<|start|>` and the role after it open the next
  message.
- Bodies of `analysis` messages are the reasoning; bodies of every other channel
  (`final`, `commentary`) are the answer, joined in order. Headers and markers are
  dropped.
- A reply that does not open with `<|channel|>` (a grammar held it from its first token,
  or the model answered plainly) is all answer, verbatim.

The markers are special tokens, so a request read by this parser is detokenized with
them (`needs_special_tokens`); nothing of them reaches the client. Tool calls
(`commentary` messages to `functions.*`) are not read as calls: their bodies go out as
answer text.
"""

from __future__ import annotations

from pdserve.cluster.reasoning.base import Reasoned, ReasoningParser, ReasoningStep

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", START)
_MARKERS = (CHANNEL, MESSAGE, *BODY_ENDS)


class GptOssReasoningParser(ReasoningParser):
    needs_special_tokens = True

    def parse(self, text: str) -> Reasoned:
        stream = self.stream()
        step = stream.feed(text).then(stream.finish())
        return Reasoned(step.reasoning or None, step.content or None)

    def stream(self) -> HarmonyStream:
        return HarmonyStream()


class HarmonyStream:
    """One streamed reply. Held back: the end of a body while it may be the start of a
    marker, and a header until its `<|message|>`."""

    def __init__(self) -> None:
        self._phase = "start"  # start | header | body | between | plain
        self._held = ""
        self._reasoning = False  # the current body is an analysis message's

    def feed(self, text: str) -> ReasoningStep:
        step = ReasoningStep()
        if self._phase == "plain":
            step.content = text
            return step
        self._held += text
        while True:
            if self._phase == "start":
                if CHANNEL.startswith(self._held) and self._held != CHANNEL:
                    return step  # may still be `<|channel|>`
                if not self._held.startswith(CHANNEL):  # a plain reply: all answer
                    step.content += self._held
                    self._phase, self._held = "plain", ""
                    return step
                self._phase = "between"
            if self._phase == "between":  # expecting `<|channel|>` (after `<|start|>role`)
                at = self._held.find(CHANNEL)
                if at < 0:
                    return step
                self._held, self._phase = self._held[at + len(CHANNEL) :], "header"
            if self._phase == "header":
                at = self._held.find(MESSAGE)
                if at < 0:
                    return step
                header = self._held[:at].strip()
                self._reasoning = header.split(" ", 1)[0].split("<|", 1)[0] == "analysis"
                self._held, self._phase = self._held[at + len(MESSAGE) :], "body"
            if self._phase == "body":
                end, marker = _first_marker(self._held)
                if marker is None:
                    keep = _marker_start(self._held)
                    self._emit(step, self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    return step
                self._emit(step, self._held[:end])
                self._held = self._held[end + len(marker) :]
                self._phase = "between"

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

    def _emit(self, step: ReasoningStep, body: str) -> None:
        if self._reasoning:
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
