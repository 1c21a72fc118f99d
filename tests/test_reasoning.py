"""The reasoning parsers of `--reasoning-parser` (cluster/reasoning/) on strings: what each
reads as reasoning and what as the answer, that a stream of the same reply, cut anywhere,
lets out exactly that, and how the split meets tool calls (cluster/reasoning_api.py with
cluster/auto_tools.py and cluster/tool_calls.py, composed in completion_choices' order).
The HTTP path is in tests/test_serve_e2e.py."""

from __future__ import annotations

import random

import pytest

from pdserve.cluster.auto_tools import AutoToolStream, auto_reply
from pdserve.cluster.reasoning import PARSERS, make_parser
from pdserve.cluster.reasoning.base import Reasoned, ReasoningParser, ReasoningStep
from pdserve.cluster.reasoning_api import (
    ReasoningSplits,
    reasoned_constraint,
    request_parser,
    split_message,
    with_reasoning,
)
from pdserve.cluster.tool_calls import ToolStream, parse_tool_choice
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.structured.patterns import compile_spec
from pdserve.runner.structured.spec import StructuredOutputs

UNICODE = "<think>Zürich oder 東京? 晴れ ☀ \U0001f5fc</think>\n答え: 東京 🗼"
UNICODE_SPLIT = ("Zürich oder 東京? 晴れ ☀ \U0001f5fc", "答え: 東京 🗼")

# reply -> (reasoning, content), as the qwen3 parser reads it
QWEN3 = {
    "The capital is Paris.": (None, "The capital is Paris."),  # no tags: all answer
    "<think>\nThe user asks.\n</think>\n\nParis.": ("\nThe user asks.\n", "Paris."),
    # Only `</think>`: the reply did not open a block, so it is all answer.
    "The user asks.</think>Paris.": (None, "The user asks.</think>Paris."),
    "<think>I am still thinking": ("I am still thinking", None),  # cut inside reasoning
    "<think>Almost done</thi": ("Almost done</thi", None),  # cut inside the closing tag
    "<thi": (None, "<thi"),  # cut inside the opening tag: it never opened
    "<think>": (None, None),
    "<think></think>Paris.": (None, "Paris."),  # empty reasoning
    "<think>\n\n</think>\n\nParis.": ("\n\n", "Paris."),  # Qwen3's /no_think, verbatim
    "<think>Done</think>": ("Done", None),
    "<think>Done</think>\n\n": ("Done", None),
    "<think>Done</think> \nParis.": ("Done", " \nParis."),  # only \n is dropped
    "<think>Done</think>\r\nParis.": ("Done", "\r\nParis."),
    UNICODE: UNICODE_SPLIT,
    " <think>a</think>b": (None, " <think>a</think>b"),  # a tag not at the very start
    "<think>a</think>b</think>c": ("a", "b</think>c"),  # the first close ends it
    "<think><think>a</think>\nb": ("<think>a", "b"),
    "<thinking>a</think>b": (None, "<thinking>a</think>b"),  # not the tag
    "a < b and <thin": (None, "a < b and <thin"),
    "": (None, None),
}

# reply -> (reasoning, content), as the deepseek_r1 parser reads it
DEEPSEEK_R1 = {
    "The capital is Paris.": ("The capital is Paris.", None),  # no tags: all reasoning
    "<think>\nThe user asks.\n</think>\n\nParis.": ("\nThe user asks.\n", "Paris."),
    "The user asks.\n</think>\n\nParis.": ("The user asks.\n", "Paris."),  # <think> in prompt
    "<think>I am still thinking": ("I am still thinking", None),
    "Almost done</thi": ("Almost done</thi", None),
    "<thi": ("<thi", None),
    "<think>": (None, None),
    "</think>Paris.": (None, "Paris."),  # empty reasoning
    "<think></think>\nParis.": (None, "Paris."),
    "Done</think>": ("Done", None),
    "Done</think>\n\n\n": ("Done", None),
    "Done</think> \nParis.": ("Done", " \nParis."),
    UNICODE: UNICODE_SPLIT,
    UNICODE[len("<think>") :]: UNICODE_SPLIT,
    " <think>a</think>b": (" <think>a", "b"),
    "<thinking>a</think>b": ("<thinking>a", "b"),
    "a</think>b</think>c": ("a", "b</think>c"),
    "": (None, None),
}


