"""Tool calling in chat: a named function and `tool_choice: "required"` where structured
output can promise the call (as vLLM does them), `"none"`, and `"auto"` read by the
server's tool-call parser.

- A named function (`{"type": "function", "function": {"name": ...}}`): the reply is the
  function's `parameters` schema as JSON, returned as one tool call whose `arguments` is
  that text.
- `"required"`: the reply is a JSON array of one or more `{"name": ..., "parameters":
  {...}}` objects, each naming one of the tools with its parameters; each becomes a tool
  call.
- `"none"`: the tools reach the chat template and the reply is text.
- `"auto"` (OpenAI's default once tools are given): the model writes text, calls in its
  family's own syntax, or both, unconstrained; the parser the server was started with
  (`--enable-auto-tool-choice --tool-call-parser NAME`, cluster/tool_parsers/) reads the
  calls out (cluster/auto_tools.py). Without those flags it is refused by name, with
  vLLM's message, rather than answered with text that was meant to be a call.

Tools go to the chat template in every case, as vLLM does by default.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.openai_api import ApiError, typed
from pdserve.cluster.required_calls import CallPiece, RequiredReader, read_required
from pdserve.cluster.response_shapes import new_id
from pdserve.cluster.tool_parsers import ToolParser, make_parser
from pdserve.runner.structured.spec import StructuredOutputs

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    kind: str  # "named" | "required" | "none" | "auto"
    name: str | None  # the named function
    tools: tuple[dict, ...]  # the request's tools, checked
    parser: str | None = None  # auto: the server's --tool-call-parser
    # `parallel_tool_calls`: false allows one call a reply (required: the array holds one;
    # auto: calls after the first are not returned, as on vLLM)
    parallel: bool = True

    def reader(self) -> ToolParser:
        """auto: the server's parser, for this request's tools."""
        assert self.kind == "auto" and self.parser is not None, self
        return make_parser(self.parser, {t["function"]["name"]: _parameters(t) for t in self.tools})

    def constraint(self) -> StructuredOutputs | None:
        """What the reply must follow (None for "none" and "auto")."""
        schemas = {t["function"]["name"]: _parameters(t) for t in self.tools}
        if self.kind == "named":
            return StructuredOutputs(json=schemas[self.name])
        if self.kind == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": schema},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, schema in schemas.items()
            ]
            item = calls[0] if len(calls) == 1 else {"anyOf": calls}
            array = {"type": "array", "minItems": 1, "items": item}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputs(json=array)
        return None

    def calls(self, text: str) -> list[dict] | None:
        """The reply as OpenAI tool calls, as a stream sends them, whole or cut short (by
        max_tokens or a stop string; `whole` tells): a named function's call with the
        text as its arguments; a required reply's calls whose names are whole, each with
        its arguments as the model wrote them. None when there is none (an empty named
        reply, a required one cut before its first name), so the caller returns text."""
        assert self.kind != "auto", "auto replies are read by the parser (auto_tools.py)"
        if self.kind == "none":
            return None
        if self.kind == "named":
            return [tool_call(self.name, text)] if text else None
        return [tool_call(name, arguments) for name, arguments in read_required(text)] or None

    @staticmethod
    def whole(text: str) -> bool:
        """Whether a named or required reply is whole JSON, not cut short."""
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return False
        return True


class ToolStream:
    """A streamed chat's tool calls, choice by choice. Arguments stream as they come: a
    named function's from the first piece, a `required` reply's call by call
    (cluster/required_calls.py), each call's first delta carrying its id, type and name.
    A required reply cut before its first call's name is whole is sent as its text, as
    the unstreamed reply is; calls already sent stay (finish_reason says length)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self._ids: dict[int, str] = {}  # choice index -> the id of its named call
        self._readers: dict[int, RequiredReader] = {}  # choice index -> its reader
        self._before: dict[int, str] = {}  # choice index -> its text before any call began
        self._began: set[int] = set()  # choice indexes whose first call was sent

    def delta(
        self, index: int, body: dict, echoed: str, text: str, finish: str | None
    ) -> dict | None:
        """The chunk body for this piece of a choice's text (after `echoed`, the turn the
        client began); None to send nothing yet."""
        text = echoed + text
        if self.choice.kind == "named":
            if text:
                entry: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if index not in self._ids:
                    self._ids[index] = new_id("chatcmpl-tool")
                    entry.update(id=self._ids[index], type="function")
                    entry["function"]["name"] = self.choice.name
                body["delta"] = {"tool_calls": [entry]}
            else:
                body["delta"] = {}
        else:
            reader = self._readers.setdefault(index, RequiredReader())
            entries = [_entry(p) for p in reader.feed(text)]
            if finish is not None:
                del self._readers[index]
            if not entries and index not in self._began:  # no call has begun yet
                before = self._before.pop(index, "") + text
                if finish is None:
                    self._before[index] = before
                    return None
                body["delta"] = {"content": before} if before else {}  # cut: its text
                return body
            self._before.pop(index, None)
            self._began.add(index)
            if not entries and finish is None:
                return None
            body["delta"] = {"tool_calls": entries} if entries else {}
            if finish is not None:
                self._began.discard(index)
                if not reader.closed:
                    return body
        if finish == "stop":
            body["finish_reason"] = "tool_calls"
        return body


