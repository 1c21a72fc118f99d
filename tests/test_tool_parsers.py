"""The tool-call parsers of `tool_choice: "auto"` (cluster/tool_parsers/) on strings: what
each reads as calls and what as content, and that a stream of the same reply, cut
anywhere, lets out exactly that. The HTTP path is in tests/test_serve_e2e.py."""

from __future__ import annotations

import json
import random
import tracemalloc

import pytest

from pdserve.cluster.tool_parsers import PARSERS, make_parser
from pdserve.cluster.tool_parsers.base import Call, ParsedReply, StreamStep, ToolParser

TOOLS = ("get_weather", "get_time")


def _block(name: str, arguments: object) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


OSLO = _block("get_weather", {"city": "Oslo", "unit": "celsius"})
TIME = _block("get_time", {})
OSLO_CALL = Call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
TIME_CALL = Call("get_time", "{}")
BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>'
UNKNOWN = _block("get_date", {"day": 1})
UNICODE_ARGS = {"city": "Zürich", "note": '晴れ ☀ "quoted"\n'}
# Blocks left open at the end of the reply (the model stopped right after the JSON)
OPEN_OSLO = OSLO.removesuffix("\n</tool_call>")
OPEN_TIME = '<tool_call>{"name": "get_time", "arguments": {}}'
OPEN_UNKNOWN = UNKNOWN.removesuffix("\n</tool_call>")

# reply -> (content, calls), as the hermes parser reads it
HERMES = {
    "The weather in Oslo is mild.": ("The weather in Oslo is mild.", ()),
    OSLO: (None, (OSLO_CALL,)),
    OSLO + "\n" + TIME: (None, (OSLO_CALL, TIME_CALL)),
    "Let me check.\n\n" + OSLO + "\n" + TIME + "\n": ("Let me check.", (OSLO_CALL, TIME_CALL)),
    "\n " + OSLO: (None, (OSLO_CALL,)),  # whitespace-only content is null
    BAD_JSON: (BAD_JSON, ()),  # the reply as plain text
    UNKNOWN: (UNKNOWN, ()),
    "Checking. " + UNKNOWN: ("Checking. " + UNKNOWN, ()),
    # A call the client can use is a call; the malformed block beside it stays text.
    OSLO + "\n" + BAD_JSON: ("\n" + BAD_JSON, (OSLO_CALL,)),
    OSLO + "\nDone, ask again.": ("\nDone, ask again.", (OSLO_CALL,)),
    _block("get_weather", "Oslo"): (_block("get_weather", "Oslo"), ()),  # arguments: an object
    _block("get_weather", UNICODE_ARGS): (
        None,
        (Call("get_weather", json.dumps(UNICODE_ARGS, ensure_ascii=False)),),
    ),
    "I will call <tool_c": ("I will call <tool_c", ()),  # a tag's beginning, cut at the end
    "I will call <tool_call>": ("I will call <tool_call>", ()),
    "Cut: " + OSLO[:40]: ("Cut: " + OSLO[:40], ()),  # an open block (max_tokens)
    "a < b, <b>bold</b> and </tool_call>": ("a < b, <b>bold</b> and </tool_call>", ()),
    "<tool_call><tool_call>" + OSLO[11:]: ("<tool_call><tool_call>" + OSLO[11:], ()),
    "<tool_call></tool_call>" + TIME: ("<tool_call></tool_call>", (TIME_CALL,)),
    "  \n": ("  \n", ()),
    "": ("", ()),
    # A block left open at the end is a call when what follows `<tool_call>` is one.
    OPEN_OSLO: (None, (OSLO_CALL,)),
    OPEN_TIME: (None, (TIME_CALL,)),
    OPEN_OSLO + "\n\n": (None, (OSLO_CALL,)),
    "Let me check.\n\n" + OPEN_OSLO: ("Let me check.", (OSLO_CALL,)),
    OSLO + "\n" + OPEN_TIME: (None, (OSLO_CALL, TIME_CALL)),
    BAD_JSON + "\n" + OPEN_OSLO: (BAD_JSON, (OSLO_CALL,)),
    "Checking. " + OPEN_UNKNOWN: ("Checking. " + OPEN_UNKNOWN, ()),
    OPEN_OSLO + "\n</tool_": (OPEN_OSLO + "\n</tool_", ()),  # a piece of the close: not JSON
    OPEN_OSLO + " Done.": (OPEN_OSLO + " Done.", ()),
    OSLO + "\nDone. " + OPEN_UNKNOWN: ("\nDone. " + OPEN_UNKNOWN, (OSLO_CALL,)),
    '<tool_call>{"name": "get_weather", "arguments": "Oslo"}': (
        '<tool_call>{"name": "get_weather", "arguments": "Oslo"}',
        (),
    ),
    "<tool_call>" + OPEN_OSLO: ("<tool_call>" + OPEN_OSLO, ()),  # it opens at the first tag
}

