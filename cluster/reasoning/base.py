"""What every reasoning parser gives (`--reasoning-parser`, vLLM's names): a chat reply's
generated text read into its reasoning and its answer, whole or piece by piece as it
streams.

The reading, for a model that thinks in a `<think>` ... `</think>` block:
- A `<think>` at the very start of the text opens the reasoning and is not part of it
  (anywhere else it is plain text).
- Without it, the text opens in the answer, except where the prompt leaves a block open
  (it ends with `<think>`, as Qwen3 Thinking-2507's and Qwen3.5's templates write it:
  `prompt_opens_block`) or the parser's models' templates always do so
  (`starts_in_reasoning`, DeepSeek-R1's), where it opens in the reasoning. A constraint
  (structured output, tool_choice named or required) holds the answer after the block,
  as on vLLM (`grammar_after_reasoning`: the request's grammar is wrapped so, runner/
  structured/patterns.py `after_reasoning`), so the reading is the same; a parser
  without that (gpt-oss's) reads a constrained reply as all answer, since the grammar
  holds it from its first token.
- Reasoning runs to the first `</think>` (dropped), verbatim; the answer is what follows,
  less its leading newline characters (`\\n` only: not spaces, not `\\r`). Reasoning with
  no `</think>` (cut by max_tokens) leaves no answer.
- Text that opens in the answer is the answer, whole and verbatim: a `</think>` in it is
  text, since a stream has sent what came before it as answer already.
- Empty reasoning or answer is None.

A parser knows nothing of OpenAI's message shapes, tool calls or echo (cluster/
reasoning_api.py puts its findings into those). Its one promise: whatever the pieces, a
stream's reasoning and answer joined equal what `parse` finds in the whole text (None
joins as ""), and it holds back only what may be the start of a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoned:
    reasoning: str | None  # the think block's text; None when there is none or it is empty
    content: str | None  # the answer; None when empty


@dataclass
class ReasoningStep:
    """What a piece of a streamed reply lets out."""

    reasoning: str = ""
    content: str = ""

    def then(self, later: ReasoningStep) -> ReasoningStep:
        return ReasoningStep(self.reasoning + later.reasoning, self.content + later.content)


class ReasoningParser:
    # The block's tags (Seed-OSS writes `<seed:think>` ... `</seed:think>`)
    open_tag, close_tag = OPEN, CLOSE
    # Whether text that does not open with `<think>` opens in the reasoning: the chat
    # template writes `<think>` into the prompt (DeepSeek-R1's does).
    starts_in_reasoning = False
    # Whether the parser reads special tokens (gpt-oss's harmony markers): its requests
    # are then detokenized with them, and it drops them from what it lets out.
    needs_special_tokens = False
    # Whether a request's grammar holds only what follows the block (its tags, above),
    # as on vLLM, rather than the reply from its first token.
    grammar_after_reasoning = True

    def __init__(self, constrained: bool = False, prompt_opens_block: bool = False) -> None:
        """`constrained`: the reply is held to a grammar from its first token (not where
        the grammar comes after the reasoning: `grammar_after_reasoning`);
        `prompt_opens_block`: the prompt ends inside a `<think>` block it opened."""
        thinks = self.starts_in_reasoning or prompt_opens_block
        self.constrained = constrained
        self.opens_in_reasoning = thinks and not constrained

    def parse(self, text: str) -> Reasoned:
        """A whole reply."""
        thinking = self.opens_in_reasoning
        if text.startswith(self.open_tag):
            text, thinking = text[len(self.open_tag) :], True
        if not thinking:
            return Reasoned(None, text or None)
        reasoning, closed, answer = text.partition(self.close_tag)
        answer = answer.lstrip("\n") if closed else ""
        return Reasoned(reasoning or None, answer or None)

    def stream(self) -> ReasoningStream:
        """A reader for one reply that arrives in pieces."""
        return ReasoningStream(self.opens_in_reasoning, self.open_tag, self.close_tag)


class ReasoningStream:
    """One streamed reply. Held back: the start of the text while it may be `<think>`,
    the end of the reasoning while it may be the start of `</think>`, and newlines right
    after `</think>` (dropped once the answer's first other character comes)."""

    def __init__(
        self, opens_in_reasoning: bool, open_tag: str = OPEN, close_tag: str = CLOSE
    ) -> None:
        self._opens_in_reasoning = opens_in_reasoning
        self._open, self._close = open_tag, close_tag
        self._phase = "start"  # start | reasoning | after_close | answer
        self._held = ""

    def feed(self, text: str) -> ReasoningStep:
        """The next piece of the reply; what it lets out."""
        step = ReasoningStep()
        if self._phase == "answer":
            step.content = text
            return step
        self._held += text
        if self._phase == "start":
            if self._open.startswith(self._held) and self._held != self._open:
                return step  # "", "<", "<th", ...: may still be `<think>`
            if self._held.startswith(self._open):
                self._held, self._phase = self._held[len(self._open) :], "reasoning"
            else:
                self._phase = "reasoning" if self._opens_in_reasoning else "answer"
        if self._phase == "reasoning":
            end = self._held.find(self._close)
            if end < 0:
                keep = _tag_start(self._held, self._close)
                step.reasoning = self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                return step
            step.reasoning = self._held[:end]
            self._held, self._phase = self._held[end + len(self._close) :], "after_close"
        if self._phase == "after_close":
            self._held = self._held.lstrip("\n")
            if not self._held:
                return step
            self._phase = "answer"
        step.content, self._held = self._held, ""
        return step

    def finish(self) -> ReasoningStep:
        """The reply has ended: what was held back. The start of a tag that never came
        whole is text of the part it was held in; newlines after `</think>` are dropped."""
        held, self._held = self._held, ""
        if self._phase == "start":
            thinking = self._opens_in_reasoning
            return ReasoningStep(held, "") if thinking else ReasoningStep("", held)
        if self._phase == "reasoning":
            return ReasoningStep(held, "")
        return ReasoningStep()  # after_close holds only newlines; answer holds nothing


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
