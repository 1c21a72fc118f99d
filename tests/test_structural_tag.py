"""Structural tags (runner/structured/structural_tag.py, avoid.py) on strings: the byte DFA
against the language's definition read directly, each format of the `format` form on texts
it must take and refuse, and the API's refusals."""

from __future__ import annotations

import functools
import itertools
import json
import random
import re

import pytest

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.structured_api import parse_structured
from pdserve.runner.structured.byte_dfa import compile_dfa
from pdserve.runner.structured.json_schema import schema_node
from pdserve.runner.structured.patterns import compile_spec
from pdserve.runner.structured.regex_ast import Avoid
from pdserve.runner.structured.spec import StructuredOutputs

# Sets of strings to avoid with overlaps of every kind: one inside another, a suffix that
# is another's prefix, a repeated letter, a single byte.
AVOID_SETS = [("ab",), ("aa",), ("aba",), ("ab", "b"), ("abc", "bcb", "ca"), ("aab", "ab"),
              ("c", "aaa"), ("abab", "bab")]  # fmt: skip


@pytest.mark.parametrize("strings", AVOID_SETS, ids=["|".join(s) for s in AVOID_SETS])
def test_avoid_matches_exactly_the_texts_that_hold_none_of_the_strings(strings):
    """Guards the automaton (each state the longest suffix that may still grow into one
    of the strings): every text over a, b, c, d up to 7 letters against `in`."""
    dfa = compile_dfa(Avoid(tuple(s.encode() for s in strings)))
    for n in range(8):
        for letters in itertools.product("abcd", repeat=n):
            text = "".join(letters)
            assert dfa.matches(text.encode()) == (not any(s in text for s in strings)), text


TAG = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<f=a>", "schema": {"type": "object", "properties": {"c": {"type": "integer"}},
                                      "required": ["c"], "additionalProperties": False},
         "end": "</f>"},
        {"begin": "<f=b>", "schema": {"enum": ["x", 2]}, "end": "</f>"},
        {"begin": "!!", "schema": True, "end": ""},
    ],
    "triggers": ["<f=", "!!"],
}  # fmt: skip
PIECES = ["x", " ", "<", "=", "!", "<f", "<f=", "<f=a>", "<f=b>", "<f=c>", '{"c":1}',
          '{"c":"x"}', '"x"', "2", "3", "{", "}", "</f>", "</", "!!"]  # fmt: skip


def _defined(text: str, tag: dict, bodies: list) -> bool:
    """The language read from its definition: free (structure free)*, free holding no
    trigger, a structure its begin, a JSON text its schema's automaton (`bodies`) takes,
    its end."""
    triggers = tag["triggers"]

    @functools.cache
    def from_(i: int) -> bool:
        for j in range(i, len(text) + 1):
            if any(t in text[i:j] for t in triggers):
                return False  # free text can grow no further
            if j == len(text):
                return True
            for s, body in zip(tag["structures"], bodies, strict=True):
                if not text.startswith(s["begin"], j):
                    continue
                at = j + len(s["begin"])
                for k in range(at, len(text) + 1):
                    if (body.matches(text[at:k].encode()) and text.startswith(s["end"], k)
                            and from_(k + len(s["end"]))):  # fmt: skip
                        return True
        return False

    return from_(0)


def test_a_structural_tag_is_free_text_with_a_structure_at_each_trigger():
    """Guards the tag's pattern tree against `_defined`, on texts joined from pieces that
    open, close and break structures (all up to 3 pieces, then 3,000 seeded ones of 4-7),
    then what the pattern means on the texts a client would send."""
    dfa = compile_spec(StructuredOutputs(structural_tag=json.dumps(TAG)))
    bodies = [compile_dfa(schema_node(s["schema"])) for s in TAG["structures"]]
    rng = random.Random(0)
    texts = ["".join(p) for n in range(4) for p in itertools.product(PIECES, repeat=n)]
    texts += ["".join(rng.choices(PIECES, k=rng.randint(4, 7))) for _ in range(3000)]
    accepted = 0
    for text in texts:
        want = _defined(text, TAG, bodies)
        assert dfa.matches(text.encode()) == want, text
        accepted += want
    assert 0.05 < accepted / len(texts) < 0.95  # both answers were asked for
    for text, want in [
        ("Let me look that up.", True),
        ('Calling <f=a>{"c":1}</f> and then <f=b>"x"</f>, done.', True),
        ("!!{}tail", True),
        ('<f=a>{"c":1}', False),  # a structure is never left open at the end
        ('<f=a>{"c":"one"}</f>', False),  # its JSON is the schema's
        ("<f=c>", False),  # a trigger starts one of the structures, or nothing
        ("half a trigger: <f", True),
    ]:
        assert dfa.matches(text.encode()) == want, text


