"""`--reasoning-parser qwen3`: Qwen3's thinking, as its chat template and the model write it.

Qwen3 opens its reply with `<think>`, thinks, closes the block with `</think>` and then
answers. A client switches thinking off with `chat_template_kwargs: {"enable_thinking":
false}`: the template then writes an empty `<think>\\n\\n</think>\\n\\n` into the prompt
and the reply is a plain answer. So a reply that does not open with `<think>` is all
answer, and one that opens with it but has no `</think>` is reasoning cut short
(max_tokens). base.py has the full reading.

Qwen3 "Thinking-2507" and Qwen3.5 templates write `<think>\\n` into the prompt themselves,
so their replies open inside the block with no tag: the router sees the prompt end with
`<think>` (cluster/reasoning_api.py `prompt_opens_block`) and reads them as reasoning
up to `</think>`, as vLLM does.
"""

from __future__ import annotations

from pdserve.cluster.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False
