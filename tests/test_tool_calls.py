"""Tool calling's request rules and reply shapes (cluster/tool_calls.py, cluster/auto_tools.py),
without a server: what each tool_choice constrains the reply to, how replies become OpenAI
tool calls, and how a stream sends them. The parsers of "auto" are tests/test_tool_parsers.py's;
tests/test_serve_e2e.py runs all of it through the real router."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.cluster.auto_tools import AutoToolStream, auto_reply
from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.sampling_api import parse_sampling
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
    # Cut by max_tokens: the call with its arguments cut, as a stream has sent them (as on
    # OpenAI's API and vLLM); an empty reply has no call.
    cut = named.calls('{"city": "Os')
    assert [c["function"] for c in cut] == [{"name": "get_weather", "arguments": '{"city": "Os'}]
    assert named.calls("") is None

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
    """Guards the edges: auto (the default with tools) on a server without a parser is
    refused in vLLM's words, naming both flags, rather than answered with text; with one
    it constrains nothing; malformed tools, unknown or duplicate names, a named choice
    without tools, and tools beside another structured constraint are 400s."""
    assert parse_tool_choice({}) is None
    assert parse_tool_choice({"tools": [], "tool_choice": "auto"}) is None
    flags = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(ApiError) as e:
            parse_tool_choice(body)
        assert e.value.message.startswith(flags) and e.value.code == "unsupported"
        auto = parse_tool_choice(body, "hermes")
        assert (auto.kind, auto.parser, auto.constraint()) == ("auto", "hermes", None)
    for body, param, fragment in (
        ({"tool_choice": "required"}, "tool_choice", "\"required\" needs 'tools'"),
        ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice",
         "names a tool, but the request has no 'tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "get_weather"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
          "tool_choice": "required"}, "tools", "name"),
        ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools", "each"),
        ({"tools": "get_weather", "tool_choice": "required"}, "tools", "array"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ):  # fmt: skip
        with pytest.raises(ApiError, match=fragment) as e:
            parse_tool_choice(body, "hermes")
        assert e.value.param == param and e.value.status == 400
    constraint = parse_tool_choice({"tools": [WEATHER], "tool_choice": "required"}).constraint()
    with pytest.raises(ApiError, match="already constrains") as e:
        parse_sampling({"response_format": {"type": "json_object"}}, "chat", None, 8, None,
                       constraint)  # fmt: skip
    params, _ = parse_sampling({}, "chat", None, 8, None, constraint)
    assert params.structured_outputs == constraint


def test_a_stream_sends_named_arguments_as_they_come():
    """Guards the SSE shapes: a named call's first delta carries its id, type and name,
    later ones only argument text, and the last says finish_reason tool_calls."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    named = ToolStream(parse_tool_choice({"tools": [WEATHER], "tool_choice": forced}))
    pieces = ['{"city": ', '"Oslo", "unit": ', '"celsius"}']
    bodies = [
        named.delta(0, {"index": 0, "finish_reason": None}, "", p, "stop" if i == 2 else None)
        for i, p in enumerate(pieces)
    ]
    first = bodies[0]["delta"]["tool_calls"][0]
    assert first["function"]["name"] == "get_weather" and first["type"] == "function"
    assert all("id" not in b["delta"]["tool_calls"][0] for b in bodies[1:])
    args = "".join(b["delta"]["tool_calls"][0]["function"]["arguments"] for b in bodies)
    assert json.loads(args) == {"city": "Oslo", "unit": "celsius"}
    assert [b["finish_reason"] for b in bodies] == [None, None, "tool_calls"]


REQUIRED = parse_tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required"})
REPLIES = [
    '[{"name":"get_time","parameters":{}}]',
    '[{"name": "get_weather", "parameters": {"city": "Zürich \\"old town}", "unit": '
    '"celsius"}}, {"name": "get_time", "parameters": {}}]',
    '[ { "name" : "get_time" , "parameters" : { } } , {"name":"get_weather","parameters":'
    '{"city":"a,b}c","unit":"fahrenheit"}} ]',
]


def _required_stream(
    pieces: list[str], finish: str
) -> tuple[list[tuple[str, str]], str, str | None]:
    """A required reply streamed in `pieces` -> its calls as (name, arguments joined), its
    content joined, its last finish_reason; every call's first entry carries its id."""
    stream = ToolStream(REQUIRED)
    calls: dict[int, list[str]] = {}
    content, reason = "", None
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        body = stream.delta(0, {"index": 0, "finish_reason": finish if last else None}, "",
                            piece, finish if last else None)  # fmt: skip
        if body is None:
            continue
        content += body["delta"].get("content", "")
        for entry in body["delta"].get("tool_calls", []):
            fn = entry["function"]
            if entry["index"] not in calls:
                assert entry["id"].startswith("chatcmpl-tool-") and entry["type"] == "function"
                calls[entry["index"]] = [fn["name"], ""]
            else:
                assert "id" not in entry and "name" not in fn, entry
            calls[entry["index"]][1] += fn["arguments"]
        reason = body["finish_reason"]
    return [tuple(calls[i]) for i in sorted(calls)], content, reason


