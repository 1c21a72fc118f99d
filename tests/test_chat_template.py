"""Chat prompts as vLLM renders them, with the bundled SmolLM2 tokenizer: the model's
template or `--chat-template`'s, `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`, and the 400s for what a template or a request gets wrong. The
flag on a real server is in test_serve_vllm_compat.py."""

from __future__ import annotations

import copy

import pytest

from pdserve.cluster.chat_template import load_chat_template, render_chat
from pdserve.cluster.openai_api import ApiError

Q = [{"role": "user", "content": "What is the capital of France?"}]
SHOUT = "{% for m in messages %}{{ m.content }}|{% endfor %}{% if shout %}!{% endif %}"


@pytest.fixture(scope="module")
def tok(smollm_dir):
    from pdserve.runner.tokenizer import load_tokenizer

    return load_tokenizer(smollm_dir)


def test_the_models_template_by_default(tok):
    want = tok.apply_chat_template(Q, tokenize=False, add_generation_prompt=True)
    assert render_chat({"messages": Q}, tok) == want
    assert want.endswith("<|im_start|>assistant\n")
    bare = render_chat({"messages": Q, "add_generation_prompt": False}, tok)
    assert want == bare + "<|im_start|>assistant\n"


def test_continue_final_message_leaves_the_answer_open(tok):
    msgs = [*Q, {"role": "assistant", "content": "The capital of France is"}]
    text = render_chat({"messages": msgs, "continue_final_message": True}, tok)
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
    with pytest.raises(ApiError, match="cannot both be true"):
        render_chat(
            {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True}, tok
        )


def test_kwargs_reach_the_template(tok):
    assert render_chat({"messages": Q}, tok, SHOUT) == Q[0]["content"] + "|"
    body = {"messages": Q, "chat_template_kwargs": {"shout": True}}
    assert render_chat(body, tok, SHOUT) == Q[0]["content"] + "|!"
    for kwargs, message in (
        ({"add_generation_prompt": False}, "may not set \\['add_generation_prompt'\\]"),
        ({"chat_template": "x"}, "may not set"),
        # Names the renderer binds itself: replacing one was a 500 (fuzzing found it).
        ({"messages": Q}, "may not set \\['messages'\\]"),
        ({"raise_exception": 1}, "may not set \\['raise_exception'\\]"),
        ({"namespace": 1, "range": 2}, "may not set \\['namespace', 'range'\\]"),
        ([1], "must be an object"),
    ):
        with pytest.raises(ApiError, match=message):
            render_chat({"messages": Q, "chat_template_kwargs": kwargs}, tok, SHOUT)


def test_template_and_model_refusals_are_400s(tok):
    strict = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(ApiError, match="refused the conversation: roles must alternate") as e:
        render_chat({"messages": Q}, tok, strict)
    assert e.value.status == 400
    # A template that trips on what the request holds (a number where it adds strings).
    adds = "{% for m in messages %}{{ m.content + '|' }}{% endfor %}"
    with pytest.raises(ApiError, match="refused the conversation") as e:
        render_chat({"messages": Q, "chat_template_kwargs": {"x": 1}}, tok, adds + "{{ x + 'a' }}")
    assert e.value.status == 400
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(ApiError, match="--chat-template"):
        render_chat({"messages": Q}, bare)
    assert render_chat({"messages": Q}, bare, SHOUT) == Q[0]["content"] + "|"
    with pytest.raises(ApiError, match="'continue_final_message' must be a boolean"):
        render_chat({"messages": Q, "continue_final_message": "yes"}, tok)


def test_the_flag_takes_a_file_or_a_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(SHOUT)
    assert load_chat_template(str(f)) == SHOUT
    assert load_chat_template(SHOUT) == SHOUT
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


CALLS = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.function.name }}>"
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}|{% endfor %}"
)


def test_an_assistant_turn_of_tool_calls_renders(tok):
    """Guards multi-turn tool use as OpenAI's clients send it: the assistant's turn with
    `content: null` and `tool_calls` (a 400 before), its arguments (JSON text on the wire)
    reaching the template as the object, the tool's result turn with its call id; and the
    400s for calls the template cannot use."""
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    body = {"messages": [*Q, turn, result], "add_generation_prompt": False}
    text = render_chat(body, tok, CALLS)
    assert text == (
        f"user:{Q[0]['content']}|"
        'assistant:<call get_weather>{"city": "Zürich"}<call now>{}|'
        "tool:sunny[c1]|"
    )
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    bad = copy.deepcopy(turn)
    bad["tool_calls"][0]["function"]["arguments"] = '{"city": '
    with pytest.raises(ApiError, match="'arguments' is not valid JSON") as e:
        render_chat({"messages": [*Q, bad]}, tok, CALLS)
    assert e.value.param == "messages"
    for calls in ("x", [{"function": {"arguments": "{}"}}]):
        with pytest.raises(ApiError, match="tool_calls|'name'"):
            render_chat({"messages": [*Q, {**turn, "tool_calls": calls}]}, tok, CALLS)
    with pytest.raises(ApiError, match="string 'role' and 'content'"):
        render_chat({"messages": [*Q, {"role": "user", "content": None}]}, tok, CALLS)


def test_reasoning_effort_and_documents_reach_the_template(tok):
    """Guards vLLM's chat fields for templates: `reasoning_effort` becomes the template
    variable (chat_template_kwargs' own value wins), `documents` the template's documents;
    wrong types are 400s naming the field."""
    t = ("{{ reasoning_effort | default('unset') }}|"
         "{% for d in documents or [] %}{{ d.title }}:{{ d.text }};{% endfor %}")  # fmt: skip
    assert render_chat({"messages": Q}, tok, t) == "unset|"
    assert render_chat({"messages": Q, "reasoning_effort": "low"}, tok, t) == "low|"
    both = {
        "messages": Q,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"reasoning_effort": "high"},
    }
    assert render_chat(both, tok, t) == "high|"
    docs = [{"title": "Paris", "text": "capital"}, {"title": "Oslo", "text": "north"}]
    assert (
        render_chat({"messages": Q, "documents": docs}, tok, t) == "unset|Paris:capital;Oslo:north;"
    )
    for field, value in (("reasoning_effort", 3), ("documents", "x")):
        with pytest.raises(ApiError) as e:
            render_chat({"messages": Q, field: value}, tok, t)
        assert e.value.param == field
