"""The later tool-call parsers (mistral, deepseek_v3, deepseek_v31, pythonic, seed_oss,
granite) on strings, through tests/test_tool_parsers.py's harness: each reply's reading
whole, the same reply streamed cut anywhere (and at random places drawn by hypothesis),
a long call read in linear work; then what each stream lets out early."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tool_parsers import (
    BRACKETS_ARGS,
    CASES,
    LONG_ARGS,
    OSLO,
    OSLO_CALL,
    SCHEMAS,
    TIME_CALL,
    TOOLS,
    TYPED_CALL,
    UNICODE_ARGS,
    _qwen,
    _streamed,
    _text,
    _xml_cases,
    check_linear_work,
    check_streams,
    check_whole_replies,
)

from pdserve.cluster.tool_parsers import PARSERS, make_parser
from pdserve.cluster.tool_parsers.base import Call, ParsedReply, StreamStep

OSLO_ARGS = {"city": "Oslo", "unit": "celsius"}
UNICODE_CALL = Call("get_weather", json.dumps(UNICODE_ARGS, ensure_ascii=False))
BRACKETS_CALL = Call("get_weather", json.dumps(BRACKETS_ARGS))


def _text_cases(*replies: str) -> dict:
    """Replies that are text, whole."""
    return {reply: (reply, ()) for reply in replies}


# mistral: v11 on, `[TOOL_CALLS]NAME[ARGS]{...}`; before v11, `[TOOL_CALLS] [{...}, ...]`
def _mistral(name: str, arguments: object) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{_text(arguments)}"


def _mistral_array(*calls: tuple[str, object]) -> str:
    items = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return "[TOOL_CALLS] " + json.dumps(items, ensure_ascii=False)


M_OSLO, M_TIME = _mistral("get_weather", OSLO_ARGS), _mistral("get_time", {})
M_DATE = _mistral("get_date", {"day": 1})  # a tool the request lacks
MISTRAL = (
    {
        M_OSLO: (None, (OSLO_CALL,)),
        M_OSLO + M_TIME: (None, (OSLO_CALL, TIME_CALL)),
        "Let me check.\n\n" + M_OSLO + M_TIME: ("Let me check.", (OSLO_CALL, TIME_CALL)),
        "[TOOL_CALLS]get_time{}": (None, (TIME_CALL,)),  # the name then `{`, as vLLM takes too
        _mistral("get_weather", UNICODE_ARGS): (None, (UNICODE_CALL,)),
        _mistral("get_weather", BRACKETS_ARGS): (None, (BRACKETS_CALL,)),
        _mistral_array(("get_weather", OSLO_ARGS), ("get_time", {})): (
            None,
            (OSLO_CALL, TIME_CALL),
        ),
        "Sure." + _mistral_array(("get_time", {})): ("Sure.", (TIME_CALL,)),
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]\n': (None, (TIME_CALL,)),
        # a usable call beside one that is not; text after the calls (a special token too)
        M_DATE + M_TIME: (M_DATE, (TIME_CALL,)),
        M_OSLO + "\nDone.": ("\nDone.", (OSLO_CALL,)),
        M_OSLO + "</s>": ("</s>", (OSLO_CALL,)),
        "[TOOL_CALLS]get_weather[TOOL_CALLS]get_time[ARGS]{}": (
            "[TOOL_CALLS]get_weather",
            (TIME_CALL,),
        ),
        "[TOOL_CALLS] \n" + M_TIME: ("[TOOL_CALLS]", (TIME_CALL,)),
        M_TIME + "{": ("{", (TIME_CALL,)),  # JSON opening after a call is text
    }
    | _text_cases(
        "The weather in Oslo is mild.",
        "Hi [/INST] there, [b] and [TOOL]",  # other special tokens stay as written
        M_DATE,
        "Checking. " + M_DATE,
        _mistral("get_weather", "Oslo"),  # arguments: an object
        _mistral("get_weather", [1]),
        M_OSLO[:-1],  # cut short (max_tokens)
        "[TOOL_CALLS]get_weather",  # no arguments
        "[TOOL_CALLS]get_weather[ARGS]",
        "[TOOL_CALLS]get_weather[AR",
        "[TOOL_CALLS]get_weather [ARGS]{}",
        "[TOOL_CALLS]get_weather[ARGS] {}",
        "[TOOL_CALLS]get_weatherly[ARGS]{}",
        '[TOOL_CALLS]{"city": "Oslo"}',  # no name
        "[TOOL_CALLS]",
        "I will call [TOOL_",
        _mistral_array(("get_weather", OSLO_ARGS), ("get_date", {})),  # an array: all, or text
        _mistral_array(("get_weather", "Oslo")),
        '[TOOL_CALLS] [{"name": "get_time"}]',  # vLLM takes missing arguments as {}
        "[TOOL_CALLS] []",
        '[TOOL_CALLS] {"name": "get_time", "arguments": {}}',
        "  \n",
        "",
    )
)


# deepseek_v3 and deepseek_v31: a section of calls between DeepSeek's markers
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def _ds3_call(name: str, arguments: object) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{_text(arguments)}\n```"
        "<｜tool▁call▁end｜>"
    )


def _ds31_call(name: str, arguments: object) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{_text(arguments)}<｜tool▁call▁end｜>"


def _deepseek_cases(call) -> dict:
    """The cases of a DeepSeek parser, `call` writing one call of its section."""
    oslo, time_ = call("get_weather", OSLO_ARGS), call("get_time", {})
    date = call("get_date", {"day": 1})
    return (
        {
            BEGIN + oslo + END: (None, (OSLO_CALL,)),
            BEGIN + oslo + time_ + END: (None, (OSLO_CALL, TIME_CALL)),
            BEGIN + oslo + "\n" + time_ + "\n" + END: (None, (OSLO_CALL, TIME_CALL)),
            "Let me check.\n\n" + BEGIN + oslo + END: ("Let me check.", (OSLO_CALL,)),
            BEGIN + call("get_weather", UNICODE_ARGS) + END: (None, (UNICODE_CALL,)),
            BEGIN + call("get_weather", BRACKETS_ARGS) + END: (None, (BRACKETS_CALL,)),
            BEGIN + oslo: (None, (OSLO_CALL,)),  # the reply ended at the calls
            BEGIN + oslo + END + "\nDone.": ("\nDone.", (OSLO_CALL,)),
            BEGIN + date + END + BEGIN + time_ + END: (BEGIN + date + END, (TIME_CALL,)),
        }
        | _text_cases(
            "The weather in Oslo is mild.",
            BEGIN + date + END,
            "Checking. " + BEGIN + date + END,
            BEGIN + oslo + date + END,  # a section: all of it calls, or text
            BEGIN + call("get_weather", "Oslo") + END,
            BEGIN + call("get_weather", {"city": "Oslo"})[:-30] + END,
            BEGIN + oslo + "and " + time_ + END,
            BEGIN + END,
            BEGIN + oslo[:40],  # cut short (max_tokens)
            BEGIN + "\n" + OSLO + "\n" + END,  # hermes's block
            "I will call <｜tool▁calls",
            "  \n",
            "",
        )
    )


DEEPSEEK_V3 = _deepseek_cases(_ds3_call) | _text_cases(
    BEGIN + _ds31_call("get_weather", OSLO_ARGS) + END,  # the other version's syntax
    BEGIN + _ds3_call("get_time", {}).replace("function", "tool") + END,
)
DEEPSEEK_V3[  # whitespace around the fence
    BEGIN
    + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n\n```json {}```\n<｜tool▁call▁end｜>"
    + END
] = (None, (TIME_CALL,))
DEEPSEEK_V31 = _deepseek_cases(_ds31_call) | _text_cases(
    BEGIN + _ds3_call("get_weather", OSLO_ARGS) + END,
)
DEEPSEEK_V31[
    BEGIN + "<｜tool▁call▁begin｜> get_time <｜tool▁sep｜>\n{}\n<｜tool▁call▁end｜>" + END
] = (
    None,
    (TIME_CALL,),
)


# pythonic: the reply is a Python list of calls
P_OSLO = '[get_weather(city="Oslo", unit="celsius")]'
P_TWO = "[get_weather(city='Oslo', unit='celsius'), get_time()]"
PYTHONIC = {
    P_OSLO: (None, (OSLO_CALL,)),
    P_TWO: (None, (OSLO_CALL, TIME_CALL)),
    " \n" + P_TWO + "\n": (None, (OSLO_CALL, TIME_CALL)),
    '[ get_weather (\n  city="Oslo",\n  unit="celsius",\n) ,get_time( ) , ]': (
        None,
        (OSLO_CALL, TIME_CALL),
    ),
    "[get_weather(city='Zürich', note='晴れ ☀ \"quoted\"\\n')]": (None, (UNICODE_CALL,)),
    "[get_weather(city='Oslo', days=3, options={'hourly': [1, 2]}, zip='0150')]": (
        None,
        (TYPED_CALL,),
    ),
    "[get_time(a=-1.5, b=(1, 'x'), c=True, d=None, e=0x10)]": (
        None,
        (Call("get_time", '{"a": -1.5, "b": [1, "x"], "c": true, "d": null, "e": 16}'),),
    ),
    # brackets and quotes inside strings, triple-quoted strings, escapes
    "[get_weather(city=']) ([{', note=\"it's \\\" ]\")]": (
        None,
        (Call("get_weather", json.dumps({"city": "]) ([{", "note": "it's \" ]"})),),
    ),
    "[get_weather(note='''it's \"x\"''', city=\"\"\"a''b\"\"\", unit='')]": (
        None,
        (Call("get_weather", json.dumps({"note": 'it\'s "x"', "city": "a''b", "unit": ""})),),
    ),
} | _text_cases(
    "The weather in Oslo is mild.",
    "Sure: " + P_OSLO,  # the list is all of the reply
    P_OSLO + " Done.",
    P_OSLO + "; [get_time()]",
    "[get_date(day=1)]",  # a tool the request lacks
    "[get_weather(city='Oslo'), get_date()]",  # all or nothing
    "[get_weather('Oslo')]",  # positional
    "[get_weather(**options)]",
    "[get_time(a=1, a=2)]",
    "[get_weather(city=oslo)]",  # a name, not a literal
    "[get_weather(city=lookup())]",
    "[get_time(a=1 + 1)]",
    "[get_time(a={1, 2})]",  # no JSON form
    "[get_time(a=b'x')]",
    "[get_time(a=1e999)]",
    "[get_time(a=f'x')]",
    "[get_time]",
    "[get_time(), 1]",
    "[]",
    "[1] is the first note",
    "[Note: it's sunny]",
    "get_time()",
    "[get_time()",  # cut short
    "[get_weather(city='Oslo",
    "[get_time() # a comment ]\n]",
    "[get_time(a=" + "[" * 300 + "]" * 300 + ")]",  # past the parser's nesting limit
    "[get_time(a='\\')]",
    "[" * 100_000,
    "  \n",
    "",
)


# seed_oss: qwen3_coder's calls in <seed:tool_call> blocks, after Seed's thinking
def _seed(name: str, arguments: dict) -> str:
    return _qwen(name, arguments).replace("tool_call>", "seed:tool_call>")


S_OSLO, S_TIME = _seed("get_weather", OSLO_ARGS), _seed("get_time", {})
THOUGHT = "<seed:think>I could call " + S_TIME + " first.</seed:think>"
SEED_OSS = (
    _xml_cases(_seed, UNICODE_ARGS, "</seed:tool_call>")
    | {
        THOUGHT + "\n" + S_OSLO: (THOUGHT, (OSLO_CALL,)),
        " \n" + THOUGHT + "Let me check.\n" + S_OSLO: (
            " \n" + THOUGHT + "Let me check.",
            (OSLO_CALL,),
        ),
        "<seed:think></seed:think>" + S_TIME: ("<seed:think></seed:think>", (TIME_CALL,)),
        # thinking opens the reply, or is not thinking
        "Hi " + S_TIME + " <seed:think>" + S_OSLO + "</seed:think>": (
            "Hi  <seed:think></seed:think>",
            (TIME_CALL, OSLO_CALL),
        ),
    }
    | _text_cases(
        THOUGHT,
        THOUGHT + "The weather is mild.",
        "<seed:think>I could call " + S_TIME,  # thinking never closed: all content
        "<seed:th",
        "I will call <seed:tool_c",
        _qwen("get_weather", OSLO_ARGS),  # qwen3_coder's tags
    )
)


# granite: the reply is `<|tool_call|>` and a JSON array of calls
def _granite_array(*calls: tuple[str, object]) -> str:
    items = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return json.dumps(items, ensure_ascii=False)


G_OSLO = "<|tool_call|>" + _granite_array(("get_weather", OSLO_ARGS))
G_TWO = "<|tool_call|>" + _granite_array(("get_weather", OSLO_ARGS), ("get_time", {}))
GRANITE = (
    {
        G_OSLO: (None, (OSLO_CALL,)),
        G_TWO: (None, (OSLO_CALL, TIME_CALL)),
        _granite_array(("get_time", {})): (None, (TIME_CALL,)),  # the marker skipped as special
        "<tool_call>" + _granite_array(("get_time", {})): (None, (TIME_CALL,)),  # Granite 3.1
        " <|tool_call|>\n<tool_call> " + _granite_array(("get_time", {})) + "\n": (
            None,
            (TIME_CALL,),
        ),
        "<|tool_call|>" + _granite_array(("get_weather", UNICODE_ARGS)): (None, (UNICODE_CALL,)),
        _granite_array(("get_weather", BRACKETS_ARGS)): (None, (BRACKETS_CALL,)),
    }
    | _text_cases(
        "The weather in Oslo is mild.",
        "Sure: " + G_OSLO,
        G_OSLO + " Done.",
        "<|tool_call|>" + _granite_array(("get_date", {})),
        "<|tool_call|>" + _granite_array(("get_weather", OSLO_ARGS), ("get_date", {})),
        "<|tool_call|>" + _granite_array(("get_weather", "Oslo")),
        '<|tool_call|>[{"name": "get_time"}]',
        '<|tool_call|>{"name": "get_time", "arguments": {}}',  # an object, not an array
        "<|tool_call|>[]",
        G_OSLO[:-1],  # cut short
        "[1, 2] are the notes",
        "<tool_call><|tool_call|>" + _granite_array(("get_time", {})),  # the markers' order
        "<|tool_call|>",
        "<|tool_",
        "[" * 100_000,
        "  \n",
        "",
    )
)

MORE_CASES = {
    "mistral": MISTRAL, "deepseek_v3": DEEPSEEK_V3, "deepseek_v31": DEEPSEEK_V31,
    "pythonic": PYTHONIC, "seed_oss": SEED_OSS, "granite": GRANITE,
}  # fmt: skip


def test_every_parser_has_cases():
    """Guards the registry against a parser added without its cases, here or in
    tests/test_tool_parsers.py."""
    assert set(PARSERS) == set(CASES) | set(MORE_CASES)
    assert not set(CASES) & set(MORE_CASES)


@pytest.mark.parametrize("name", sorted(MORE_CASES))
def test_a_whole_reply_reads_into_content_and_calls(name):
    """Guards each parser's reading: content only, one call, several, content before and
    after calls, unknown names, malformed and cut-short arguments returned as text (a
    reply without a usable call whole), unicode arguments kept as written."""
    check_whole_replies(name, MORE_CASES[name])


@pytest.mark.parametrize("name", sorted(MORE_CASES))
def test_a_stream_cut_anywhere_equals_the_whole_reply(name):
    """Guards streaming against chunk boundaries: a tag, a name, `[ARGS]`, a quote or an
    escape split across pieces; what a stream lets out, joined, is the whole reading."""
    check_streams(name, MORE_CASES[name])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_stream_cut_at_random_equals_the_whole_reply(data):
    """Guards the same promise with cuts hypothesis draws (and shrinks to the fewest when
    one breaks it), several to a reply."""
    name = data.draw(st.sampled_from(sorted(MORE_CASES)))
    reply = data.draw(st.sampled_from([r for r in MORE_CASES[name] if len(r) <= 1000]))
    points = sorted(data.draw(st.sets(st.integers(0, len(reply)), max_size=12)))
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)])]
    parser = make_parser(name, SCHEMAS)
    whole = parser.parse(reply)
    assert _streamed(parser, pieces) == (whole.content or "", whole.calls)


LONG = {
    "mistral": "Let me check.\n" + _mistral("get_weather", LONG_ARGS) + M_TIME,
    "deepseek_v3": "Let me check.\n"
    + BEGIN
    + _ds3_call("get_weather", LONG_ARGS)
    + _ds3_call("get_time", {})
    + END,
    "deepseek_v31": "Let me check.\n"
    + BEGIN
    + _ds31_call("get_weather", LONG_ARGS)
    + _ds31_call("get_time", {})
    + END,
    "pythonic": f"[get_weather(city='Oslo', note={LONG_ARGS['note']!r}), get_time()]",
    "seed_oss": "<seed:think>Let me check.</seed:think>\n"
    + _seed("get_weather", LONG_ARGS)
    + _seed("get_time", {}),
    "granite": "<|tool_call|>" + _granite_array(("get_weather", LONG_ARGS), ("get_time", {})),
}


@pytest.mark.parametrize("name", sorted(MORE_CASES))
def test_a_long_call_streamed_in_small_pieces_is_read_in_linear_work(name):
    """Guards the streams against quadratic work: a 200,000-character call fed 1-7
    characters a time (what test_tool_parsers.py's twin of this test measures)."""
    check_linear_work(name, LONG[name])


def test_only_mistral_and_openai_read_special_tokens():
    """Guards the detokenization of auto tool requests: `[TOOL_CALLS]` is a special token,
    so mistral's requests keep special tokens in their text (as vLLM's do), and no parser
    of tokens that reach the text anyway turns that on."""
    assert {n for n, p in PARSERS.items() if p.needs_special_tokens} == {"mistral", "openai"}


def _feeds(name: str, pieces: list[str]) -> list[StreamStep]:
    stream = make_parser(name, TOOLS).stream()
    return [stream.feed(piece) for piece in pieces] + [stream.finish()]


def test_mistral_lets_text_out_as_it_comes_and_holds_only_a_possible_call():
    """Guards the mistral stream's latency: text goes out at once but for a possible
    `[TOOL_CALLS]`; a call goes out the moment its JSON closes; a name no tool's begins
    with goes out as text at once, and so does an unknown name at its `[ARGS]`."""
    head = "[TOOL_CALLS]get_weather[ARGS]"
    arguments = M_OSLO[len(head) : -1]
    steps = _feeds(
        "mistral", ["It is [b] sunny. [TOOL_", head[6:], arguments, "}", "\n[TOOL_CALLS]x"]
    )
    assert steps == [
        StreamStep("It is [b] sunny."),
        StreamStep(),
        StreamStep(),
        StreamStep("", [OSLO_CALL]),
        StreamStep(" \n[TOOL_CALLS]x"),  # the whitespace held before the call, then text
        StreamStep(),
    ]
    steps = _feeds("mistral", ["[TOOL_CALLS]get_date"])
    assert steps == [StreamStep("[TOOL_CALLS]get_date"), StreamStep()]
    steps = _feeds("mistral", ["[TOOL_CALLS]get_weath", "[ARGS]{", "}"])
    assert steps == [StreamStep(), StreamStep("[TOOL_CALLS]get_weath[ARGS]{"), StreamStep("}")] + [
        StreamStep()
    ]


def test_mistral_holds_a_call_whose_json_is_cut_then_lets_it_out_as_text():
    """Guards a call cut by max_tokens: held while its JSON may still close, text at the end."""
    steps = _feeds("mistral", ["Sure. ", M_OSLO[:-1]])
    assert steps == [StreamStep("Sure."), StreamStep(), StreamStep(" " + M_OSLO[:-1])]


# reply -> how much of it must have come for it to be text for sure
TEXT_AT = {
    "pythonic": {
        "[1] is the first note": len("[1"),
        "[Note: it's sunny]": len("[N"),
        "[get_date(day=1)]": len("[get_d"),
        "[get_weatherly(x=1)]": len("[get_weatherl"),
        "[get_time(), get_date()] ok": len("[get_time(), get_date()]"),
        "[get_time()] and more": len("[get_time()] a"),
        "Sure: [get_time()]": 1,
    },
    "granite": {
        "Sure: " + G_OSLO: 1,
        "<|tool_call|> Sure": len("<|tool_call|> S"),
        "<|tool_call|>" + _granite_array(("get_date", {})) + " more": len(
            "<|tool_call|>" + _granite_array(("get_date", {}))
        ),
        G_OSLO + " Done.": len(G_OSLO) + 2,
    },
}


@pytest.mark.parametrize("name", sorted(TEXT_AT))
def test_a_whole_reply_goes_out_as_text_once_it_cannot_be_calls(name):
    """Guards the whole-reply streams' latency (pythonic, granite): a reply that opens like
    calls goes out as text the moment it cannot be calls (a name no tool's begins with, a
    list that closes and is not calls, text after it), then as it comes; before that
    moment nothing of it goes out."""
    parser = make_parser(name, TOOLS)
    for reply, text_at in TEXT_AT[name].items():
        assert parser.parse(reply) == ParsedReply(reply, ())
        for cut in range(len(reply) + 1):
            stream = parser.stream()
            got = stream.feed(reply[:cut])
            assert got == StreamStep(reply[:cut] if cut >= text_at else ""), (reply, cut)
            assert got.content + stream.feed(reply[cut:]).content == reply
            assert stream.finish() == StreamStep()


def test_a_whole_reply_holds_its_calls_to_the_end():
    """Guards the all-or-nothing rule in a stream: a list of calls, closed, is not sent
    before the reply ends, since text after it would make the whole reply text."""
    for name, reply in (("pythonic", P_TWO), ("granite", G_TWO)):
        for cut in range(len(reply) + 1):
            steps = _feeds(name, [reply[:cut], reply[cut:]])
            assert steps == [StreamStep(), StreamStep(), StreamStep("", [OSLO_CALL, TIME_CALL])]


def test_seed_oss_lets_thinking_out_as_it_comes():
    """Guards the seed_oss stream: thinking is content at once (a call drafted in it never
    held or read); after `</seed:think>` blocks are held and read as qwen3_coder's."""
    steps = _feeds(
        "seed_oss",
        [
            " <seed:",
            "think>I could call " + S_TIME[:30],
            S_TIME[30:] + "</seed:",
            "think>\n" + S_OSLO,
        ],
    )
    assert steps == [
        StreamStep(),
        StreamStep(" <seed:think>I could call " + S_TIME[:30]),
        StreamStep(S_TIME[30:] + "</seed:"),
        StreamStep("think>", [OSLO_CALL]),
        StreamStep(),
    ]


def test_deepseek_holds_a_section_until_it_closes():
    """Guards the deepseek streams: text before the calls goes out at once, the section is
    held while it is open and its calls go out together when it closes."""
    section = BEGIN + _ds31_call("get_weather", OSLO_ARGS) + _ds31_call("get_time", {}) + END
    steps = _feeds("deepseek_v31", ["Let me check. <｜tool▁", section[7:-3], section[-3:]])
    assert steps == [
        StreamStep("Let me check."),
        StreamStep(),
        StreamStep("", [OSLO_CALL, TIME_CALL]),
        StreamStep(),
    ]
