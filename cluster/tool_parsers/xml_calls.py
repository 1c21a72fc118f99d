"""Tool calls whose arguments are written as tagged text inside hermes-style `<tool_call>`
blocks, by vLLM's parser names:

`--tool-call-parser qwen3_coder` (Qwen3-Coder, Qwen3.5):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

`--tool-call-parser glm45` (GLM-4.5, GLM-4.6):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Oslo</arg_value>
    </tool_call>

(seed_oss.py reads qwen3_coder's blocks in Seed-OSS's own tags.) Blocks, content around
them, blocks left open at the end and the streaming are hermes's (hermes.py); only what a
block holds is read differently. A block is a call when all of it is one function of the
request's tools with its arguments in that syntax (whitespace between the parts), else it
is content, verbatim. Argument values are text: typed by the tool's parameters schema
(`typed_argument`), a qwen3_coder value losing one newline at each end as the model writes
it on lines of its own, a glm45 value its surrounding whitespace.
"""

from __future__ import annotations

import json
import re

from pdserve.cluster.tool_parsers.base import Call, back_to_back, typed_argument
from pdserve.cluster.tool_parsers.hermes import HermesParser

_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>\s*", re.DOTALL)
_GLM_HEAD = re.compile(r"\s*([^\s<][^\n<]*?)[ \t]*(?:\n|$)(.*)", re.DOTALL)
_GLM_ARGUMENT = re.compile(
    r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL
)


class _XmlCallParser(HermesParser):
    """A block is `HEAD` (the function's name in group 1, its arguments in group 2), the
    arguments back-to-back `ARGUMENT`s (key, value); `value` cleans a value's text."""

    HEAD: re.Pattern[str]
    ARGUMENT: re.Pattern[str]

    @staticmethod
    def value(text: str) -> str:
        raise NotImplementedError

    def block_call(self, block: str) -> Call | None:
        assert block.startswith(self.OPEN), block[:20]
        match = self.HEAD.fullmatch(block[len(self.OPEN) :].removesuffix(self.CLOSE))
        pairs = None if match is None else back_to_back(self.ARGUMENT, match.group(2))
        if pairs is None:
            return None
        name = match.group(1).strip()
        if name not in self.tool_names:
            return None
        schema = self.schemas[name]
        arguments = {k.strip(): typed_argument(schema, k.strip(), self.value(v)) for k, v in pairs}
        return Call(name, json.dumps(arguments, ensure_ascii=False))


class Qwen3CoderParser(_XmlCallParser):
    HEAD, ARGUMENT = _QWEN_FUNCTION, _QWEN_PARAMETER

    @staticmethod
    def value(text: str) -> str:
        return text.removeprefix("\n").removesuffix("\n")  # the value's own lines


class Glm45Parser(_XmlCallParser):
    HEAD, ARGUMENT = _GLM_HEAD, _GLM_ARGUMENT

    @staticmethod
    def value(text: str) -> str:
        return text.strip()
