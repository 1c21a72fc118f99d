"""Reasoning parsers for chat, by vLLM's `--reasoning-parser` names: each splits a reply's
thinking from its answer (base.py says how). Light on imports: cluster/serve_args.py
checks the flag against PARSERS."""

from __future__ import annotations

from pdserve.cluster.reasoning.base import ReasoningParser
from pdserve.cluster.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pdserve.cluster.reasoning.gpt_oss import GptOssReasoningParser
from pdserve.cluster.reasoning.qwen3 import Qwen3ReasoningParser
from pdserve.cluster.reasoning.seed_oss import SeedOssReasoningParser

PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,  # opens in the answer unless the reply or prompt opens <think>
    "deepseek_r1": DeepSeekR1ReasoningParser,  # opens in the reasoning (<think> in prompt)
    "openai_gptoss": GptOssReasoningParser,  # harmony channels: analysis, final, commentary
    "seed_oss": SeedOssReasoningParser,  # as qwen3, in <seed:think> ... </seed:think>
}


def make_parser(
    name: str, constrained: bool = False, prompt_opens_block: bool = False
) -> ReasoningParser:
    """`constrained`: the reply is held to a grammar from its first token (structured
    output, tool_choice named or required); `prompt_opens_block`: the prompt ends inside
    a `<think>` block."""
    assert name in PARSERS, f"unknown reasoning parser {name!r}; known: {sorted(PARSERS)}"
    return PARSERS[name](constrained, prompt_opens_block)