def _tags(name: str, text):
    """A case's text in a parser's own tags (seed_oss: `<seed:think>`, `</seed:think>`;
    a cut tag is cut alike); None stays None."""
    if name != "seed_oss" or text is None:
        return text
    return text.replace("<thi", "<seed:thi").replace("</thi", "</seed:thi")


def _in_tags(name: str, table: dict) -> dict:
    return {_tags(name, k): tuple(_tags(name, v) for v in want) for k, want in table.items()}


# seed_oss reads as qwen3 does, in its own tags
CASES = {"qwen3": QWEN3, "deepseek_r1": DEEPSEEK_R1, "seed_oss": _in_tags("seed_oss", QWEN3)}

# reply -> (reasoning, content) under a grammar from the first token, for both parsers
CONSTRAINED = {
    '{"city": "Paris"}': (None, '{"city": "Paris"}'),
    "<think>why not</think>\nParis": ("why not", "Paris"),  # a block the grammar spells
    "why not</think>Paris": (None, "why not</think>Paris"),
    "<think>cut": ("cut", None),
    "<": (None, "<"),
    "": (None, None),
}


def test_every_parser_has_cases():
    """Guards the registry against a parser added without its cases here (the harmony
    parser, which reads no `<think>` tags: tests/test_reasoning_gpt_oss.py)."""
    assert set(PARSERS) == set(CASES) | {"openai_gptoss"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_whole_reply_reads_into_reasoning_and_answer(name):
    """Guards each parser's reading: no tags, both tags, only the close, cut inside the
    reasoning or inside a tag, empty reasoning, leading newlines of the answer (only
    those), a tag not at the start, unicode; and that a grammar from the first token makes
    every parser open in the answer."""
    for reply, want in CASES[name].items():
        assert make_parser(name).parse(reply) == Reasoned(*want), reply
    for reply, want in _in_tags(name, CONSTRAINED).items():
        assert make_parser(name, constrained=True).parse(reply) == Reasoned(*want), reply


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_prompt_that_opens_a_block_opens_the_reply_in_the_reasoning(name):
    """Guards Qwen3 Thinking-2507 / Qwen3.5 templates, which end the prompt with
    `<think>\\n`: their replies carry only `</think>`, and with the prompt's block open
    every parser reads them as deepseek_r1 does (reasoning up to `</think>`; no close: all
    reasoning), whole and streamed; a grammar still opens the reply in the answer."""
    parser = make_parser(name, prompt_opens_block=True)
    rng = random.Random(13)
    for reply, want in _in_tags(name, DEEPSEEK_R1).items():
        assert parser.parse(reply) == Reasoned(*want), reply
        for pieces in _cuts(reply, rng):
            assert _streamed(parser, pieces) == (want[0] or "", want[1] or ""), pieces
    held = make_parser(name, constrained=True, prompt_opens_block=True)
    for reply, want in _in_tags(name, CONSTRAINED).items():
        assert held.parse(reply) == Reasoned(*want), reply


def test_a_prompt_opens_a_block_only_when_it_ends_with_the_tag():
    """Guards the prompt reading: the text of its last tokens must end with `<think>`,
    whitespace aside; a block the prompt closes (Qwen3 with thinking switched off), a tag
    earlier in the prompt or a near-miss does not open the reply in the reasoning."""
    plain = SamplingParams()
    opens = [
        "<|im_start|>assistant\n<think>\n",
        "<｜Assistant｜><think>\n",
        "<think>",
        "<think>\n\n \t",
    ]
    closes = [
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_start|>assistant\n",
        "<think> and more",
        "<thinking>\n",
        "",
    ]
    for tail in opens:
        assert request_parser("qwen3", "chat", plain, tail).parse("a</think>b") == Reasoned(
            "a", "b"
        ), tail
    for tail in closes:
        assert request_parser("qwen3", "chat", plain, tail).parse("a</think>b") == Reasoned(
            None, "a</think>b"
        ), tail
    assert request_parser("qwen3", "completion", plain, opens[0]) is None


def _streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    stream = parser.stream()
    reasoning = content = ""
    for piece in pieces:
        step = stream.feed(piece)
        reasoning, content = reasoning + step.reasoning, content + step.content
    step = stream.finish()
    return reasoning + step.reasoning, content + step.content


def _cuts(reply: str, rng: random.Random):
    """The reply in pieces: cut once at every position, into single characters, and at
    random places (seeded), empty pieces included."""
    for i in range(len(reply) + 1):
        yield [reply[:i], reply[i:]]
    yield list(reply)
    for _ in range(30):
        points = sorted(rng.choices(range(len(reply) + 1), k=rng.randint(2, 8)))
        yield [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)]


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stream_cut_anywhere_equals_the_whole_reply(name, constrained):
    """Guards streaming against chunk boundaries: `<think>` or `</think>` split across
    pieces, newlines after the close arriving alone, a tag's start that never completes.
    The reasoning and answer a stream lets out, joined, equal the whole reply's."""
    parser = make_parser(name, constrained)
    rng = random.Random(11)
    for reply in [*CASES[name], *_in_tags(name, CONSTRAINED)]:
        whole = parser.parse(reply)
        want = (whole.reasoning or "", whole.content or "")
        for pieces in _cuts(reply, rng):
            assert _streamed(parser, pieces) == want, (reply, pieces)


