"""The Responses API's pieces on plain dicts: a request read as its chat completion
(cluster/responses_input.py), a whole chat reply as output items and the response object
(cluster/responses_output.py), and a chat stream as semantic events
(cluster/responses_stream.py). Shapes are checked with the openai SDK's own pydantic
models (strict: every field's type), and a stream's final response must equal the whole
reply's output. The HTTP path is in tests/test_serve_e2e.py."""

from __future__ import annotations

import random

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.responses_input import chat_body
from pdserve.cluster.responses_output import output_items, response_object, response_usage
from pdserve.cluster.responses_stream import ResponseEvents

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


def test_a_request_reads_as_its_chat_completion():
    """Guards the translation: instructions first as a system message, a string input as
    the user's turn, max_output_tokens as max_tokens, flat tools nested, a named tool
    choice nested, text.format as response_format, reasoning.effort as chat's
    reasoning_effort, logprobs only when `include` asks; the sampling fields pass as they are."""
    body = {
        "model": "m", "instructions": "Be brief.", "input": "Hi", "max_output_tokens": 9,
        "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": True, "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                            "strict": True}},
        "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"],
        "top_logprobs": 2, "metadata": {"a": "b"}, "store": True,
    }  # fmt: skip
    assert chat_body(body) == {
        "model": "m", "temperature": 0.5, "top_p": 0.9, "seed": 3, "stream": True,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}],
        "max_tokens": 9,
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city",
            "parameters": WEATHER["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": {"type": "object"}, "strict": True}},
        "reasoning_effort": "low",
        "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip
    assert "logprobs" not in chat_body({"input": "Hi", "top_logprobs": 2})
    assert "response_format" not in chat_body({"input": "x", "text": {"format": {"type": "text"}}})


def test_the_cache_salt_rides_the_chat_field():
    """Guards vLLM's `cache_salt` on /v1/responses: dropped here, a tenant's responses
    would share the prefix cache with every other tenant's requests."""
    assert chat_body({"input": "Hi", "cache_salt": "tenant-a"})["cache_salt"] == "tenant-a"
    assert "cache_salt" not in chat_body({"input": "Hi"})


def test_input_items_read_as_turns():
    """Guards multi-turn input: messages with text parts (developer read as system), the
    model's function calls of one turn joined into one assistant message, their outputs as
    tool messages, reasoning items sent back dropped."""
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Sunny.", "annotations": []}]},
    ]  # fmt: skip
    assert chat_body({"input": items})["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny."},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"input": "x", "conversation": "conv_1"}, "conversation", "unsupported"),
        ({"input": "x", "truncation": "auto"}, "truncation", "unsupported"),
        ({"input": "x", "max_tool_calls": 2}, "max_tool_calls", "unsupported"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "unsupported"),
        ({"input": [{"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": "http://x"}]}]}, "input", "unsupported"),
        ({"input": [{"type": "computer_call_output"}]}, "input", "unsupported"),
        ({"input": []}, "input", None),
        ({"input": 3}, "input", None),
        ({}, "input", None),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", None),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", None),
        ({"input": "x", "instructions": 3}, "instructions", None),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", None),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice", None),
        ({"input": "x", "include": "message.output_text.logprobs"}, "include", None),
    ],
)  # fmt: skip
def test_what_cannot_be_read_or_done_is_a_400_naming_the_field(body, param, code):
    """Guards bad and unsupported input: each is refused with the Responses field's name
    (and code `unsupported` for work pdserve does not do), never dropped silently."""
    with pytest.raises(ApiError) as e:
        chat_body(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.message


def _choice(reasoning, content, calls, finish, logprobs=None) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ]
    return {"index": 0, "message": message, "finish_reason": finish,
            "logprobs": {"content": logprobs} if logprobs else None}  # fmt: skip


LP = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []},
      {"token": "!", "logprob": -1.0, "bytes": [33], "top_logprobs": []}]  # fmt: skip
REPLIES = [
    (None, "Hi!", [], "stop", LP),
    ("Let me see.", "Hi!", [], "stop", LP),
    ("Thinking", None, [("get_weather", '{"city": "Paris"}')], "tool_calls", None),
    (None, "Checking.", [("get_weather", '{"city": "Oslo"}'), ("get_weather", "{}")],
     "tool_calls", None),
    (None, "Hi th", [], "length", None),
    ("cut in the thinking", None, [], "length", None),
    (None, None, [("get_weather", '{"city": "Os')], "length", None),  # a call cut short
    (None, None, [], "stop", None),
]  # fmt: skip
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip


def _chunks(choice: dict, rng: random.Random) -> list[dict]:
    """The chat stream of a whole choice, in random pieces: the role chunk, reasoning,
    content, then each call (its name whole, its arguments in pieces), the finish last."""
    message, out = choice["message"], [{"delta": {"role": "assistant", "content": ""}}]

    def pieces(text: str) -> list[str]:
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 3))) if text else []
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    for piece in pieces(message.get("reasoning") or ""):
        out.append({"delta": {"reasoning": piece}})
    lps = list((choice.get("logprobs") or {}).get("content") or [])
    for piece in pieces(message.get("content") or ""):
        out.append({"delta": {"content": piece}, "logprobs": {"content": lps[:1]}})
        lps = lps[1:]
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        out.append(
            {
                "delta": {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            }
        )
        for piece in pieces(fn["arguments"]):
            out.append({"delta": {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}})
    out.append({"delta": {}, "finish_reason": choice["finish_reason"]})
    return [{"index": 0, "logprobs": None, "finish_reason": None, **c} for c in out]


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@pytest.mark.parametrize("reply", REPLIES)
def test_a_stream_of_events_ends_in_the_whole_replys_response(reply):
    """Guards streaming: every event validates as the SDK's event type, sequence numbers
    count up from 0, an item's deltas join to its done text, items open and close in
    order, and the final response's output equals the unstreamed output (ids aside):
    the same items, statuses, texts, calls and logprobs."""
    body = {"model": "m", "input": "Hi", "tools": [WEATHER]}
    choice = _choice(*reply)
    whole = output_items(choice)
    usage = response_usage(USAGE, 2)
    Response.model_validate(response_object(body, "resp_1", 5, "m", "completed", whole, usage))
    for seed in range(5):
        stream = ResponseEvents(body, "resp_1", 5, "m")
        events = stream.start()
        for c in _chunks(choice, random.Random(seed)):
            events += stream.feed(c)
        events += stream.finish(usage)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for e in events:
            EVENTS.validate_python(e)
        final = events[-1]
        want = "response.incomplete" if reply[3] == "length" else "response.completed"
        assert final["type"] == want
        assert _without_ids(final["response"]["output"]) == _without_ids(whole)
        assert final["response"]["usage"] == usage
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert added == [i["type"] for i in whole] == [i["type"] for i in done]
        assert done == final["response"]["output"]  # each item as its done event gave it
        deltas: dict[str, str] = {}
        for e in events:
            if e["type"].endswith(".delta"):
                deltas[e["item_id"]] = deltas.get(e["item_id"], "") + e["delta"]
        for item in done:
            text = {"reasoning": lambda i: i["content"][0]["text"],
                    "message": lambda i: i["content"][0]["text"],
                    "function_call": lambda i: i["arguments"]}[item["type"]](item)  # fmt: skip
            assert deltas.get(item["id"], "") == text


def test_an_error_mid_stream_is_an_error_event():
    """Guards a worker failure mid-stream: an `error` event with the code and message."""
    stream = ResponseEvents({"input": "x"}, "resp_1", 5, "m")
    stream.start()
    err = ApiError("the request failed in a worker: boom", 500, "server_error").body()
    event = stream.error(err)
    EVENTS.validate_python(event)
    assert (event["type"], event["message"], event["sequence_number"]) == (
        "error", "the request failed in a worker: boom", 2)  # fmt: skip


def test_the_response_repeats_the_request_and_maps_usage():
    """Guards the response object: the request's settings come back (defaults where it
    gave none), store as the request is answered (false unless it says true:
    cluster/responses_routes.py sets it) with the response it continues, usage in the
    Responses API's names."""
    body = {"input": "x", "instructions": "Be brief.", "temperature": 0.2, "tools": [WEATHER],
            "metadata": {"k": "v"}, "max_output_tokens": 5}  # fmt: skip
    r = response_object(body, "resp_9", 11, "m", "completed", [], response_usage(USAGE, 0))
    Response.model_validate(r)
    assert (r["instructions"], r["temperature"], r["tools"], r["metadata"]) == (
        "Be brief.", 0.2, [WEATHER], {"k": "v"})  # fmt: skip
    assert (r["max_output_tokens"], r["tool_choice"], r["store"], r["top_p"]) == (5, "auto",
                                                                                  False, None)  # fmt: skip
    kept = response_object(dict(body, store=True, previous_response_id="resp_8"), "resp_9", 11,
                           "m", "completed", [], None)  # fmt: skip
    Response.model_validate(kept)
    assert (kept["store"], kept["previous_response_id"]) == (True, "resp_8")
    assert r["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                          "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 10}  # fmt: skip