# reply -> (content, calls), as the llama3_json parser reads it
LLAMA_OSLO = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
LLAMA_TIME = '{"name": "get_time", "parameters": {}}'
LLAMA_DATE = '{"name": "get_date", "parameters": {}}'  # a tool the request lacks
BRACKETS_ARGS = {"city": '}{][ "Oslo" \\', "list": [{"a": [1, "]"]}]}
LLAMA_BRACKETS = json.dumps({"name": "get_weather", "parameters": BRACKETS_ARGS})
DEEP = '{"name": "get_time", "parameters": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}"
LLAMA3 = {
    "The weather in Oslo is mild.": ("The weather in Oslo is mild.", ()),
    LLAMA_OSLO: (None, (OSLO_CALL,)),
    "<|python_tag|>" + LLAMA_OSLO: (None, (OSLO_CALL,)),
    " \n" + LLAMA_OSLO + "\n": (None, (OSLO_CALL,)),
    LLAMA_OSLO + "; " + LLAMA_TIME: (None, (OSLO_CALL, TIME_CALL)),
    '{"name": "get_time", "arguments": {}}': (None, (TIME_CALL,)),  # vLLM takes both keys
    LLAMA_OSLO[:-1]: (LLAMA_OSLO[:-1], ()),  # cut short
    LLAMA_DATE: (LLAMA_DATE, ()),
    LLAMA_OSLO + "; " + LLAMA_TIME[:-2]: (LLAMA_OSLO + "; " + LLAMA_TIME[:-2], ()),  # all or none
    '{"answer": 42}': ('{"answer": 42}', ()),
    LLAMA_OSLO + " and then": (LLAMA_OSLO + " and then", ()),
    "Sure: " + LLAMA_OSLO: ("Sure: " + LLAMA_OSLO, ()),  # calls only open a reply
    '{"name": "get_weather", "parameters": {"city": "Zürich", "note": "晴れ ☀ \\"quoted\\"\\n"}}': (
        None,
        (Call("get_weather", json.dumps(UNICODE_ARGS, ensure_ascii=False)),),
    ),
    "<|python": ("<|python", ()),
    "<|python_tag|>print(1)": ("<|python_tag|>print(1)", ()),
    "[" * 100_000: ("[" * 100_000, ()),  # past the JSON decoder's recursion limit
    " \n": (" \n", ()),
    "": ("", ()),
    # Where the stream reads an object's end: brackets, quotes and escapes inside strings
    LLAMA_BRACKETS: (None, (Call("get_weather", json.dumps(BRACKETS_ARGS)),)),
    LLAMA_OSLO + ";" + LLAMA_TIME + "\n": (None, (OSLO_CALL, TIME_CALL)),
    LLAMA_OSLO + "\u00a0;\u2003" + LLAMA_TIME: (None, (OSLO_CALL, TIME_CALL)),  # unicode spaces
    "<|python_tag|> " + LLAMA_OSLO + "; " + LLAMA_TIME: (None, (OSLO_CALL, TIME_CALL)),
    # JSON keeps a key's last value: the first "name" does not decide
    '{"name": "get_date", "name": "get_time", "parameters": {}}': (None, (TIME_CALL,)),
    LLAMA_OSLO + ";": (LLAMA_OSLO + ";", ()),  # a `;` promises another call
    LLAMA_OSLO + "; [1]": (LLAMA_OSLO + "; [1]", ()),
    LLAMA_DATE + "; " + LLAMA_TIME: (LLAMA_DATE + "; " + LLAMA_TIME, ()),
    '{"a" 1} ' + LLAMA_TIME: ('{"a" 1} ' + LLAMA_TIME, ()),  # closed, not JSON
    '{"name": "get_time", "parameters": {]}}': ('{"name": "get_time", "parameters": {]}}', ()),
    "<|python_tag|>": ("<|python_tag|>", ()),
    "{" * 100_000: ("{" * 100_000, ()),  # never closed
    DEEP: (DEEP, ()),  # closed, past the decoder's recursion limit
}


