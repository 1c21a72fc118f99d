"""Tool calling's request rules and reply shapes (cluster/tool_calls.py), without a server:
what each tool_choice constrains the reply to, how replies become OpenAI tool calls, and
how a stream sends them. tests/test_serve_e2e.py runs them through the real router."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.cluster.openai_api import ApiError, parse_sampling
from pdserve.cluster.tool_calls import ToolStream, parse_tool_choice
from pdserve.runner.structured.patterns import compile_spec

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def test_named_and_required_constrain_the_reply_to_their_calls():
    """Guards the schemas behind the two modes: a named call's reply is its parameters
    object, a required reply an array of {name, parameters} naming the tools; a reply of
    another tool's shape, an empty array or an unknown name is outside the language."""
    named = parse_tool_choice(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                    "function": {"name": "get_weather"}}}
    )  # fmt: skip
    dfa = compile_spec(named.constraint())
    assert dfa.matches(b'{"city":"Oslo","unit":"celsius"}')
    assert not dfa.matches(b'{"city":"Oslo"}') and not dfa.matches(b"{}")
    calls = named.calls('{"city": "Oslo", "unit": "celsius"}')
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    ]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert named.calls('{"city": "Os') is None  # cut by max_tokens: returned as text

    required = parse_tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required"})
    spec = required.constraint()
    dfa = compile_spec(spec)
    reply = (
        '[{"name":"get_time","parameters":{}},'
        '{"name":"get_weather","parameters":{"city":"Rome","unit":"fahrenheit"}}]'
    )
    assert dfa.matches(reply.encode())
    jsonschema.validate(json.loads(reply), json.loads(spec.json))
    for bad in (b"[]", b'[{"name":"get_date","parameters":{}}]',
                b'[{"name":"get_weather","parameters":{}}]'):  # fmt: skip
        assert not dfa.matches(bad), bad
    got = required.calls(reply)
    assert [c["function"]["name"] for c in got] == ["get_time", "get_weather"]
    assert json.loads(got[1]["function"]["arguments"]) == {"city": "Rome", "unit": "fahrenheit"}
    assert parse_tool_choice({"tools": [WEATHER], "tool_choice": "none"}).constraint() is None


def test_tool_choice_rules_are_400s_naming_the_field():
    """Guards the edges: auto (the default with tools) is refused as unsupported rather
    than answered with text; malformed tools, unknown or duplicate names, a named choice
    without tools, and tools beside another structured constraint are 400s."""
    assert parse_tool_choice({}) is None
    assert parse_tool_choice({"tools": [], "tool_choice": "auto"}) is None
    for body, param, fragment in (
        ({"tools": [WEATHER]}, "tool_choice", "auto"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "parser"),
        ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "get_weather"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
          "tool_choice": "required"}, "tools", "name"),
        ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools", "each"),
        ({"tools": "get_weather", "tool_choice": "required"}, "tools", "array"),
    ):  # fmt: skip
        with pytest.raises(ApiError, match=fragment) as e:
            parse_tool_choice(body)
        assert e.value.param == param and e.value.status == 400
    constraint = parse_tool_choice({"tools": [WEATHER], "tool_choice": "required"}).constraint()
    with pytest.raises(ApiError, match="already constrains") as e:
        parse_sampling({"response_format": {"type": "json_object"}}, "chat", None, 8, None,
                       constraint)  # fmt: skip
    params, _ = parse_sampling({}, "chat", None, 8, None, constraint)
    assert params.structured_outputs == constraint


def test_a_stream_sends_named_arguments_as_they_come_and_required_calls_whole():
    """Guards the SSE shapes: a named call's first delta carries its id, type and name,
    later ones only argument text, and the last says finish_reason tool_calls; a required
    reply sends nothing until whole, then every call at once (or its text, if cut)."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    named = ToolStream(parse_tool_choice({"tools": [WEATHER], "tool_choice": forced}))
    pieces = ['{"city": ', '"Oslo", "unit": ', '"celsius"}']
    bodies = [
        named.delta(0, {"index": 0, "finish_reason": None}, p, "stop" if i == 2 else None)
        for i, p in enumerate(pieces)
    ]
    first = bodies[0]["delta"]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["type"] == "function"
    assert all("id" not in b["delta"]["tool_calls"][0] for b in bodies[1:])
    args = "".join(b["delta"]["tool_calls"][0]["function"]["arguments"] for b in bodies)
    assert json.loads(args) == {"city": "Oslo", "unit": "celsius"}
    assert [b["finish_reason"] for b in bodies] == [None, None, "tool_calls"]

    required = ToolStream(parse_tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required"}))
    assert required.delta(1, {"index": 1}, '[{"name":"get_time",', None) is None
    body = required.delta(1, {"index": 1, "finish_reason": "stop"}, '"parameters":{}}]', "stop")
    assert body["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in body["delta"]["tool_calls"]] == ["get_time"]
    assert required.delta(2, {"index": 2}, '[{"name":', None) is None
    cut = required.delta(2, {"index": 2, "finish_reason": "length"}, '"get_ti', "length")
    assert cut["delta"] == {"content": '[{"name":"get_ti'} and cut["finish_reason"] == "length"
