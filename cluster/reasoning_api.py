"""Chat replies with `--reasoning-parser`, in vLLM 0.25's shapes: the reasoning parser
(cluster/reasoning/) splits a choice's generated text, and its thinking goes out as
`message.reasoning` (null when there is none) or `delta.reasoning` pieces, its answer as
`content` (null when empty), which is all the tool parsers of `tool_choice: "auto"` read.

Parsed: what the model generated for a chat choice. Not parsed: completions (raw text, as
in vLLM) and the words a client began the turn with (`continue_final_message`, shown
with `echo`), which stay content, verbatim, before the answer, as the tool parsers
treat them. A reply held to a grammar (structured output, tool_choice named or required)
reasons first and the grammar holds its answer, as on vLLM: `reasoned_constraint` wraps
the request's constraint so (runner/structured/patterns.py `after_reasoning`). gpt-oss's
harmony parser is the exception: its grammar holds the reply from the first token, which
is then all answer.
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
from pdserve.runner.structured.spec import StructuredOutputs

# How many of a chat prompt's last tokens are read for a `<think>` left open: the tag and
# the whitespace after it are a few tokens in every tokenizer these templates come with.
PROMPT_TAIL_TOKENS = 8


def request_parser(
    name: str | None,
    kind: str,
    params: SamplingParams,
    prompt_tail: str = "",
    grammar_in_reasoning: bool = False,
) -> ReasoningParser | None:
    """A request's reasoning parser: the server's (`name`, None without the flag), for chat
    only. `prompt_tail`: the text of the prompt's last few tokens. `grammar_in_reasoning`
    (`--structured-outputs-config '{"enable_in_reasoning": true}'`): a constraint holds
    the reply from its first token, thinking included."""
    if name is None or kind != "chat":
        return None
    cls = PARSERS[name]
    constrained = params.structured_outputs is not None and (
        grammar_in_reasoning or not cls.grammar_after_reasoning
    )
    return make_parser(name, constrained, prompt_opens_block(prompt_tail, cls.open_tag))


def reasoned_constraint(
    parser: ReasoningParser | None, spec: StructuredOutputs | None
) -> StructuredOutputs | None:
    """A request's constraint as its reasoning parser reads the reply: on what follows
    the reasoning block, unless the parser reads the reply as held from its first token
    (`constrained`); unchanged without a parser."""
    if parser is None or spec is None or parser.constrained:
        return spec
    return spec.after_reasoning(parser.open_tag, parser.close_tag, parser.opens_in_reasoning)


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