# The XML-style parsers type arguments by the tools' schemas (`typed_argument`).
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"}, "unit": {"type": "string"}, "note": {"type": "string"},
            "days": {"type": "integer"}, "options": {"type": ["object", "null"]},
            "zip": {"type": "string"},
        },
    },
    "get_time": {"type": "object", "properties": {}},
}  # fmt: skip


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _qwen(name: str, arguments: dict) -> str:
    params = "".join(f"<parameter={k}>\n{_text(v)}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm(name: str, arguments: dict) -> str:
    args = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{_text(v)}</arg_value>\n" for k, v in arguments.items()
    )
    return f"<tool_call>{name}\n{args}</tool_call>"


TYPED_ARGS = {"city": "Oslo", "days": 3, "options": {"hourly": [1, 2]}, "zip": "0150"}
TYPED_CALL = Call("get_weather", json.dumps(TYPED_ARGS))
# A value that does not read as its type stays text: the argument is not lost.
LOOSE_CALL = Call("get_weather", '{"days": "three"}')
GLM_UNICODE = {"city": "Zürich", "note": '晴れ ☀ "quoted"'}  # glm45 strips values' ends


def _xml_cases(block, unicode_args: dict, close: str = "</tool_call>") -> dict:
    """The cases of the XML-style parsers, `block` writing a call and `close` its end."""
    oslo, time_ = block("get_weather", {"city": "Oslo", "unit": "celsius"}), block("get_time", {})
    unknown = block("get_date", {"day": "1"})
    open_oslo = oslo.removesuffix(close)
    return {
        "The weather in Oslo is mild.": ("The weather in Oslo is mild.", ()),
        oslo: (None, (OSLO_CALL,)),
        oslo + "\n" + time_: (None, (OSLO_CALL, TIME_CALL)),
        "Let me check.\n\n" + oslo + "\n" + time_ + "\n": ("Let me check.", (OSLO_CALL, TIME_CALL)),
        block("get_weather", TYPED_ARGS): (None, (TYPED_CALL,)),
        block("get_weather", {"days": "three"}): (None, (LOOSE_CALL,)),
        block("get_weather", unicode_args): (
            None,
            (Call("get_weather", json.dumps(unicode_args, ensure_ascii=False)),),
        ),
        unknown: (unknown, ()),
        "Checking. " + unknown: ("Checking. " + unknown, ()),
        oslo + "\nDone, ask again.": ("\nDone, ask again.", (OSLO_CALL,)),
        # a block holding anything else is text, and a usable call beside it still a call
        "<tool_call>\nget the weather\n</tool_call>": (
            "<tool_call>\nget the weather\n</tool_call>",
            (),
        ),
        oslo + "\n" + HERMES_OSLO_BLOCK: ("\n" + HERMES_OSLO_BLOCK, (OSLO_CALL,)),
        open_oslo: (None, (OSLO_CALL,)),  # left open at the end of the reply
        "Cut: " + oslo[:30]: ("Cut: " + oslo[:30], ()),
        "I will call <tool_c": ("I will call <tool_c", ()),
        "  \n": ("  \n", ()),
        "": ("", ()),
    }


HERMES_OSLO_BLOCK = OSLO  # the JSON syntax, which the XML-style parsers do not read
QWEN3_CODER = _xml_cases(_qwen, UNICODE_ARGS) | {
    # parameters must be whole: a function without its close, or text between parameters
    "<tool_call>\n<function=get_time>\n</tool_call>": (
        "<tool_call>\n<function=get_time>\n</tool_call>",
        (),
    ),
    "<tool_call><function=get_time>now</function></tool_call>": (
        "<tool_call><function=get_time>now</function></tool_call>",
        (),
    ),
}
GLM45 = _xml_cases(_glm, GLM_UNICODE) | {
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>": (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>",
        (),
    ),
}


