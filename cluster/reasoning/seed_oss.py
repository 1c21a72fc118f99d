"""`--reasoning-parser seed_oss`: Seed-OSS's thinking, a `<seed:think>` ... `</seed:think>`
block read as qwen3.py reads `<think>` (base.py has the reading): a reply that opens with
the tag is reasoning up to the close, one that does not is all answer unless the prompt
left the block open. The model's budget notes (`<seed:cot_budget_reflect>`) inside the
block stay in the reasoning, verbatim."""

from __future__ import annotations

from pdserve.cluster.reasoning.base import ReasoningParser


class SeedOssReasoningParser(ReasoningParser):
    open_tag, close_tag = "<seed:think>", "</seed:think>"
    starts_in_reasoning = False
