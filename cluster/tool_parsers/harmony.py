"""`--tool-call-parser openai`: gpt-oss's tool calls, as `--reasoning-parser openai_gptoss`
(cluster/reasoning/gpt_oss.py) hands them on from the harmony reply, one block each:

    <|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>

A block is a call when its recipient is `functions.NAME` with NAME one of the request's
tools and its message is one JSON object (the arguments). Blocks, the text around them,
a block left open at the end of the reply and the streaming are hermes's (hermes.py):
anything that is not a call stays text, verbatim. Built-in tools (`browser.*`,
`python`) are not functions the client gave, so their blocks stay text too.
"""

from __future__ import annotations

import json

from pdserve.cluster.tool_parsers.base import Call, loads
from pdserve.cluster.tool_parsers.hermes import HermesParser

OPEN, CLOSE = "<|channel|>commentary to=", "<|call|>"
MESSAGE = "<|message|>"


class HarmonyParser(HermesParser):
    OPEN, CLOSE = OPEN, CLOSE
    needs_special_tokens = True  # its blocks come from the reply's special tokens

    def block_call(self, block: str) -> Call | None:
        assert block.startswith(OPEN), block[:30]
        recipient, found, message = block[len(OPEN) :].removesuffix(CLOSE).partition(MESSAGE)
        name = recipient.strip().removeprefix("functions.")
        if not found or not recipient.startswith("functions.") or name not in self.tool_names:
            return None
        ok, arguments = loads(message)
        if not (ok and isinstance(arguments, dict)):
            return None
        return Call(name, json.dumps(arguments, ensure_ascii=False))
