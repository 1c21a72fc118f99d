"""`--reasoning-parser openai_gptoss` (cluster/reasoning/gpt_oss.py) on strings: gpt-oss's
harmony replies read by channel, whole and streamed in pieces cut anywhere, with no
marker reaching the client; and the request path asking for special tokens."""

from __future__ import annotations

import random

import pytest
from test_reasoning import _cuts, _streamed

from pdserve.cluster.reasoning import make_parser
from pdserve.cluster.reasoning.base import Reasoned
from pdserve.cluster.reasoning_api import request_parser
from pdserve.runner.sampling_params import SamplingParams

A, F, E, S = (
    "<|channel|>analysis<|message|>",
    "<|channel|>final<|message|>",
    "<|end|>",
    ("<|start|>assistant"),
)

# reply -> (reasoning, content)
CASES = {
    f"{A}The user wants the capital.{E}{S}{F}Paris.": ("The user wants the capital.", "Paris."),
    f"{A}Think.{E}{S}{F}Paris.<|return|>": ("Think.", "Paris."),
    f"{A}Still thinking": ("Still thinking", None),  # cut by max_tokens in the analysis
    f"{A}Done.{E}{S}": ("Done.", None),  # cut before the next header
    f"{A}Done.{E}{S}<|channel|>fin": ("Done.", None),  # cut inside a header
    f"{A}a <| b{E}{S}{F}c": ("a <| b", "c"),  # a marker's start that is text
    f"{F}Just the answer.": (None, "Just the answer."),
    "Plain text, no harmony.": (None, "Plain text, no harmony."),
    '{"city": "Paris"}': (None, '{"city": "Paris"}'),  # a grammar held it from the start
    "<|chan": (None, "<|chan"),  # cut inside the first marker: it never opened
    # a preamble on the commentary channel, then a call to a tool: the call goes on in its
    # canonical form, for --tool-call-parser openai
    f"{A}Need weather.{E}{S}<|channel|>commentary<|message|>Checking.{E}{S}"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
    "<|call|>": (
        "Need weather.",
        'Checking.<|channel|>commentary to=functions.get_weather<|message|>{"city":"Oslo"}<|call|>',
    ),
    # the recipient after the role, the reply opening with it (the prompt ends in the role)
    ' to=functions.f<|channel|>commentary json<|message|>{"a":1}<|call|>': (
        None,
        '<|channel|>commentary to=functions.f<|message|>{"a":1}<|call|>',
    ),
    f"{A}x{E}{S} to=functions.f<|channel|>commentary json<|message|>" + '{"a":': (
        "x",
        '<|channel|>commentary to=functions.f<|message|>{"a":',  # cut: no <|call|>
    ),
    " tomorrow": (None, " tomorrow"),  # not a recipient
    f"{A}Über 東京 ☀{E}{S}{F}答え 🗼": ("Über 東京 ☀", "答え 🗼"),
    f"{A}{E}{S}{F}x": (None, "x"),  # empty reasoning
    "": (None, None),
}


@pytest.mark.parametrize("reply", list(CASES))
def test_a_whole_reply_reads_by_channel(reply):
    assert make_parser("openai_gptoss").parse(reply) == Reasoned(*CASES[reply])


def test_a_stream_cut_anywhere_equals_the_whole_reply():
    """Markers split across pieces, headers arriving a character at a time."""
    parser = make_parser("openai_gptoss")
    rng = random.Random(5)
    for reply, want in CASES.items():
        for pieces in _cuts(reply, rng):
            assert _streamed(parser, pieces) == (want[0] or "", want[1] or ""), (reply, pieces)


def test_a_stream_lets_text_out_as_it_comes():
    """Only a possible marker's start is held: a body's text goes out with its piece."""
    stream = make_parser("openai_gptoss").stream()
    assert stream.feed(A + "Let me").reasoning == "Let me"
    step = stream.feed(" think<|en")
    assert step.reasoning == " think"  # `<|en` may be `<|end|>`
    assert stream.feed("d|>" + S + F + "Paris").content == "Paris"


