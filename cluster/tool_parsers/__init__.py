"""Tool-call parsers for `tool_choice: "auto"`, by vLLM's `--tool-call-parser` names: each
reads one model family's own tool-call syntax out of a reply (base.py says what they
promise). Light on imports: cluster/serve_args.py checks the flag against PARSERS."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.cluster.tool_parsers.base import ToolParser
from pdserve.cluster.tool_parsers.hermes import HermesParser
from pdserve.cluster.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,  # <tool_call> blocks: Hermes, Qwen2.5, Qwen3
    "llama3_json": Llama3JsonParser,  # a JSON object per call: Llama 3.1, 3.2
}


def make_parser(name: str, tool_names: Iterable[str]) -> ToolParser:
    assert name in PARSERS, f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}"
    return PARSERS[name](tool_names)
