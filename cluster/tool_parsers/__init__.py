"""Tool-call parsers for `tool_choice: "auto"`, by vLLM's `--tool-call-parser` names: each
reads one model family's own tool-call syntax out of a reply (base.py says what they
promise). Light on imports: cluster/serve_args.py checks the flag against PARSERS."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdserve.cluster.tool_parsers.base import ToolParser
from pdserve.cluster.tool_parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from pdserve.cluster.tool_parsers.granite import GraniteParser
from pdserve.cluster.tool_parsers.harmony import HarmonyParser
from pdserve.cluster.tool_parsers.hermes import HermesParser
from pdserve.cluster.tool_parsers.llama3_json import Llama3JsonParser
from pdserve.cluster.tool_parsers.mistral import MistralParser
from pdserve.cluster.tool_parsers.pythonic import PythonicParser
from pdserve.cluster.tool_parsers.seed_oss import SeedOssParser
from pdserve.cluster.tool_parsers.xml_calls import Glm45Parser, Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    "deepseek_v3": DeepSeekV3Parser,  # <｜tool▁calls▁begin｜>, JSON fences: DeepSeek-V3, R1
    "deepseek_v31": DeepSeekV31Parser,  # <｜tool▁calls▁begin｜>, bare JSON: DeepSeek-V3.1
    "glm45": Glm45Parser,  # <tool_call> blocks of <arg_key>/<arg_value>: GLM-4.5, 4.6
    "granite": GraniteParser,  # <|tool_call|> and a JSON array: Granite 3.0, 3.1
    "hermes": HermesParser,  # <tool_call> blocks: Hermes, Qwen2.5, Qwen3
    "llama3_json": Llama3JsonParser,  # a JSON object per call: Llama 3.1, 3.2
    "mistral": MistralParser,  # [TOOL_CALLS] calls: Mistral 7B v0.3, Mistral Small, Ministral
    "openai": HarmonyParser,  # gpt-oss's harmony calls, as --reasoning-parser openai_gptoss hands them on
    "pythonic": PythonicParser,  # a Python list of calls: Llama 3.2, Llama 4
    "qwen3_coder": Qwen3CoderParser,  # <tool_call> blocks of <function=...>: Qwen3-Coder
    "seed_oss": SeedOssParser,  # <seed:tool_call> blocks of <function=...>: Seed-OSS
}


def make_parser(name: str, tools: Mapping[str, dict] | Iterable[str]) -> ToolParser:
    """`tools`: name -> parameters schema of the request's tools (or just their names)."""
    assert name in PARSERS, f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}"
    return PARSERS[name](tools)
