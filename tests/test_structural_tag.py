"""Structural tags (runner/structured/structural_tag.py, avoid.py) on strings: the byte DFA
against the language's definition read directly, and the API's refusals."""

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
        ({**TAG, "structures": [{**one, "begin": "<g=a>"}]}, "starts with none of the triggers"),
        ({**TAG, "structures": [{**one, "schema": {"type": "string", "format": "ipv9"}}]},
         "structures[0]'s schema"),
        ({**TAG, "structures": [{"begin": "<f=a>", "end": "</f>"}]}, "needs a 'schema'"),
        ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "'format' form"),
        ({**TAG, "trigger": ["<f="]}, "unknown field"),
    ]:  # fmt: skip
        with pytest.raises(ApiError, match=re.escape(says)) as e:
            parse_structured({"response_format": bad})
        assert e.value.param == "response_format"
    with pytest.raises(ApiError, match="not valid JSON") as e:
        parse_structured({"structured_outputs": {"structural_tag": "{"}})
    assert e.value.param == "structured_outputs"
