"""`POST /v1/responses` on the session's real servers (Ray workers, the bundled SmolLM2),
through the openai SDK's `client.responses`: a response equals the chat completion its
request stands for, streamed events end in the same response, tools and multi-turn
function calls work, stored responses are continued, read and deleted, background
responses run on and are cancelled, and what is not carried out is a 400 naming the
field. The pieces on plain dicts are in
tests/test_responses_api.py and tests/test_response_store.py."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from test_serve_e2e import _metric

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"]}}  # fmt: skip


def _streamed(client: openai.OpenAI, **kw):
    """The events of a streamed response, and the response the last one carries."""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    return events, events[-1].response


@pytest.mark.parametrize("server", ["pd", "colocated"])
def test_a_response_is_the_chat_completion_it_stands_for(server, request):
    """Guards the translation end to end in both modes: greedy, the response's text
    equals the chat completion's for the same messages (instructions as the system
    message, max_output_tokens as max_tokens), its usage equals the chat's, a cut reply
    is `incomplete` with reason max_output_tokens; streamed, the text deltas join to the
    same text and the final event's response equals the unstreamed one, ids aside."""
    c = request.getfixturevalue(server).client()
    chat = c.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
    )  # fmt: skip
    kw = dict(model=MODEL, instructions="Be brief.", input=QUESTION, max_output_tokens=12,
              temperature=0)  # fmt: skip
    r = c.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)  # fmt: skip
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed"), r
    if cut:
        assert r.incomplete_details.reason == "max_output_tokens"
    assert (r.instructions, r.max_output_tokens, r.temperature, r.store) == (
        "Be brief.", 12, 0, True)  # fmt: skip
    events, final = _streamed(c, **kw)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    assert events[-1].type == ("response.incomplete" if cut else "response.completed")
    strip = lambda items: [{k: v for k, v in i.model_dump().items() if k != "id"} for i in items]  # noqa: E731
    assert strip(final.output) == strip(r.output)
    assert final.usage.output_tokens == r.usage.output_tokens


def test_function_tools_and_a_multi_turn_exchange(colocated):
    """Guards tools: a named function tool comes back as a `function_call` item (call id,
    name, JSON arguments), streamed as argument deltas that join to the same arguments;
    the next turn sends that call and its output back as input items and gets a text
    reply (the chat path renders the assistant's tool-call turn and the tool's result)."""
    c = colocated.client()
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], temperature=0,
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)  # fmt: skip
    r = c.responses.create(**kw)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    events, final = _streamed(c, **kw)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments == final.output[-1].arguments
    follow = c.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=8,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}],
    )  # fmt: skip
    assert follow.output_text and follow.output[-1].type == "message", follow


def test_a_json_schema_and_a_reply_that_thinks(colocated):
    """Guards text.format and the reasoning parser: a json_schema format holds the text
    to the schema; a reply forced into a think block (the colocated server runs qwen3)
    comes back as a reasoning item then the message, whole and streamed, with its
    reasoning tokens counted."""
    c = colocated.client()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    r = c.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30,
                           text={"format": {"type": "json_schema", "name": "place",
                                            "schema": schema, "strict": True}})  # fmt: skip
    assert set(json.loads(r.output_text)) == {"city"}, r.output_text
    think = {"structured_outputs": {"regex": "<think>[a-z ]{1,20}</think>\n[A-Za-z ]{1,20}"}}
    kw = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=60, extra_body=think)
    r = c.responses.create(**kw)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message", r.output
    assert reasoning.content[0].text and r.output_text
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events, final = _streamed(c, **kw)
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text
    assert final.output_text == r.output_text