def test_a_stream_holds_only_what_may_be_a_tag():
    """Guards the stream's latency: reasoning and answer go out as they come; held are
    only the reply's start while it may be `<think>`, a possible `</think>` at the end of
    the reasoning, and newlines right after `</think>`."""
    stream = make_parser("qwen3").stream()
    assert stream.feed("<thi") == ReasoningStep()
    assert stream.feed("nk>I wonder") == ReasoningStep("I wonder")
    assert stream.feed(" if a < b</thi") == ReasoningStep(" if a < b")
    assert stream.feed("s>") == ReasoningStep("</this>")  # not the tag after all
    assert stream.feed("</think>\n") == ReasoningStep()
    assert stream.feed("\nParis") == ReasoningStep("", "Paris")
    assert stream.feed("</think>") == ReasoningStep("", "</think>")  # the answer's text
    assert stream.finish() == ReasoningStep()
    stream = make_parser("qwen3").stream()
    assert stream.feed("<b") == ReasoningStep("", "<b")  # cannot be <think>: answer at once
    stream = make_parser("deepseek_r1").stream()
    assert stream.feed("Hmm") == ReasoningStep("Hmm")
    assert stream.finish() == ReasoningStep()


def test_only_chat_is_parsed_and_a_grammar_holds_the_answer_after_the_reasoning():
    """Guards which requests are split (chat with the flag, never completions: raw text,
    as in vLLM) and where a constraint (the client's or a tool choice's) holds the reply:
    after the reasoning block, as on vLLM. deepseek_r1's reply opens in its reasoning and
    must close it before the JSON; qwen3's may reason or answer at once; the split is the
    parser's own reading. gpt-oss's harmony parser keeps the grammar on the whole reply."""
    plain = SamplingParams()
    json_mode = SamplingParams(structured_outputs=StructuredOutputs(json_object=True))
    assert request_parser(None, "chat", plain) is None
    assert request_parser("deepseek_r1", "completion", plain) is None
    assert request_parser("deepseek_r1", "chat", plain).parse("{}") == Reasoned("{}", None)
    assert reasoned_constraint(None, json_mode.structured_outputs) is json_mode.structured_outputs
    for name, replies in {
        "deepseek_r1": {b"{}": None, b"Hmm.</think>\n\n{}": ("Hmm.", "{}"),
                        b"<think>Hmm.</think>{}": ("Hmm.", "{}"),
                        b"Hmm.</think>{} ok": None, b"Hmm.</think>{}</think>": None},
        "qwen3": {b"{}": (None, "{}"), b"<think>Hmm.</think>\n{}": ("Hmm.", "{}"),
                  b"Hmm.</think>{}": None, b"<think>Hmm.": None},
        "seed_oss": {b"<seed:think>a</think></seed:think>{}": ("a</think>", "{}")},
        "openai_gptoss": {b"{}": (None, "{}"), b"<think>a</think>{}": None},
    }.items():  # fmt: skip
        parser = request_parser(name, "chat", json_mode)
        dfa = compile_spec(reasoned_constraint(parser, json_mode.structured_outputs))
        for reply, want in replies.items():
            assert dfa.matches(reply) == (want is not None), (name, reply)
            if want is not None:
                assert parser.parse(reply.decode()) == Reasoned(*want), (name, reply)


