"""Chat replies with `--reasoning-parser`, in vLLM 0.25's shapes: the reasoning parser
(cluster/reasoning/) splits a choice's generated text, and its thinking goes out as
`message.reasoning` (null when there is none) or `delta.reasoning` pieces, its answer as
`content` (null when empty), which is all the tool parsers of `tool_choice: "auto"` read.

Parsed: what the model generated for a chat choice. Not parsed: completions (raw text, as
in vLLM) and the words a client began the turn with (`continue_final_message`, shown
with `echo`), which stay content, verbatim, before the answer, as the tool parsers
treat them. A reply held to a grammar (structured output, tool_choice named or required)
opens in the answer for every parser: pdserve's grammar holds it from the first token,
where vLLM's starts after the reasoning, so such a reply has reasoning only where the
grammar itself spells a `<think>` block.
"""

from __future__ import annotations

from pdserve.cluster.reasoning import PARSERS, make_parser
from pdserve.cluster.reasoning.base import (
    OPEN,
    ReasoningParser,
    ReasoningStep,
    ReasoningStream,
)
from pdserve.runner.sampling_params import SamplingParams

# How many of a chat prompt's last tokens are read for a `<think>` left open: the tag and
# the whitespace after it are a few tokens in every tokenizer these templates come with.
PROMPT_TAIL_TOKENS = 8


def request_parser(
    name: str | None, kind: str, params: SamplingParams, prompt_tail: str = ""
) -> ReasoningParser | None:
    """A request's reasoning parser: the server's (`name`, None without the flag), for chat
    only. `prompt_tail`: the text of the prompt's last few tokens."""
    if name is None or kind != "chat":
        return None
    constrained = params.structured_outputs is not None
    opens = prompt_opens_block(prompt_tail, PARSERS[name].open_tag)
    return make_parser(name, constrained, opens)


def prompt_opens_block(prompt_tail: str, open_tag: str = OPEN) -> bool:
    """Whether a prompt ends inside a `<think>` block, so the reply opens in the reasoning:
    its text ends with the tag, whitespace aside (Qwen3 Thinking-2507's, Qwen3.5's and
    DeepSeek-R1's templates end with `<think>\\n`; Qwen3's with thinking switched off
    closes the block it writes)."""
    return prompt_tail.rstrip().endswith(open_tag)


def split_message(
    parser: ReasoningParser, body: dict, echoed: str, text: str
) -> tuple[str | None, str]:
    """A whole chat choice (`body`, its message holding `echoed + text`): its content set to
    `echoed` and the answer (null when both are empty); returns the reasoning and the
    answer, for the tool parsers. The caller adds `reasoning` to the message last, after
    tool parsing has rebuilt it."""
    reply = parser.parse(text)
    answer = reply.content or ""
    body["message"]["content"] = (echoed + answer) or None
    return reply.reasoning, answer


class ReasoningSplits:
    """A streamed chat's replies split, choice by choice."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._streams: dict[int, ReasoningStream] = {}  # choice index -> its reader

    def feed(self, index: int, text: str, finished: bool) -> ReasoningStep:
        """This piece of a choice's generated text, split; the choice's last piece lets
        out what was held."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = self._parser.stream()
        step = stream.feed(text)
        if finished:
            step = step.then(stream.finish())
            del self._streams[index]
        return step


def with_reasoning(sent: dict | None, body: dict, reasoning: str) -> dict | None:
    """The chunk body for a piece of a choice: `sent` is what the answer's piece made of
    `body` (None: nothing to send for it), and the reasoning's piece joins its delta. A
    piece that lets out neither (held: it may be the start of a tag) goes out only to end
    the choice or to carry its logprobs; an empty `content` is left out of the delta."""
    if sent is None:
        if not reasoning:
            return None
        sent = body
        sent["delta"] = {}
    delta = sent["delta"]
    if delta.get("content") == "":
        del delta["content"]
    if reasoning:
        delta["reasoning"] = reasoning
    elif not delta and sent["finish_reason"] is None and sent.get("logprobs") is None:
        return None
    return sent