def _harmony(name: str, arguments: object) -> str:
    """A call as --reasoning-parser openai_gptoss hands it on (cluster/reasoning/gpt_oss.py)."""
    return f"<|channel|>commentary to=functions.{name}<|message|>{_text(arguments)}<|call|>"


H_OSLO = _harmony("get_weather", {"city": "Oslo", "unit": "celsius"})
H_TIME = _harmony("get_time", {})
# reply -> (content, calls), as the openai (harmony) parser reads it
HARMONY = {
    "The weather in Oslo is mild.": ("The weather in Oslo is mild.", ()),
    H_OSLO: (None, (OSLO_CALL,)),
    H_OSLO + H_TIME: (None, (OSLO_CALL, TIME_CALL)),
    "Let me check." + H_OSLO: ("Let me check.", (OSLO_CALL,)),
    _harmony("get_weather", UNICODE_ARGS): (
        None,
        (Call("get_weather", json.dumps(UNICODE_ARGS, ensure_ascii=False)),),
    ),
    _harmony("get_date", {"day": 1}): (_harmony("get_date", {"day": 1}), ()),  # not a tool
    _harmony("get_weather", "Oslo"): (_harmony("get_weather", "Oslo"), ()),  # not an object
    "<|channel|>commentary to=browser.search<|message|>{}<|call|>": (
        "<|channel|>commentary to=browser.search<|message|>{}<|call|>",  # a built-in tool
        (),
    ),
    H_OSLO.removesuffix("<|call|>"): (None, (OSLO_CALL,)),  # the reply ended at the call
    "Cut: " + H_OSLO[:50]: ("Cut: " + H_OSLO[:50], ()),
    "I will call <|chan": ("I will call <|chan", ()),
    "": ("", ()),
}
CASES = {
    "hermes": HERMES, "llama3_json": LLAMA3, "qwen3_coder": QWEN3_CODER, "glm45": GLM45,
    "openai": HARMONY,
}  # fmt: skip


def test_every_parser_has_cases():
    """Guards the registry against a parser added without its cases here (or in
    tests/test_tool_parsers_more.py, the later parsers')."""
    from test_tool_parsers_more import MORE_CASES

    assert set(PARSERS) == set(CASES) | set(MORE_CASES)


def check_whole_replies(name: str, cases: dict) -> None:
    """Each reply of `cases` (reply -> (content, calls)) read whole by parser `name`."""
    parser = make_parser(name, SCHEMAS)
    for reply, (content, calls) in cases.items():
        got = parser.parse(reply)
        assert got == ParsedReply(content, calls), reply[:200]
        for call in got.calls:
            assert isinstance(json.loads(call.arguments), dict)
    unicode_reply = next(r for r, (_, calls) in cases.items() if calls and "Z\u00fcrich" in r)
    assert "Zürich" in parser.parse(unicode_reply).calls[0].arguments


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_whole_reply_reads_into_content_and_calls(name):
    """Guards each parser's reading: content only, one call, two calls, content before
    calls, malformed JSON and unknown names returned as text, unicode arguments kept as
    written (ensure_ascii off), a call's start cut at the end left as text."""
    check_whole_replies(name, CASES[name])


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, tuple[Call, ...]]:
    stream = parser.stream()
    content, calls = "", []
    for piece in pieces:
        step = stream.feed(piece)
        content += step.content
        calls += step.calls
    step = stream.finish()
    return content + step.content, tuple(calls + step.calls)


def _cuts(reply: str, rng: random.Random):
    """The reply in pieces: cut once at every position, into single characters, and at
    random places (seeded)."""
    for i in range(len(reply) + 1):
        yield [reply[:i], reply[i:]]
    yield list(reply)
    for _ in range(30):
        points = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(2, 8))))
        yield [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)]