def test_the_api_takes_the_tag_as_vllm_clients_send_it():
    """Guards both ways in (`response_format` with type structural_tag, and
    `structured_outputs.structural_tag` as JSON text or as an object) to one spec; what
    a tag cannot mean is a 400 naming the field."""
    fmt = parse_structured({"response_format": TAG})
    text = parse_structured({"structured_outputs": {"structural_tag": json.dumps(TAG)}})
    obj = parse_structured({"structured_outputs": {"structural_tag": TAG}})
    assert fmt == text == obj and json.loads(fmt.structural_tag) == TAG
    assert StructuredOutputs.from_wire(fmt.to_wire()) == fmt
    one = TAG["structures"][0]
    for bad, says in [
        ({**TAG, "triggers": []}, "'triggers'"),
        ({**TAG, "structures": [{**one, "begin": "<g=a>"}]}, "starts with 0 of the triggers"),
        ({**TAG, "triggers": ["<f=", "<f"]}, "starts with 2 of the triggers"),
        ({**TAG, "structures": [{**one, "schema": {"type": "string", "format": "ipv9"}}]},
         "structures[0].content's schema: JSON schema string format 'ipv9'"),
        ({**TAG, "structures": [{"begin": "<f=a>", "end": "</f>"}]}, "needs a 'schema'"),
        ({**TAG, "trigger": ["<f="]}, "unknown field"),
        ({"type": "structural_tag", "format": {"type": "grammar", "grammar": "root ::= 'a'"}},
         "format type 'grammar' is not supported"),
        ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}},
         "needs a 'content' format"),
        ({"type": "structural_tag", "format": {"type": "or", "elements": [{"type": "x"}]}},
         "structural_tag.format.elements[0]: format type 'x'"),
        ({"type": "structural_tag", "format": {"type": "any_text"}, "triggers": ["a"]},
         "not both"),
        ({"type": "structural_tag", "format": {"type": "any_text", "max_chars": 9}},
         "(any_text) has unknown field(s) ['max_chars']"),
        ({"type": "structural_tag", "format": {"type": "any_text", "excludes": ["a", ""]}},
         "'excludes' must be a list of non-empty strings"),
        ({"type": "structural_tag", "format": {"type": "star"}}, "needs a 'content' format"),
        *(({"type": "structural_tag", "format": {"type": "repeat", "content": ANY, **bounds}},
           says) for bounds, says in [
            ({"min": -1, "max": 2}, "needs integers 'min' >= 0"),
            ({"min": 3, "max": 2}, "got min 3, max 2"),
            ({"min": 1, "max": True}, "got min 1, max True"),
            ({"min": 1}, "got min 1, max None"),
            ({"min": 0, "max": 1001}, "repeat counts are limited to 1000"),
        ]),
        ({"type": "structural_tag", "format": {"type": "dispatch", "rules": []}},
         "format type 'dispatch' is not supported"),
    ]:  # fmt: skip
        with pytest.raises(ApiError, match=re.escape(says)) as e:
            parse_structured({"response_format": bad})
        assert e.value.param == "response_format"
    with pytest.raises(ApiError, match="not valid JSON") as e:
        parse_structured({"structured_outputs": {"structural_tag": "{"}})
    assert e.value.param == "structured_outputs"


def _tag(begin: str, content: dict, end="</f>") -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