@pytest.mark.parametrize("reply", REPLIES)
def test_a_required_stream_cut_anywhere_sends_the_whole_replys_calls(reply):
    """Guards required streaming: each call is sent as it comes (its name once whole, then
    its arguments in pieces), and whatever the pieces the calls joined equal the whole
    reply's, whose arguments parse to the parameters the reply holds."""
    whole = REQUIRED.calls(reply)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert all(a == a.strip() for _, a in want), want  # the value only, no spaces around
    assert [(n, json.loads(a)) for n, a in want] == [
        (c["name"], c["parameters"]) for c in json.loads(reply)
    ]
    for cut in range(len(reply) + 1):
        got = _required_stream([reply[:cut], reply[cut:]], "stop")
        assert got == (want, "", "tool_calls"), cut
    assert _required_stream(list(reply), "stop") == (want, "", "tool_calls")


def test_a_cut_required_stream_keeps_what_it_sent():
    """A reply cut by max_tokens: before its first call's name is whole it is sent as text
    (as the whole reply is); after, the calls sent so far stay, their arguments a prefix
    of the uncut ones, and finish_reason stays length."""
    reply = REPLIES[1]
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in REQUIRED.calls(reply)]
    first_name = reply.index('"get_weather"') + len('"get_weather"')
    for cut in range(len(reply)):
        calls, content, reason = _required_stream(list(reply[:cut]) or [""], "length")
        assert reason == "length"
        whole = REQUIRED.calls(reply[:cut])
        if cut < first_name:
            assert calls == [] and content == reply[:cut] and whole is None
        else:
            assert content == "" and len(calls) <= len(want), cut
            for (name, args), (want_name, want_args) in zip(calls, want):
                assert name == want_name and want_args.startswith(args), (cut, args)
            # The unstreamed reply cut at the same point holds the same calls.
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == calls


AUTO = parse_tool_choice({"tools": [WEATHER, TIME]}, "hermes")
CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def _whole(text: str, finish: str = "stop", echoed: str = "") -> dict:
    body = {"index": 0, "message": {"role": "assistant", "content": echoed + text},
            "logprobs": None, "finish_reason": finish}  # fmt: skip
    return auto_reply(AUTO, body, echoed, text)


def _function(call: dict) -> tuple[str, str]:
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-"), call
    return call["function"]["name"], call["function"]["arguments"]


def test_auto_replies_carry_the_parsers_calls_in_openais_shape():
    """Guards the whole-reply shape: calls as tool_calls with ids and JSON-text arguments
    (non-ASCII kept), content null beside them, finish_reason tool_calls when the model
    stopped (a last block left open read too) and length when it was cut; a reply without
    calls, or whose call was cut, is left as its text; an echoed turn stays in front of the
    content and is not parsed."""
    body = _whole("Checking.\n" + CALLS)
    message = body["message"]
    assert message["content"] == "Checking." and body["finish_reason"] == "tool_calls"
    assert [_function(c) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Zürich", "unit": "celsius"}'),
        ("get_time", "{}"),
    ]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert _whole(CALLS)["message"]["content"] is None
    assert _whole(CALLS, "length")["finish_reason"] == "length"
    opened = _whole(CALLS.removesuffix("\n</tool_call>"))  # stopped in its last block
    assert opened["finish_reason"] == "tool_calls" and len(opened["message"]["tool_calls"]) == 2
    plain = _whole("It is sunny.")
    assert plain["message"] == {"role": "assistant", "content": "It is sunny."}
    assert plain["finish_reason"] == "stop"
    cut = _whole(CALLS[:60], "length")
    assert cut["message"]["content"] == CALLS[:60] and "tool_calls" not in cut["message"]
    echoed = _whole(CALLS, echoed="Let me look. ")
    assert echoed["message"]["content"] == "Let me look. "
    assert _whole('{"city": "Oslo"}\n</tool_call>', echoed="<tool_call>\n")["message"] == {
        "role": "assistant", "content": '<tool_call>\n{"city": "Oslo"}\n</tool_call>'
    }  # fmt: skip