def check_streams(name: str, cases: dict) -> None:
    """Each reply of `cases` streamed to parser `name` in pieces, cut every way `_cuts`
    cuts it, reads as it does whole."""
    parser = make_parser(name, SCHEMAS)
    rng = random.Random(7)
    for reply, (content, calls) in cases.items():
        if len(reply) > 1000:  # the recursion case: cut once, not at every position
            assert _streamed(parser, [reply[:500], reply[500:]]) == (reply, ())
            continue
        for pieces in _cuts(reply, rng):
            assert _streamed(parser, pieces) == (content or "", calls), (reply, pieces)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_stream_cut_anywhere_equals_the_whole_reply(name):
    """Guards streaming against chunk boundaries: a tag split across pieces, a block's
    close arriving in pieces, whitespace held before a call and let out before text. The
    content a stream lets out, joined, and its calls equal the whole reply's reading."""
    check_streams(name, CASES[name])


def test_hermes_lets_text_out_as_it_comes_and_holds_only_a_possible_call():
    """Guards the stream's latency: text goes out at once, only a tag's possible
    beginning (and trailing whitespace) is held, a block goes out as its call the moment
    its `</tool_call>` arrives, and text that proves not to be a tag is let out."""
    stream = make_parser("hermes", TOOLS).stream()
    assert stream.feed("It is sunny. <").content == "It is sunny."
    assert stream.feed("b>").content == " <b>"
    assert stream.feed(" Now <tool_").content == " Now"  # " " held, and a tag's beginning
    assert stream.feed(OSLO[6:-5]) == StreamStep()  # an open block: nothing out
    assert stream.feed(OSLO[-5:] + "\n") == StreamStep("", [OSLO_CALL])
    assert stream.feed("Bye") == StreamStep(" \nBye")  # the held whitespace, before text
    assert stream.finish() == StreamStep()


def test_llama3_json_decides_at_the_first_character():
    """Guards the llama3_json stream: text starting otherwise than `{` or the tag goes out
    as it comes; a reply that may be calls is held while it may be."""
    stream = make_parser("llama3_json", TOOLS).stream()
    assert stream.feed("  ").content == "" and stream.feed("Hi").content == "  Hi"
    assert stream.feed(" {").content == " {"
    stream = make_parser("llama3_json", TOOLS).stream()
    assert stream.feed(" <|py").content == "" and stream.feed("thon_tag|>{").content == ""
    assert stream.feed(LLAMA_OSLO[1:]).calls == []
    assert stream.finish().calls == [OSLO_CALL]


def test_hermes_holds_a_block_left_open_to_the_end_then_reads_it():
    """Guards the open block at the end of a streamed reply (the model stopped right after
    the JSON): held, not let out as text, while `</tool_call>` may still come; at the end a
    call when its JSON is one (the whitespace before it dropped), else text, tag and all."""
    stream = make_parser("hermes", TOOLS).stream()
    assert stream.feed("Sure.\n" + OPEN_OSLO) == StreamStep("Sure.")
    assert stream.finish() == StreamStep("", [OSLO_CALL])
    stream = make_parser("hermes", TOOLS).stream()
    assert stream.feed("Sure. " + OPEN_UNKNOWN) == StreamStep("Sure.")
    assert stream.finish() == StreamStep(" " + OPEN_UNKNOWN)


# reply -> how much of it must have come for it to be text for sure
LLAMA3_TEXT_AT = {
    LLAMA_OSLO + " and then": len(LLAMA_OSLO) + 2,  # the "a"
    '{"answer": 42} more': len('{"answer": 42}'),  # an object that is not a call
    LLAMA_DATE + "; " + LLAMA_TIME: len(LLAMA_DATE),
    LLAMA_OSLO + "; [1]": len(LLAMA_OSLO) + 3,  # the "["
    '{"a" 1} ' + LLAMA_TIME: len('{"a" 1}'),  # its brackets closed, not JSON
    "<|python_tag|>print(1)": len("<|python_tag|>p"),
}


