"""JSON mode and JSON-schema pattern trees, compiled to byte DFAs and checked against texts.

Valid instances are cross-checked with `jsonschema`, so a test table that drifts from the
schema it claims to test fails here rather than hiding a grammar bug.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import random
import re
import zlib
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.runner.structured.byte_dfa import ByteDFA, compile_dfa
from pdserve.runner.structured.json_grammar import json_object_node, json_value_node
from pdserve.runner.structured.json_schema import OPEN_MAX_DEPTH, schema_node


@functools.cache
def object_dfa(max_depth: int) -> ByteDFA:
    return compile_dfa(json_object_node(max_depth))


@functools.cache
def value_dfa(max_depth: int) -> ByteDFA:
    return compile_dfa(json_value_node(max_depth))


def schema_dfa(schema: dict | bool, max_depth: int = 8) -> ByteDFA:
    return compile_dfa(schema_node(schema, max_depth))


def depth(value: Any) -> int:
    """Container nesting of a decoded JSON value: 0 for a scalar, 1 for `{}` or `[1]`."""
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    return 0


def renderings(value: Any) -> list[str]:
    """The texts a model may write for `value`: compact, one space, ASCII-escaped."""
    return [
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        json.dumps(value, ensure_ascii=False, separators=(", ", ": ")),
        json.dumps(value, ensure_ascii=True, separators=(", ", ": ")),
    ]


def is_schema_valid(schema: dict | bool, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    cls = jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value)


# --- JSON mode ------------------------------------------------------------------------------

JSON_MODE_VALID = [
    "{}",
    "{ }",
    '{"a": 1}',
    '{"a":1}',
    '{ "a": 1 }',
    '{"a": [1, 2.5, -0.5e+10, 1E-3, 0, -0], "b": {"c": null, "d": true, "e": false}}',
    '{"a": {"b": {"c": {"d": 1}}}}',  # exactly depth 4
    '{"a": [[[1]]]}',
    '{"日本語": "ünïcödé ✓ 😀"}',
    '{"e": "\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\uD83D\\uDE00"}',
    '{"": ""}',
    '{"a": []}',
    '{"a": [ ]}',
    '{"a": "\x7f"}',
]

JSON_MODE_INVALID = [
    "[]",
    "[1]",
    "1",
    '"a"',
    "null",
    "true",
    '{"a": 1,}',
    "{,}",
    '{"a": [1,]}',
    '{"a" 1}',
    "{'a': 1}",
    "{\"a\": 'b'}",
    '{"a": "line\nbreak"}',
    '{"a": "tab\there"}',
    '{"a": "\x00"}',
    '{"a": {"b": {"c": {"d": {"e": 1}}}}}',  # depth 5
    '{"a": [[[[1]]]]}',
    " {}",
    "{} ",
    "{}\n",
    '{"a" : 1}',  # no space before a colon
    '{"a": 1 , "b": 2}',  # nor before a comma
    "{  }",  # at most one space between tokens
    '{"a":  1}',
    '{\n"a": 1}',
    '{"a": 01}',
    '{"a": 1.}',
    '{"a": .5}',
    '{"a": +1}',
    '{"a": 1e}',
    '{"a": NaN}',
    '{"a": Infinity}',
    '{"a": "\\x41"}',
    '{"a": "\\u12"}',
    '{"a": "\\uD83D"}',  # a lone high surrogate does not decode
    '{"a": "\\uDE00"}',
    '{"a": "\\uD83Dx"}',
    '{"a": tru}',
    '{"a": 1}}',
    '{"a": 1',
]


@pytest.mark.parametrize("text", JSON_MODE_VALID)
def test_json_mode_accepts(text: str) -> None:
    """Guards against a JSON mode that refuses valid JSON objects (numbers with exponents,
    escapes, surrogate-pair escapes, raw Unicode, DEL, nesting at exactly the bound)."""
    assert depth(json.loads(text)) <= 4
    assert object_dfa(4).matches(text.encode())


@pytest.mark.parametrize("text", JSON_MODE_INVALID)
def test_json_mode_rejects(text: str) -> None:
    """Guards against JSON mode letting through broken JSON, non-objects, nesting past the
    bound, lone surrogates, or whitespace beyond one space in the allowed places."""
    assert not object_dfa(4).matches(text.encode())


@pytest.mark.parametrize("bound", [1, 2, 3, 5])
def test_json_mode_depth_is_exact(bound: int) -> None:
    """Guards against an off-by-one in the depth bound, for objects and arrays alike."""
    dfa = object_dfa(bound)
    for inner_open, inner_close in (('{"k": ', "}"), ("[", "]")):
        for d in range(1, bound + 3):
            text = '{"k": ' + inner_open * (d - 1) + "1" + inner_close * (d - 1) + "}"
            assert depth(json.loads(text)) == d
            assert dfa.matches(text.encode()) == (d <= bound), text


def test_json_value_node_depth_zero_is_scalars() -> None:
    """Guards against depth 0 admitting containers (the base case of every bound)."""
    dfa = value_dfa(0)
    for text in ["1", '"x"', "null", "true", "-1.5e3"]:
        assert dfa.matches(text.encode())
    for text in ["{}", "[]"]:
        assert not dfa.matches(text.encode())
    with pytest.raises(ValueError, match="max_depth"):
        json_object_node(0)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_json_mode_matches_python_json(value: Any) -> None:
    """Guards against the grammar and Python's json disagreeing on any rendering of any
    value: accepted exactly when it is an object nested no deeper than the bound."""
    for text in renderings(value):
        assert object_dfa(3).matches(text.encode()) == (
            isinstance(value, dict) and depth(value) <= 3
        ), text
        assert value_dfa(2).matches(text.encode()) == (depth(value) <= 2), text


# --- JSON schema ----------------------------------------------------------------------------

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
    "required": ["street", "city"],
    "additionalProperties": False,
}


def person_schema(required: list[str]) -> dict:
    """A typical 6-property structured-output schema."""
    return {
        "title": "Person",
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40, "description": "full name"},
            "age": {"type": "integer"},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "address": ADDRESS,
            "active": {"type": "boolean", "default": True},
        },
        "required": required,
        "additionalProperties": False,
    }


PERSON_FULL = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["math", "computing"],
    "address": {"street": "12 St James's Sq", "city": "London"},
    "active": False,
}

# (schema, valid instances, invalid texts). Instances list keys in declared order: the
# grammar emits properties in that order.
CASES: list[tuple[str, Any, list[Any], list[str]]] = [
    (
        "person-required-name-age",
        person_schema(["name", "age"]),
        [
            PERSON_FULL,
            {"name": "Ada", "age": 36},
            {"name": "Ada", "age": 36, "active": True},
            {"name": "", "age": -1, "tags": []},
        ],
        [
            '{"age": 36}',  # missing required
            '{"name": "Ada"}',
            '{"name": "Ada", "age": "36"}',  # wrong type
            '{"name": "Ada", "age": 3.5}',
            '{"name": "Ada", "age": 36, "extra": 1}',  # additionalProperties false
            '{"name": "Ada", "age": 36, "tags": ["a", "b", "c", "d", "e", "f"]}',
            '{"name": "Ada", "age": 36, "address": {"street": "x"}}',
            '{"name": "' + "x" * 41 + '", "age": 1}',
            '{"name": "Ada", "age": 36, "email": "nope"}',
            '{"name": "Ada", "age": 36,}',
            '{"name": "Ada",, "age": 36}',
        ],
    ),
    (
        "person-leading-optional",
        person_schema(["tags", "active"]),
        [{"tags": [], "active": True}, {"name": "A", "tags": ["x"], "active": False}],
        ['{"active": true}', '{, "tags": [], "active": true}', "{}"],
    ),
    (
        "person-all-optional",
        person_schema([]),
        [{}, {"active": True}, {"name": "A"}, {"age": 1, "address": PERSON_FULL["address"]}],
        ['{"active": true,}', '{,"active": true}', '{"name": 1}'],
    ),
    (
        "person-all-required",
        person_schema(list(PERSON_FULL)),
        [PERSON_FULL],
        [json.dumps({k: v for k, v in PERSON_FULL.items() if k != "tags"})],
    ),
    (
        "enum",
        {"enum": ["red", "green", 3, None, {"a": [1]}, 'naïve "q"']},
        ["red", "green", 3, None, {"a": [1]}, 'naïve "q"'],
        ['"blue"', "4", '"Red"', "[1]", '{"a":[2]}'],
    ),
    (
        "enum-with-type",
        {"type": "string", "enum": ["a", 1, "b"]},
        ["a", "b"],
        ["1", '"c"'],
    ),
    ("const", {"const": {"x": [1, "y"]}}, [{"x": [1, "y"]}], ['{"x":[1]}', "1"]),
    (
        "array-bounds",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
        [[1, 2], [1, 2, 3], [1, 2, 3, 4]],
        ["[]", "[1]", "[1, 2, 3, 4, 5]", '[1, "a"]', "[1, 2,]"],
    ),
    (
        "array-unbounded",
        {"type": "array", "items": {"type": "number"}},
        [[], [1], [1.5, -2, 3e8] * 5],
        ["[1,]", "[,]", "[null]"],
    ),
    (
        "prefix-items-closed",
        {
            "type": "array",
            "prefixItems": [{"type": "string"}, {"type": "integer"}],
            "items": False,
            "minItems": 1,
        },
        [["a"], ["a", 1]],
        ["[]", "[1]", '["a", 1, 2]', '["a", "b"]'],
    ),
    (
        "prefix-items-then-items",
        {
            "type": "array",
            "prefixItems": [{"const": "op"}],
            "items": {"type": "boolean"},
            "maxItems": 3,
        },
        [[], ["op"], ["op", True], ["op", True, False]],
        ['["op", true, false, true]', "[true]", '["op", 1]'],
    ),
    (
        "any-of-nullable",
        {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "null"}], "title": "x"},
        ["", "ab", None],
        ['"abc"', "1", "false"],
    ),
    (
        "one-of-objects",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                    "required": ["kind"],
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                    "required": ["kind", "good"],
                },
            ]
        },
        [{"kind": "cat"}, {"kind": "cat", "lives": 9}, {"kind": "dog", "good": True}],
        ['{"kind": "dog"}', '{"kind": "cat", "lives": "9"}', '{"kind": "cow"}'],
    ),
    (
        "defs-ref",
        {
            "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
            "type": "object",
            "properties": {
                "a": {"$ref": "#/$defs/Point"},
                "b": {"allOf": [{"$ref": "#/definitions/Point"}], "description": "b"},
            },
            "required": ["a"],
            "definitions": {"Point": {"$ref": "#/$defs/Point"}},
        },
        [{"a": {"x": 1}}, {"a": {}, "b": {"x": -2.5}}],
        ['{"a": {"x": "1"}}', '{"b": {}}', '{"a": 1}'],
    ),
    (
        "recursive-linked-list",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                    },
                    "required": ["v", "next"],
                }
            },
            "$ref": "#/$defs/node",
        },
        [
            {"v": 1, "next": None},
            {"v": 1, "next": {"v": 2, "next": {"v": 3, "next": None}}},
        ],
        ['{"v": 1}', '{"v": 1, "next": {"v": 2}}', '{"v": 1, "next": 2}'],
    ),
    (
        "nested-objects",
        {
            "type": "object",
            "properties": {
                "outer": {
                    "type": "object",
                    "properties": {
                        "inner": {
                            "type": "object",
                            "properties": {"leaf": {"type": "string"}},
                            "required": ["leaf"],
                        }
                    },
                    "required": ["inner"],
                },
                "n": {"type": "integer"},
            },
            "required": ["outer"],
        },
        [{"outer": {"inner": {"leaf": "x"}}}, {"outer": {"inner": {"leaf": ""}}, "n": 0}],
        ['{"outer": {"inner": {}}}', '{"outer": {}}', '{"n": 1}'],
    ),
    (
        "type-list",
        {"type": ["integer", "null", "string"], "maxLength": 1},
        [1, -20, None, "", "x"],
        ["1.5", '"xy"', "true", "[]"],
    ),
    (
        "free-object-with-value-schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{}, {"a": 1, "b": 2}, {"ключ": -3}],
        ['{"a": "1"}', '{"a": 1.5}', "[]"],
    ),
    (
        "closed-empty-object",
        {"type": "object", "additionalProperties": False},
        [{}],
        ['{"a": 1}'],
    ),
    (
        "any-value",
        True,
        [1, "x", None, [1, {"a": {}}], {"a": [1, [2]]}],
        ["", "{", "nul"],
    ),
    (
        "formats",
        {
            "type": "object",
            "properties": {
                "d": {"type": "string", "format": "date"},
                "t": {"type": "string", "format": "time"},
                "dt": {"type": "string", "format": "date-time"},
                "u": {"type": "string", "format": "uuid"},
                "e": {"type": "string", "format": "email"},
            },
        },
        [
            {"d": "2024-02-29"},
            {"d": "2000-02-29"},
            {"d": "1999-12-31"},
            {"d": "0001-01-01"},
            {"t": "23:59:59Z"},
            {"t": "00:00:00.123+05:30"},
            {"dt": "2024-06-30T12:34:56.789-07:00"},
            {"u": "123e4567-e89b-12d3-A456-426614174000"},
            {"e": "first.last+tag@mail.example.co.uk"},
        ],
        [
            '{"d": "2023-02-29"}',
            '{"d": "1900-02-29"}',
            '{"d": "2024-04-31"}',
            '{"d": "2024-13-01"}',
            '{"d": "2024-1-01"}',
            '{"d": "0000-01-01"}',
            '{"t": "24:00:00Z"}',
            '{"t": "12:60:00Z"}',
            '{"t": "12:00:00"}',
            '{"dt": "2024-06-30 12:34:56Z"}',
            '{"u": "123e4567-e89b-12d3-a456-42661417400"}',
            '{"u": "123e4567e89b12d3a456426614174000"}',
            '{"e": "no-at-sign"}',
            '{"e": "a@localhost"}',
            '{"e": "a..b@example.com"}',
        ],
    ),
    (
        "pattern",
        {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        ["AB-123", "ZZ-000"],
        ['"ab-123"', '"AB-1234"', '"xAB-123"', '"AB-12"'],
    ),
    (
        "pattern-negated-class",
        {"type": "string", "pattern": "^[^,]+$"},
        ["a b", "日本", "x'y"],
        ['""', '"a,b"'],
    ),
    (
        "string-length-in-characters",
        {"type": "string", "minLength": 2, "maxLength": 3},
        ["日本", "ab\n", "😀😀😀", "a\u0001"],
        ['"a"', '"abcd"', '"😀😀😀😀"', '"\\uD83D\\uDE00"'],
    ),
]


# enum/const values are emitted only as compact `json.dumps(ensure_ascii=False)` text, and
# pattern-constrained strings only unescaped: those cases check just that rendering.
COMPACT_ONLY = {"enum", "const", "pattern", "pattern-negated-class"}


@pytest.mark.parametrize(("name", "schema", "valid", "invalid"), CASES, ids=[c[0] for c in CASES])
def test_schema_accepts_valid_instances(
    name: str, schema: Any, valid: list[Any], invalid: list[str]
) -> None:
    """Guards against the schema grammar refusing texts the schema allows: optional
    properties before or after required ones, enum/const values, array length bounds,
    refs, recursion within the depth budget, formats, patterns, character-counted lengths."""
    dfa = schema_dfa(schema)
    for value in valid:
        texts = renderings(value)
        for text in texts[:1] if name in COMPACT_ONLY else texts:
            assert is_schema_valid(schema, text), f"test table is wrong: {text}"
            assert dfa.matches(text.encode()), text


@pytest.mark.parametrize(("name", "schema", "valid", "invalid"), CASES, ids=[c[0] for c in CASES])
def test_schema_rejects_invalid_texts(
    name: str, schema: Any, valid: list[Any], invalid: list[str]
) -> None:
    """Guards against the schema grammar letting through texts that break the schema:
    missing required properties, wrong types, undeclared properties, too many items,
    values outside an enum, malformed dates, stray commas."""
    dfa = schema_dfa(schema)
    for text in invalid:
        assert not is_schema_valid(schema, text) or _format_invalid(text), (
            f"test table is wrong: {text}"
        )
        assert not dfa.matches(text.encode()), text


def sample_texts(dfa: ByteDFA, count: int, seed: int) -> list[str]:
    """Random texts the DFA accepts: a walk that picks a random next state (then a random
    byte into it), stops at accepting states at random, and heads for the nearest accepting
    state one step in ten (every step once long) so every walk ends."""
    rng = random.Random(seed)
    trans = dfa.trans
    live = [[(b, int(t)) for b, t in enumerate(row) if t >= 0] for row in trans]
    # Steps to acceptance, by backward BFS from the accepting states.
    back: list[list[int]] = [[] for _ in range(dfa.num_states)]
    for s, edges in enumerate(live):
        for _, t in edges:
            back[t].append(s)
    dist = [-1] * dfa.num_states
    queue = [s for s in range(dfa.num_states) if dfa.accept[s]]
    for s in queue:
        dist[s] = 0
    for s in queue:
        for p in back[s]:
            if dist[p] < 0:
                dist[p] = dist[s] + 1
                queue.append(p)
    texts = []
    for _ in range(count):
        state, out = dfa.start, bytearray()
        while True:
            greedy = len(out) > 200 or rng.random() < 0.1
            if dfa.accept[state] and (greedy or not live[state] or rng.random() < 0.2):
                break
            edges = live[state]
            if greedy:
                edges = [(b, t) for b, t in edges if dist[t] < dist[state]]
            target = rng.choice(sorted({t for _, t in edges}))
            out.append(rng.choice([b for b, t in edges if t == target]))
            state = target
        texts.append(out.decode())
    return texts


@pytest.mark.parametrize(("name", "schema", "valid", "invalid"), CASES, ids=[c[0] for c in CASES])
def test_sampled_outputs_are_valid(
    name: str, schema: Any, valid: list[Any], invalid: list[str]
) -> None:
    """Guards against the grammar producing output that breaks the schema (the failure a
    user sees): random texts the DFA accepts must parse and validate."""
    dfa = schema_dfa(schema)
    for text in sample_texts(dfa, 40, seed=zlib.crc32(name.encode())):
        assert is_schema_valid(schema, text), text
        assert not _format_invalid(text), text


def test_sampled_json_mode_outputs_are_valid() -> None:
    """Guards against JSON mode producing unparsable text or nesting past its bound."""
    for text in sample_texts(object_dfa(4), 200, seed=7):
        value = json.loads(text)
        assert isinstance(value, dict) and depth(value) <= 4, text


def _format_invalid(text: str) -> bool:
    """jsonschema checks `time`/`date-time` only with an optional package installed, and
    its `email` check is just an `@`: decide those cases here."""
    value = json.loads(text)
    if not isinstance(value, dict):
        return False
    for key, checker in (("t", _bad_time), ("dt", _bad_date_time), ("e", _bad_email)):
        if key in value and checker(value[key]):
            return True
    return False


def _bad_time(text: str) -> bool:
    # RFC 3339 full-time needs an offset; Python's parser would take a time without one.
    return re.search(r"(Z|[+-][0-9]{2}:[0-9]{2})$", text) is None or _bad_date_time(
        "2000-01-01T" + text
    )


def _bad_date_time(text: str) -> bool:
    try:
        datetime.datetime.fromisoformat(text)
    except ValueError:
        return True
    return "T" not in text


def _bad_email(text: str) -> bool:
    local, _, domain = text.partition("@")
    return ".." in local or "." not in domain


def test_optional_property_commas_exhaustive() -> None:
    """Guards against stray or missing commas when leading, middle or trailing properties
    are optional: for every required subset of four properties, exactly the subsets that
    keep the required ones (in declared order) are accepted, compact and spaced."""
    names = ["a", "b", "c", "d"]
    for req_mask in itertools.product([False, True], repeat=4):
        required = [n for n, r in zip(names, req_mask) if r]
        schema = {
            "type": "object",
            "properties": {n: {"type": "integer"} for n in names},
            "required": required,
        }
        dfa = schema_dfa(schema)
        for present in itertools.product([False, True], repeat=4):
            value = {n: i for i, (n, p) in enumerate(zip(names, present)) if p}
            ok = all(n in value for n in required)
            for text in renderings(value):
                assert dfa.matches(text.encode()) == ok, (required, text)
                assert is_schema_valid(schema, text) == ok
        # Out-of-order properties are never emitted (valid JSON, but not this grammar's).
        assert not dfa.matches(b'{"b": 1, "a": 0, "c": 2, "d": 3}')


def test_recursion_is_cut_at_max_depth() -> None:
    """Guards against unbounded (or off-by-far) expansion of a recursive $ref: a tree
    nests as deep as the budget allows and no deeper, and the branch past it is dropped
    (children become `[]` only) instead of raising or looping."""
    schema = {
        "type": "object",
        "properties": {
            "v": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["v", "children"],
    }

    def tree(levels: int) -> dict:
        return {"v": levels, "children": [tree(levels - 1)] if levels > 1 else []}

    # Each level is an object plus an array (2 containers); a $ref is expanded while the
    # value it stands for sits fewer than max_depth containers deep.
    dfa = schema_dfa(schema, max_depth=4)
    for levels in (1, 2, 3):
        text = json.dumps(tree(levels))
        assert is_schema_valid(schema, text)
        assert dfa.matches(text.encode()) == (levels <= 2), text


def test_open_values_are_depth_bounded() -> None:
    """Guards against open parts of a schema (`true`, `{}`) compiling to an automaton too
    big to build: they nest at most OPEN_MAX_DEPTH deep, and never past max_depth."""
    assert OPEN_MAX_DEPTH == 4
    dfa = schema_dfa(True)
    assert dfa.matches(b"[[[[1]]]]")
    assert not dfa.matches(b"[[[[[1]]]]]")
    schema = {"type": "object", "properties": {"a": {}}}
    dfa = schema_dfa(schema, max_depth=2)
    assert dfa.matches(b'{"a": [1]}')
    assert not dfa.matches(b'{"a": [[1]]}')
    assert is_schema_valid(schema, '{"a": [[1]]}')


def test_automaton_sizes_stay_small() -> None:
    """Guards against an accidental duplication in the grammar (a member or value copied
    per level instead of shared through SepRepeat) blowing up the DFA the token table is
    built from: JSON mode at depth 4 is 831 states, the person schema 1,072 (mostly its
    40-character name)."""
    assert object_dfa(4).num_states < 1_000
    assert schema_dfa(person_schema(["name", "age"])).num_states < 1_300
    assert schema_dfa(person_schema([])).num_states < 1_300


def test_pattern_strings_have_no_escapes() -> None:
    """Guards against a pattern-constrained string emitting `"` or `\\` raw (breaking the
    JSON) or as escapes (whose decoded characters the pattern was never checked on)."""
    dfa = schema_dfa({"type": "string", "pattern": ".*"})
    assert dfa.matches(b'"any text"')
    for text in ['"a"b"', '"a\\"b"', '"a\\\\b"', '"a\\nb"', '"a\nb"']:
        assert not dfa.matches(text.encode()), text


def test_pattern_escaped_dollar_is_kept() -> None:
    """Guards against stripping an escaped `\\$` at the end as if it were an anchor."""
    dfa = schema_dfa({"type": "string", "pattern": "^[0-9]+\\$$"})
    assert dfa.matches(b'"12$"')
    assert not dfa.matches(b'"12"')
    dfa = schema_dfa({"type": "string", "pattern": "[0-9]+\\$"})
    assert dfa.matches(b'"12$"')
    assert not dfa.matches(b'"12"')


BAD_SCHEMAS = [
    ({"type": "number", "multipleOf": 2}, "keyword 'multipleOf' is not supported"),
    ({"type": "number", "minimum": 0.5}, "must be a whole number"),
    ({"type": "integer", "minimum": "1"}, "'minimum' must be a finite number"),
    ({"type": "integer", "maximum": float("inf")}, "'maximum' must be a finite number"),
    ({"type": "integer", "minimum": 3, "maximum": 2}, "admits no value"),
    ({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 3}, "admits no value"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "admits no value"),
    ({"type": "array", "uniqueItems": True}, "keyword 'uniqueItems' is not supported"),
    ({"type": "object", "patternProperties": {}}, "'patternProperties' is not supported"),
    ({"not": {"type": "string"}}, "keyword 'not' is not supported"),
    ({"if": {}, "then": {}}, "keyword 'if' is not supported"),
    ({"dependentRequired": {}}, "keyword 'dependentRequired' is not supported"),
    ({"type": "object", "minProperties": 1}, "keyword 'minProperties' is not supported"),
    ({"type": "foo"}, "type 'foo' is unknown"),
    ({"type": ["string", "bar"]}, "type 'bar' is unknown"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "names 'b'"),
    ({"$ref": "#/$defs/missing"}, "'#/\\$defs/missing' does not resolve"),
    ({"$ref": "other.json#/x"}, "only local"),
    (3, "must be an object or a boolean"),
    ({"properties": {"a": [1]}}, "must be an object or a boolean"),
    ({"type": "array", "maxItems": 65}, "'maxItems' above 64"),
    ({"type": "string", "maxLength": 257}, "'maxLength' above 256"),
    ({"type": "string", "minLength": -1}, "'minLength' must be a non-negative integer"),
    ({"allOf": [{}, {}]}, "'allOf' with more than one subschema"),
    ({"anyOf": [{}], "type": "string"}, "'anyOf' together with 'type'"),
    ({"$ref": "#", "properties": {}}, "'\\$ref' together with 'properties'"),
    ({"type": "string", "format": "uri"}, "format 'uri' is not supported"),
    ({"type": "string", "pattern": "a", "maxLength": 3}, "together are not supported"),
    ({"enum": [1, 2], "minLength": 1}, "together with 'enum'/'const'"),
    ({"enum": []}, "'enum' must be a non-empty list"),
    ({"type": "array", "items": [{}]}, "'items' as a list"),
    ({"type": "integer", "enum": ["a"]}, "admits no value"),
    (False, "admits no value"),
    (
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        "admits no value",
    ),
]


@pytest.mark.parametrize(("schema", "message"), BAD_SCHEMAS)
def test_schema_errors(schema: Any, message: str) -> None:
    """Guards against silently ignoring a constraint (output that breaks the schema without
    a word) and against invalid schemas compiling to something arbitrary."""
    with pytest.raises(ValueError, match=message):
        schema_node(schema)


def test_annotations_are_ignored() -> None:
    """Guards against refusing schemas for harmless annotations (pydantic emits title,
    description, default, examples, $schema, ...)."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:x",
        "$comment": "c",
        "title": "T",
        "description": "d",
        "examples": [1],
        "default": 1,
        "deprecated": False,
        "readOnly": True,
        "writeOnly": False,
        "x-vendor": {"anything": True},
        "type": "integer",
    }
    dfa = schema_dfa(schema)
    assert dfa.matches(b"12")
    assert not dfa.matches(b'"12"')
