"""DeepSeek's tool calls: a section of calls between DeepSeek's own markers (tokens of its
tokenizer that are not special, so they reach the text as any other), by vLLM's names:

`--tool-call-parser deepseek_v3` (DeepSeek-V3, R1), each call's arguments in a JSON fence:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Oslo"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

`--tool-call-parser deepseek_v31` (DeepSeek-V3.1), the name and the JSON alone:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(the bars are full-width `｜`, U+FF5C, and the spaces `▁`, U+2581). The section is
hermes's block (hermes.py), from `<｜tool▁calls▁begin｜>` to `<｜tool▁calls▁end｜>` or the end
of the reply, and so are the text around it and the streaming: text goes out as it comes,
the section is held until it closes. A section is calls when all of it is back-to-back
calls (whitespace between them), each naming one of the request's tools with an arguments
object; else all of it stays text, verbatim, markers and all. vLLM reads each call alone
and drops the text after the section; here a section the client cannot use whole is text,
and nothing the model wrote is dropped. The fence and its newlines may carry extra
whitespace (vLLM's reading wants exactly one newline on each side of the JSON).
"""

from __future__ import annotations

import json
import re

from pdserve.cluster.tool_parsers.base import Call, back_to_back, loads
from pdserve.cluster.tool_parsers.hermes import HermesParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

# A call, its name in group 1 and its arguments' JSON in group 2
_V3_CALL = re.compile(
    rf"\s*{CALL_BEGIN}function{SEP}([^\n]*?)\s*```json\s*(.*?)\s*```\s*{CALL_END}\s*", re.DOTALL
)
_V31_CALL = re.compile(rf"\s*{CALL_BEGIN}(.*?){SEP}(.*?){CALL_END}\s*", re.DOTALL)


class _DeepSeekParser(HermesParser):
    OPEN, CLOSE = CALLS_BEGIN, CALLS_END
    CALL: re.Pattern[str]  # one call of the section

    def block_calls(self, block: str) -> tuple[Call, ...] | None:
        assert block.startswith(CALLS_BEGIN), block[:30]
        items = back_to_back(self.CALL, block[len(CALLS_BEGIN) :].removesuffix(CALLS_END))
        if not items:
            return None
        calls = []
        for name, arguments in items:
            name = name.strip()
            ok, value = loads(arguments)
            if name not in self.tool_names or not (ok and isinstance(value, dict)):
                return None
            calls.append(Call(name, json.dumps(value, ensure_ascii=False)))
        return tuple(calls)


class DeepSeekV3Parser(_DeepSeekParser):
    CALL = _V3_CALL


class DeepSeekV31Parser(_DeepSeekParser):
    CALL = _V31_CALL