def _entry(piece: CallPiece) -> dict[str, Any]:
    """A tool_calls delta entry: the first one of a call names it and gives its id."""
    if piece.name is None:
        return {"index": piece.index, "function": {"arguments": piece.arguments}}
    return {
        "index": piece.index, "id": new_id("chatcmpl-tool"), "type": "function",
        "function": {"name": piece.name, "arguments": piece.arguments},
    }  # fmt: skip


def parse_tool_choice(body: dict, auto_parser: str | None = None) -> ToolChoice | None:
    """The request's tools and tool_choice, checked; None when there is nothing to do.
    `auto_parser`: the server's tool-call parser when it answers "auto", else None."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice in (None, "none", "auto"):
            return None
        if choice == "required":
            raise ApiError("'tool_choice' \"required\" needs 'tools', and the request has "
                           "none", param="tool_choice")  # fmt: skip
        raise ApiError("'tool_choice' names a tool, but the request has no 'tools'",
                       param="tool_choice")  # fmt: skip
    checked = tuple(_check_tool(t) for t in _list(tools))
    parallel = typed(body, "parallel_tool_calls", (bool,), True)
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise ApiError(f"'tools' names a function twice: {names}", param="tools")
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise ApiError(
                # vLLM's words first: clients recognise them and fall back.
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set; this server was started without them ('auto' is the default when "
                "tools are given). Ask for 'required', a named function, or 'none'",
                param="tool_choice",
                code="unsupported",
            )
        return ToolChoice("auto", None, checked, auto_parser, parallel)
    if choice in ("none", "required"):
        return ToolChoice(choice, None, checked, None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name in names):
        raise ApiError(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
            f"'function': {{'name': one of {names}}}}}",
            param="tool_choice",
        )
    return ToolChoice("named", name, checked, None, parallel)


def _list(tools: Any) -> list:
    if not isinstance(tools, list):
        raise ApiError("'tools' must be an array", param="tools")
    return tools


def _check_tool(tool: Any) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
        raise ApiError("each tool must be {'type': 'function', 'function': {...}}", param="tools")
    name = fn.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ApiError(
            f"a function's name must be 1-64 letters, digits, _ or - (got {name!r})",
            param="tools",
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ApiError(f"function {name!r}: 'parameters' must be a JSON schema object",
                       param="tools")  # fmt: skip
    return tool


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or _NO_PARAMETERS


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call, with a new id."""
    return {
        "id": new_id("chatcmpl-tool"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