# ---- with tool calls, as the completion routes compose them -------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
AUTO = parse_tool_choice({"tools": [WEATHER]}, "hermes")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ARGS = '{"city": "Oslo"}'


def _whole(parser: ReasoningParser, text: str, echoed: str = "", choice=AUTO) -> dict:
    """completion_choices' chat_reply: split, the answer's tool calls, then `reasoning`."""
    body = {"index": 0, "message": {"role": "assistant", "content": echoed + text},
            "logprobs": None, "finish_reason": "stop"}  # fmt: skip
    reasoning, answer = split_message(parser, body, echoed, text)
    if choice.kind == "auto":
        body = auto_reply(choice, body, echoed, answer)
    else:
        calls = choice.calls(echoed + answer)
        body["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
        body["finish_reason"] = "tool_calls"
    body["message"]["reasoning"] = reasoning
    return body


def _stream(parser: ReasoningParser, pieces: list[str], echoed: str = "", choice=AUTO):
    """completion_stream's sse loop for one choice -> (reasoning, content, calls as (name,
    arguments), finish_reason), with every chunk's delta checked to carry something."""
    splits = ReasoningSplits(parser)
    tools = AutoToolStream(choice) if choice.kind == "auto" else ToolStream(choice)
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    finish = None
    for i, piece in enumerate(pieces):
        last = "stop" if i == len(pieces) - 1 else None
        step = splits.feed(0, piece, last is not None)
        first = echoed if i == 0 else ""
        text = first + step.content
        body = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": last}
        sent = with_reasoning(tools.delta(0, body, first, step.content, last), body,
                              step.reasoning)  # fmt: skip
        if sent is None:
            continue
        delta = sent["delta"]
        assert delta or sent["finish_reason"], sent
        assert delta.get("content") != "", sent
        reasoning += delta.get("reasoning", "")
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            fn = entry["function"]
            if entry["index"] not in calls:
                calls[entry["index"]] = [fn["name"], ""]
            calls[entry["index"]][1] += fn["arguments"]
        finish = sent["finish_reason"] or finish
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get(
        "tool_calls") or []]  # fmt: skip


AUTO_REPLIES = [
    # thinking, then the call: the tool parser reads only the answer
    ("<think>I need the weather.</think>\n\n" + CALL, ("I need the weather.", None, [ARGS])),
    # a call written inside the thinking is reasoning, not a call
    ("<think>Maybe " + CALL + "? No.</think>\nIt is sunny.",
     ("Maybe " + CALL + "? No.", "It is sunny.", [])),
    ("<think>Hmm</think>Checking.\n" + CALL, ("Hmm", "Checking.", [ARGS])),
    ("It is sunny.", (None, "It is sunny.", [])),
    ("<think>cut before the call" , ("cut before the call", None, [])),
]  # fmt: skip


@pytest.mark.parametrize("reply, want", AUTO_REPLIES)
def test_auto_tool_calls_read_only_the_answer_whole_and_streamed(reply, want):
    """Guards the interplay with tool_choice auto: the hermes parser sees the answer only,
    so a block inside the thinking stays reasoning and a call after it is a call; a stream
    cut anywhere sends the whole reply's reasoning, content and calls, finish_reason
    tool_calls exactly when there are calls."""
    parser = make_parser("qwen3")
    whole = _whole(parser, reply)
    message = whole["message"]
    reasoning, content, args = want
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    assert _calls(message) == [("get_weather", a) for a in args]
    assert whole["finish_reason"] == ("tool_calls" if args else "stop")
    expected = (reasoning or "", content or "", _calls(message), whole["finish_reason"])
    for pieces in _cuts(reply, random.Random(3)):
        assert _stream(parser, pieces) == expected, pieces