def test_llama3_json_lets_text_out_once_it_cannot_be_calls():
    """Guards the llama3_json stream's latency: a reply that opens like calls goes out as
    text the moment it cannot be calls (an object that is not a call, once its brackets
    close; a character after an object other than `;`; a value after `;` other than an
    object), then as it comes; before that moment nothing of it goes out."""
    parser = make_parser("llama3_json", TOOLS)
    for reply, text_at in LLAMA3_TEXT_AT.items():
        assert parser.parse(reply) == ParsedReply(reply, ())
        for cut in range(len(reply) + 1):
            stream = parser.stream()
            got = stream.feed(reply[:cut])
            assert got == StreamStep(reply[:cut] if cut >= text_at else ""), (reply, cut)
            assert got.content + stream.feed(reply[cut:]).content == reply  # all before the end
            assert stream.finish() == StreamStep()


def test_llama3_json_holds_whole_calls_to_the_end():
    """Guards the all-or-nothing rule in a stream: a call whole, even a `;` and a second
    call whole, is not sent before the reply ends, since text after it would make the whole
    reply text; at the end the calls go together."""
    reply = LLAMA_OSLO + "; " + LLAMA_TIME
    for cut in range(len(reply) + 1):
        stream = make_parser("llama3_json", TOOLS).stream()
        assert stream.feed(reply[:cut]) == StreamStep() == stream.feed(reply[cut:])
        assert stream.finish() == StreamStep("", [OSLO_CALL, TIME_CALL])


# A 200,000-character call, its arguments full of what the streams look for (quotes,
# escapes, brackets, a piece of the close tag), then a short second call.
LONG_ARGS = {"city": "Oslo", "note": ('a "quoted" \\ }{ ][ </tool_ ' * 8_000)[:200_000]}
LONG = {
    "hermes": "Let me check.\n" + _block("get_weather", LONG_ARGS) + "\n" + TIME,
    "llama3_json": json.dumps({"name": "get_weather", "parameters": LONG_ARGS}) + "; " + LLAMA_TIME,
    "qwen3_coder": "Let me check.\n"
    + _qwen("get_weather", LONG_ARGS)
    + "\n"
    + _qwen("get_time", {}),
    "glm45": "Let me check.\n" + _glm("get_weather", LONG_ARGS) + "\n" + _glm("get_time", {}),
    "openai": "Let me check." + _harmony("get_weather", LONG_ARGS) + _harmony("get_time", {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_long_call_streamed_in_small_pieces_is_read_in_linear_work(name):
    """Guards the streams against quadratic work: they held the reply as one string and
    appended each piece to it (`held += piece`), copying all that was held on every feed:
    this call fed 1-7 characters a time allocated ~27,500 bytes per character of the reply
    (6 GB), and a 400,000-character call fed a character a time took 2.3 s. The memory
    allocated within the feeds, summed, measures the work without timing it (a copy of the
    held text shows in it); read each piece once it is ~40-170 bytes per character. The
    stream's reading still equals the whole reply's."""
    check_linear_work(name, LONG[name])


def check_linear_work(name: str, reply: str) -> None:
    """`reply`, a 200,000-character call and a short one, streamed to parser `name` in
    pieces of 1-7 characters: the memory allocated within the feeds stays under 1,000 bytes
    per character of the reply, and the stream reads it as `parse` does."""
    parser = make_parser(name, SCHEMAS)
    rng = random.Random(11)
    cuts = [0]
    while cuts[-1] < len(reply):
        cuts.append(min(len(reply), cuts[-1] + rng.randint(1, 7)))
    stream = parser.stream()
    steps, allocated = [], 0
    tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        for a, b in zip(cuts, cuts[1:]):
            piece = reply[a:b]
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            step = stream.feed(piece)
            allocated += tracemalloc.get_traced_memory()[1] - before
            steps.append(step)
    finally:
        if not tracing:
            tracemalloc.stop()
    steps.append(stream.finish())
    whole = parser.parse(reply)
    assert len(whole.calls) == 2 and len(whole.calls[0].arguments) > 200_000
    content = "".join(s.content for s in steps)
    assert (content, tuple(c for s in steps for c in s.calls)) == (whole.content or "", whole.calls)
    assert allocated < 1_000 * len(reply), f"{allocated / len(reply):.0f} bytes per character"
