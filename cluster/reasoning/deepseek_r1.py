"""`--reasoning-parser deepseek_r1`: DeepSeek-R1's thinking (and its distills'), as its chat
template and the model write it.

The template ends the prompt with `<think>\\n`, so the generated text opens inside the
block and may not repeat the tag (older templates leave it to the model, which then
writes it first). Everything up to `</think>` is reasoning, what follows is the answer;
a reply with no `</think>` (cut by max_tokens) is all reasoning, its answer null. base.py
has the full reading, including why a constrained reply opens in the answer.
"""

from __future__ import annotations

from pdserve.cluster.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True