def test_an_echoed_turn_is_content_and_not_parsed():
    """Guards echo with continue_final_message: the words the client began the turn with
    are content, in front, never read for `<think>` (as the tool parsers skip them)."""
    parser = make_parser("qwen3")
    began = "<think>I began "
    whole = _whole(parser, "this</think>\nParis.", echoed=began)["message"]
    assert (whole["reasoning"], whole["content"]) == (None, began + "this</think>\nParis.")
    got = _stream(parser, ["this</thi", "nk>\nParis."], echoed=began)
    assert got == ("", began + "this</think>\nParis.", [], "stop")


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_named_tool_choice_keeps_its_call_under_either_parser(name):
    """Guards tool_choice named with the flag on: the grammar holds the reply from its
    first token, so its JSON is the answer (deepseek_r1 would otherwise read a reply with
    no `</think>` as all reasoning) and comes back as the call, reasoning null, whole and
    streamed alike."""
    named = parse_tool_choice({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})  # fmt: skip
    parser = make_parser(name, constrained=True)
    whole = _whole(parser, ARGS, choice=named)
    assert whole["message"]["reasoning"] is None
    assert _calls(whole["message"]) == [("get_weather", ARGS)]
    want = ("", "", [("get_weather", ARGS)], "tool_calls")
    for pieces in _cuts(ARGS, random.Random(5)):
        assert _stream(parser, pieces, choice=named) == want, pieces


def test_seed_oss_reads_only_its_own_tags():
    """Guards the tags' parametrisation: Seed-OSS's parser leaves `<think>` blocks as
    answer text, and a prompt opens its block only with `<seed:think>`."""
    from pdserve.cluster.reasoning_api import request_parser

    reply = "<think>a</think>b"
    assert make_parser("seed_oss").parse(reply) == Reasoned(None, reply)
    assert make_parser("qwen3").parse(reply) == Reasoned("a", "b")
    params = SamplingParams()
    opened = request_parser("seed_oss", "chat", params, "<|im_start|>assistant\n<seed:think>")
    assert opened.parse("x</seed:think>y") == Reasoned("x", "y")
    other = request_parser("seed_oss", "chat", params, "assistant\n<think>")
    assert other.parse("x</seed:think>y") == Reasoned(None, "x</seed:think>y")


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_a_chat_request_carries_its_grammar_after_the_thinking_unless_told(in_reasoning):
    """Through the request parser itself (cluster/completion_request.py) with the bundled
    model's tokenizer: under deepseek_r1 a chat request's JSON mode goes to the workers
    wrapped to hold the answer after the thinking (the reply opens in it) and its parser
    reads the thinking, as on vLLM; with `enable_in_reasoning` the grammar holds the whole
    reply, which the parser reads as answer. Completions are never wrapped."""
    import asyncio

    from pdserve.cluster.completion_request import parse_body
    from pdserve.cluster.http_app import AppState
    from pdserve.cluster.metrics import Metrics
    from pdserve.cluster.openai_api import ApiError
    from pdserve.runner.model_source import resolve_model_dir
    from pdserve.runner.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model_dir(None)[0]))
    state = AppState(None, tokenizer, "m", 512, Metrics("m"), reasoning_parser="deepseek_r1",
                     grammar_in_reasoning=in_reasoning)  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "response_format": {"type": "json_object"}}  # fmt: skip
    (chat,) = asyncio.run(parse_body(state, body, "chat"))
    spec = chat.params.structured_outputs
    reply = "Hmm.</think>\n{}"
    if in_reasoning:
        assert spec == StructuredOutputs(json_object=True)
        assert chat.reasoning.parse("{}") == Reasoned(None, "{}")
    else:
        assert spec == StructuredOutputs(json_object=True, reasoning=("<think>", "</think>", True))
        assert compile_spec(spec).matches(reply.encode())
        assert chat.reasoning.parse(reply) == Reasoned("Hmm.", "{}")
    del body["messages"], body["response_format"]
    body["prompt"], body["structured_outputs"] = "Hi", {"json_object": True}
    (completion,) = asyncio.run(parse_body(state, body, "completion"))
    assert completion.params.structured_outputs == StructuredOutputs(json_object=True)
    with pytest.raises(ApiError, match="'reasoning' is not supported"):
        body["structured_outputs"] = {"json_object": True, "reasoning": ["<a>", "</a>", True]}
        asyncio.run(parse_body(state, body, "completion"))
