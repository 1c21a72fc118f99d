"""`tool_choice: "auto"` replies in OpenAI's shapes: the server's tool-call parser
(cluster/tool_parsers/) reads a chat choice's generated text, whole or as it streams, and
its calls become `tool_calls` (ids made here), the rest `content`.

Only the generated text is read, as in vLLM: with `continue_final_message` the words the
client began the turn with are not part of it (with `echo` they go before the content,
untouched). With `parallel_tool_calls: false` only the first call is returned, as on
vLLM. `finish_reason` is `tool_calls` when calls were found and the model stopped;
a reply cut by max_tokens stays `length`: a call whose JSON it cut short is returned as
text, and one cut after its JSON (a hermes block left open) is a call, as in vLLM.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdserve.cluster.tool_calls import ToolChoice, tool_call
from pdserve.cluster.tool_parsers.base import Call, ReplyStream


def auto_reply(choice: ToolChoice, body: dict, echoed: str, text: str) -> dict:
    """A whole chat choice (`body`, its message holding `echoed + text`) with the calls
    the parser finds in `text`; unchanged when there are none."""
    reply = choice.reader().parse(text)
    if reply.calls:
        body["message"] = {
            "role": body["message"]["role"],
            "content": (echoed + (reply.content or "")) or None,
            "tool_calls": _calls(reply.calls if choice.parallel else reply.calls[:1]),
        }
        if body["finish_reason"] == "stop":
            body["finish_reason"] = "tool_calls"
    return body


class AutoToolStream:
    """A streamed chat's auto tool calls, choice by choice: content deltas for text that
    cannot be a call, a tool_calls delta per call when whole (index counting up, each with
    its id, type, name and whole arguments), and what is held let out at the end."""

    def __init__(self, choice: ToolChoice) -> None:
        self._parser = choice.reader()
        self._most = None if choice.parallel else 1  # calls a reply may return
        self._streams: dict[int, ReplyStream] = {}  # choice index -> its reader
        self._sent: Counter[int] = Counter()  # choice index -> calls sent

    def delta(
        self, index: int, body: dict, echoed: str, text: str, finish: str | None
    ) -> dict | None:
        """The chunk body for this piece of a choice's text; None to send nothing yet."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._parser.stream()
        step = stream.feed(text)
        if finish is not None:
            step = step.then(stream.finish())
            del self._streams[index]
        delta: dict[str, Any] = {}
        if echoed + step.content:
            delta["content"] = echoed + step.content
        first = self._sent[index]
        kept = step.calls if self._most is None else step.calls[: max(0, self._most - first)]
        if kept:
            self._sent[index] += len(kept)
            delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(_calls(kept))]
        if not delta and finish is None and body.get("logprobs") is None:
            return None  # held: nothing to say yet (a chunk with logprobs still goes)
        body["delta"] = delta
        if finish == "stop" and self._sent[index]:
            body["finish_reason"] = "tool_calls"
        return body


def _calls(calls: tuple[Call, ...] | list[Call]) -> list[dict]:
    return [tool_call(c.name, c.arguments) for c in calls]