def _stream(pieces: list[str], finish: str = "stop", logprobs=None) -> list[dict]:
    tools, bodies = AutoToolStream(AUTO), []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        body = {"index": 3, "delta": {"content": piece}, "logprobs": logprobs,
                "finish_reason": finish if last else None}  # fmt: skip
        body = tools.delta(3, body, "", piece, finish if last else None)
        if body is not None:
            bodies.append(body)
    return bodies


@pytest.mark.parametrize(
    "reply, finish",
    [
        ("Checking.\n" + CALLS, "stop"),
        ("It is <b>sunny</b>. ", "stop"),
        (CALLS[:70], "length"),
        (CALLS.removesuffix("\n</tool_call>"), "stop"),  # stopped in its last block
        (CALLS.removesuffix("\n</tool_call>"), "length"),  # cut right after its JSON
    ],
)
def test_an_auto_stream_cut_anywhere_sends_what_the_whole_reply_holds(reply, finish):
    """Guards the SSE shapes of auto against chunk boundaries: joined content and the
    calls (index counting up, the first delta of each with id, type and name, arguments
    whole) equal the unstreamed reply's, and so does the finish reason (tool_calls when
    the model stopped, the last call read from a block it left open; length stays)."""
    whole = _whole(reply, finish)
    want_calls = [_function(c) for c in whole["message"].get("tool_calls", [])]
    for cut in range(len(reply) + 1):
        pieces = [reply[:cut], reply[cut:]] if cut else list(reply)
        bodies = _stream(pieces, finish)
        content = "".join(b["delta"].get("content", "") for b in bodies)
        calls = [c for b in bodies for c in b["delta"].get("tool_calls", [])]
        assert content == (whole["message"]["content"] or ""), pieces
        assert [c["index"] for c in calls] == list(range(len(calls)))
        assert [_function(c) for c in calls] == want_calls
        assert bodies[-1]["finish_reason"] == whole["finish_reason"]


def test_an_auto_stream_holds_quietly_but_keeps_logprobs():
    """Guards what a held piece sends: nothing, or, when the client asked for logprobs,
    the chunk with an empty delta so no token's logprobs are lost."""
    quiet = _stream(["<tool", "_call>", CALLS[11:]])
    assert len(quiet) == 1 and len(quiet[0]["delta"]["tool_calls"]) == 2
    held = _stream(["<tool", "_call>", CALLS[11:]], logprobs={"content": []})
    assert [b["delta"] for b in held[:2]] == [{}, {}] and len(held) == 3


def test_parallel_tool_calls_false_allows_one_call():
    """Guards `parallel_tool_calls: false` (ignored before): `required` holds the array to
    one call (maxItems 1), and `auto` returns the parser's first call only, whole and
    streamed alike at every cut; true or absent keeps every call; not a boolean is a 400."""
    body = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    dfa = compile_spec(parse_tool_choice(body).constraint())
    one = '[{"name":"get_time","parameters":{}}]'
    assert dfa.matches(one.encode()) and not dfa.matches(f"[{one[1:-1]},{one[1:-1]}]".encode())
    many = compile_spec(parse_tool_choice({**body, "parallel_tool_calls": True}).constraint())
    assert many.matches(f"[{one[1:-1]},{one[1:-1]}]".encode())
    single = parse_tool_choice({"tools": [WEATHER, TIME], "parallel_tool_calls": False}, "hermes")
    reply = "Checking.\n" + CALLS
    whole = auto_reply(single, {"index": 0, "message": {"role": "assistant", "content": reply},
                                "logprobs": None, "finish_reason": "stop"}, "", reply)  # fmt: skip
    assert [_function(c) for c in whole["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Zürich", "unit": "celsius"}')]  # fmt: skip
    assert (whole["message"]["content"], whole["finish_reason"]) == ("Checking.", "tool_calls")
    for cut in range(len(reply) + 1):
        tools, calls = AutoToolStream(single), []
        pieces = [reply[:cut], reply[cut:]]
        for i, piece in enumerate(pieces):
            finish = "stop" if i == 1 else None
            b = tools.delta(0, {"index": 0, "logprobs": None, "finish_reason": finish}, "",
                            piece, finish)  # fmt: skip
            calls += [] if b is None else b["delta"].get("tool_calls", [])
        assert [(c["index"], *_function(c)) for c in calls] == [
            (0, "get_weather", '{"city": "Zürich", "unit": "celsius"}')], cut  # fmt: skip
    with pytest.raises(ApiError, match="parallel_tool_calls"):
        parse_tool_choice({**body, "parallel_tool_calls": "no"})