def test_chat_requests_are_detokenized_with_the_markers():
    """The parser reads special tokens, so a chat request under it keeps them in its
    text (the parser drops them from what it lets out); other parsers do not ask."""
    assert make_parser("openai_gptoss").needs_special_tokens
    assert not make_parser("qwen3").needs_special_tokens
    assert request_parser("openai_gptoss", "chat", SamplingParams()) is not None


@pytest.mark.parametrize(
    "parser,tool_parser,skips",
    [("openai_gptoss", None, False), (None, "openai", False), ("qwen3", "hermes", True),
     (None, None, True)],
)  # fmt: skip
def test_a_chat_request_keeps_special_tokens_only_for_the_harmony_parsers(
    parser, tool_parser, skips
):
    """Through the request parser itself (cluster/completion_request.py) with the bundled
    model's tokenizer: chat requests read by a harmony parser (reasoning, or tool calls
    under tool_choice auto) are detokenized with special tokens, every other as the
    client asked (the default, without)."""
    import asyncio

    from pdserve.cluster.completion_request import parse_body
    from pdserve.cluster.http_app import AppState
    from pdserve.cluster.metrics import Metrics
    from pdserve.runner.model_source import resolve_model_dir
    from pdserve.runner.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model_dir(None)[0]))
    state = AppState(None, tokenizer, "m", 512, Metrics("m"), reasoning_parser=parser,
                     auto_tool_parser=tool_parser)  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    if tool_parser is not None:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    (chat,) = asyncio.run(parse_body(state, body, "chat"))
    assert chat.params.skip_special_tokens is skips
    (completion,) = asyncio.run(parse_body(state, {"model": "m", "prompt": "Hi"}, "completion"))
    assert completion.params.skip_special_tokens is True


TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL_REPLY = (
    f"{A}The user wants Oslo's weather.{E}{S}<|channel|>commentary<|message|>Let me check."
    f"{E}{S} to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
    '{"city": "Oslo"}<|call|>'
)


def test_tool_calls_read_through_both_parsers():
    """The reasoning parser hands the call on; `--tool-call-parser openai` reads it into
    a call, leaving the preamble as content; a call to a tool the request lacks, or
    arguments that are not an object, stay text."""
    from pdserve.cluster.tool_parsers import make_parser as make_tool_parser
    from pdserve.cluster.tool_parsers.base import Call

    reply = make_parser("openai_gptoss").parse(CALL_REPLY)
    assert reply.reasoning == "The user wants Oslo's weather."
    calls = make_tool_parser("openai", TOOLS).parse(reply.content)
    assert calls.calls == (Call("get_weather", '{"city": "Oslo"}'),)
    assert calls.content == "Let me check."
    other = make_tool_parser("openai", {"get_time": {}}).parse(reply.content)
    assert other.calls == () and other.content == reply.content
    bad = "<|channel|>commentary to=functions.get_weather<|message|>[1]<|call|>"
    assert make_tool_parser("openai", TOOLS).parse(bad).calls == ()


def test_tool_calls_stream_cut_anywhere():
    """The reasoning stream, then the tool stream, over pieces cut anywhere, give the
    whole reply's reasoning, content and calls."""
    from pdserve.cluster.tool_parsers import make_parser as make_tool_parser

    whole = make_parser("openai_gptoss").parse(CALL_REPLY)
    want = make_tool_parser("openai", TOOLS).parse(whole.content)
    rng = random.Random(8)
    for pieces in _cuts(CALL_REPLY, rng):
        reasoning_stream = make_parser("openai_gptoss").stream()
        tool_stream = make_tool_parser("openai", TOOLS).stream()
        reasoning, content, calls = "", "", []
        for piece in [*pieces, None]:
            step = reasoning_stream.feed(piece) if piece is not None else reasoning_stream.finish()
            reasoning += step.reasoning
            tools = tool_stream.feed(step.content)
            if piece is None:
                tools = tools.then(tool_stream.finish())
            content, calls = content + tools.content, calls + tools.calls
        assert reasoning == whole.reasoning
        assert (content or None, tuple(calls)) == (want.content, want.calls), pieces
