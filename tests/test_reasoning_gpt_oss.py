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
    # a preamble on the commentary channel, then a call to a tool: bodies are answer text
    f"{A}Need weather.{E}{S}<|channel|>commentary<|message|>Checking.{E}{S}"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
    "<|call|>": ("Need weather.", 'Checking.{"city":"Oslo"}'),
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


@pytest.mark.parametrize("parser,skips", [("openai_gptoss", False), ("qwen3", True), (None, True)])
def test_a_chat_request_keeps_special_tokens_only_for_the_harmony_parser(parser, skips):
    """Through the request parser itself (cluster/completion_request.py) with the bundled
    model's tokenizer: the harmony parser's chat requests are detokenized with special
    tokens, every other's as the client asked (the default, without)."""
    import asyncio

    from pdserve.cluster.completion_request import parse_body
    from pdserve.cluster.http_app import AppState
    from pdserve.cluster.metrics import Metrics
    from pdserve.runner.model_source import resolve_model_dir
    from pdserve.runner.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model_dir(None)[0]))
    state = AppState(None, tokenizer, "m", 512, Metrics("m"), reasoning_parser=parser)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    (chat,) = asyncio.run(parse_body(state, body, "chat"))
    assert chat.params.skip_special_tokens is skips
    (completion,) = asyncio.run(parse_body(state, {"model": "m", "prompt": "Hi"}, "completion"))
    assert completion.params.skip_special_tokens is True