NUM = {"type": "json_schema", "json_schema": {"type": "integer"}}
ANY = {"type": "any_text"}
FORMS = {
    "the first form, as the format it means": (
        {"type": "triggered_tags", "triggers": ["<f=", "!!"],
         "tags": [_tag(s["begin"], {"type": "json_schema", "json_schema": s["schema"]}, s["end"])
                  for s in TAG["structures"]]},
        None,  # checked against TAG's own DFA below
    ),
    "const_string, regex, sequence, or": (
        {"type": "sequence", "elements": [
            {"type": "const_string", "value": "Answer: "},
            {"type": "or", "elements": [{"type": "regex", "pattern": "[0-9]{1,3}"},
                                        {"type": "const_string", "value": "none"}]},
            {"type": "const_string", "value": "."}]},
        {"Answer: 42.": True, "Answer: none.": True, "Answer: 4242.": False, "Answer: 4": False,
         "answer: 4.": False},
    ),
    "any_text in a tag stops at its first end; ends may be a list": (
        _tag("<t>", ANY, ["</t>", "<eot>"]),
        {"<t>any </x> text</t>": True, "<t></t>": True, "<t>a<eot>": True,
         "<t>a</t>b</t>": False, "<t>a</t><eot>": False, "<t>a": False},
    ),
    "any_text at the top and as a sequence's head": (
        {"type": "sequence", "elements": [ANY, {"type": "const_string", "value": "END"}]},
        {"END": True, "xEND": True, "xENDyEND": True, "x": False},
    ),
    "any_text anywhere inside a tag avoids the nearest enclosing tag's ends": (
        _tag("<t>", {"type": "sequence", "elements": [ANY, {"type": "const_string",
                                                             "value": "!"}]}, "</t>"),
        {"<t>ab!</t>": True, "<t>!</t>": True, "<t>a!b!</t>": True, "<t>a</t>b!</t>": False,
         "<t>ab</t>": False},
    ),
    "... the nearest one only": (
        _tag("<o>", {"type": "sequence", "elements": [_tag("<i>", ANY, "</i>"), ANY]}, "</o>"),
        {"<o><i>a</o>b</i>c</o>": True, "<o><i>a</i>b</o>c</o>": False, "<o><i></i></o>": True},
    ),
    "any_text's excludes": (
        {"type": "sequence", "elements": [{"type": "any_text", "excludes": ["<f=", "!!"]},
                                          {"type": "const_string", "value": "."}]},
        {"hi.": True, "a!.": True, "hi <f=.": False, "a!!.": False, ".": True},
    ),
    "optional, plus, repeat, star": (
        {"type": "sequence", "elements": [
            {"type": "optional", "content": {"type": "const_string", "value": "x"}},
            {"type": "plus", "content": {"type": "const_string", "value": "y"}},
            {"type": "repeat", "min": 1, "max": 2,
             "content": {"type": "const_string", "value": "z"}},
            {"type": "star", "content": {"type": "const_string", "value": "w"}}]},
        {"yz": True, "xyyzzw": True, "yzww": True, "xyzzzw": False, "xz": False, "y": False,
         "xxyz": False},
    ),
    "... repeat with no upper bound": (
        {"type": "repeat", "min": 2, "max": -1, "content": {"type": "const_string",
                                                              "value": "ab"}},
        {"abab": True, "ababab": True, "ab": False, "": False, "ababa": False},
    ),
    "triggered_tags: free text, tags at the triggers": (
        {"type": "triggered_tags", "triggers": ["<f="],
         "tags": [_tag("<f=a>", NUM), _tag("<f=b>", ANY)]},
        {"": True, "hi": True, "hi <f=a>12</f> and <f=b>x y</f>!": True, "<f=a>x</f>": False,
         "<f=c>1</f>": False, "<f=b>x": False},
    ),
    "... at_least_one: the text opens with a tag": (
        {"type": "triggered_tags", "triggers": ["<f="], "tags": [_tag("<f=a>", NUM)],
         "at_least_one": True},
        {"<f=a>1</f>": True, "<f=a>1</f> then <f=a>2</f> end": True, "": False,
         "hi <f=a>1</f>": False},
    ),
    "... stop_after_first: nothing after the first tag": (
        {"type": "triggered_tags", "triggers": ["<f="], "tags": [_tag("<f=a>", NUM)],
         "stop_after_first": True},
        {"": True, "hi": True, "hi <f=a>1</f>": True, "<f=a>1</f> more": False,
         "<f=a>1</f><f=a>2</f>": False},
    ),
    "... both: exactly one tag": (
        {"type": "triggered_tags", "triggers": ["<f="], "tags": [_tag("<f=a>", NUM)],
         "at_least_one": True, "stop_after_first": True},
        {"<f=a>1</f>": True, "": False, "x<f=a>1</f>": False, "<f=a>1</f>x": False},
    ),
    "triggered_tags inside a tag: its free text stops at the tag's end": (
        _tag("<calls>", {"type": "triggered_tags", "triggers": ["<f="],
                         "tags": [_tag("<f=a>", NUM)]}, "</calls>"),
        {"<calls>say <f=a>1</f> ok</calls>": True, "<calls></calls>": True,
         "<calls>a</calls>b</calls>": False},
    ),
    "... its excludes hold in its free text": (
        {"type": "triggered_tags", "triggers": ["<f="], "tags": [_tag("<f=a>", NUM)],
         "excludes": ["<eos>"]},
        {"hi <f=a>1</f>": True, "hi<eos>": False, "<f=a>1</f><eos>": False, "<eo": True},
    ),
    "tags_with_separator: tags and separators only": (
        {"type": "tags_with_separator", "separator": ",", "tags": [_tag("<f=a>", NUM)]},
        {"": True, "<f=a>1</f>": True, "<f=a>1</f>,<f=a>2</f>": True, "<f=a>1</f>,": False,
         "<f=a>1</f> <f=a>2</f>": False},
    ),
    "... at_least_one, stop_after_first": (
        {"type": "tags_with_separator", "separator": ",", "tags": [_tag("<f=a>", NUM)],
         "at_least_one": True, "stop_after_first": True},
        {"<f=a>1</f>": True, "": False, "<f=a>1</f>,<f=a>2</f>": False},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", FORMS)
def test_each_format_takes_its_texts_and_refuses_the_others(name):
    """Guards the `format` form, format by format (xgrammar's meanings: the module
    docstring); the first form must mean its `triggered_tags` format exactly."""
    fmt, cases = FORMS[name]
    dfa = compile_spec(StructuredOutputs(structural_tag={"type": "structural_tag", "format": fmt}))
    if cases is None:
        legacy = compile_spec(StructuredOutputs(structural_tag=json.dumps(TAG)))
        cases = {t: legacy.matches(t.encode()) for n in range(4)
                 for t in map("".join, itertools.product(PIECES, repeat=n))}  # fmt: skip
        assert any(cases.values()) and not all(cases.values())
    for text, want in cases.items():
        assert dfa.matches(text.encode()) == want, text