def test_a_stored_response_is_continued_read_and_deleted(pd):
    """Guards the store end to end: a response continued by `previous_response_id` (with
    its own instructions) answers what the chat completion of the whole conversation
    answers, greedy, with the same prompt tokens; a streamed continuation is stored as its
    last event says; `GET` returns a response as it was answered; `store: false` keeps
    nothing; deleting a response breaks its conversation with a 404 naming it."""
    c = pd.client()
    kw = dict(model=MODEL, max_output_tokens=8, temperature=0)
    first = c.responses.create(input="My name is Ada.", **kw)
    assert (first.store, first.previous_response_id) == (True, None)
    second = c.responses.create(input=QUESTION, previous_response_id=first.id,
                                instructions="Be brief.", **kw)  # fmt: skip
    chat = c.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "My name is Ada."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    _, final = _streamed(c, input="Thanks.", previous_response_id=second.id, **kw)
    assert final.store and final.previous_response_id == second.id
    assert c.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    kept_not = c.responses.create(input="Hi", store=False, **kw)
    assert kept_not.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(kept_not.id)
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(input="And?", previous_response_id=final.id, **kw)
    assert e.value.body["param"] == "previous_response_id" and first.id in e.value.body["message"]
    assert c.responses.retrieve(second.id).id == second.id  # the rest of it is still there


def test_what_is_not_done_is_refused_by_name(pd):
    """Guards the edges: conversation objects and built-in tools are 400s naming the
    field (code unsupported), a bad field a 400 naming the Responses field it came from,
    and fetching or continuing a response never stored a 404; the server serves on."""
    c = pd.client()
    for kw, param in (
        (dict(conversation="conv_1"), "conversation"),
        (dict(tools=[{"type": "web_search"}]), "tools"),
        (dict(max_output_tokens=0), "max_output_tokens"),
        (dict(input=[]), "input"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**{"model": MODEL, "input": QUESTION, **kw})
        assert e.value.body["param"] == param, e.value.body
        if param == "max_output_tokens":  # said in the Responses API's words
            assert e.value.body["message"] == "'max_output_tokens' must be at least 1, got 0"
    r = httpx.get(pd.url + "/v1/responses/resp_1", timeout=30,
                  headers={"Authorization": f"Bearer {c.api_key}"})  # fmt: skip
    assert r.status_code == 404 and "not stored" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    assert c.responses.create(model=MODEL, input="Hi", max_output_tokens=2).output_text


def test_a_background_response_runs_on_and_can_be_cancelled(pd):
    """`background: true` answers at once with the response queued; read with GET it ends
    as the same request answered in the foreground (greedy), `background` kept true. A
    long one cancelled is `cancelled` at once and its generation is aborted on the decode
    worker (the worker runs nothing after); cancelling it again returns it as it is. A
    foreground response cannot be cancelled, and background needs `store` and no stream."""
    c = pd.client()
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    started = c.responses.create(background=True, **kw)
    assert started.status in ("queued", "in_progress") and started.background
    assert started.output == []
    deadline = time.monotonic() + 120
    done = c.responses.retrieve(started.id)
    while done.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        done = c.responses.retrieve(started.id)
    foreground = c.responses.create(**kw)
    assert done.status == foreground.status == "completed"
    assert done.output_text == foreground.output_text and done.background
    assert done.usage.output_tokens == foreground.usage.output_tokens

    long = c.responses.create(background=True, **dict(kw, max_output_tokens=900),
                              extra_body={"ignore_eos": True})  # fmt: skip
    assert c.responses.retrieve(long.id).status in ("queued", "in_progress")
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert c.responses.retrieve(long.id).status == "cancelled"
    assert c.responses.cancel(long.id).status == "cancelled"  # idempotent
    deadline = time.monotonic() + 10
    while _metric(pd.metrics(), "pdserve:num_requests_running", role="decode") > 0:
        assert time.monotonic() < deadline, "the cancelled run kept decoding"
        time.sleep(0.2)

    with pytest.raises(openai.BadRequestError) as e:
        c.responses.cancel(foreground.id)
    assert "only a background response can be cancelled" in e.value.body["message"]
    for extra, says in ((dict(store=False), "'background' needs 'store'"),
                        (dict(stream=True), "'background' with 'stream'")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(background=True, **kw, **extra)
        assert e.value.body["param"] == "background" and says in e.value.body["message"]
