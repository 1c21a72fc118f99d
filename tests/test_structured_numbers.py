"""Numeric bounds in JSON schemas (runner/structured/json_numbers.py), checked text by text
against jsonschema: for every schema below, each candidate text the automaton accepts must
validate, and every candidate in the form the grammar promises to produce (integers:
canonical decimals; numbers: decimals without an exponent, no negative zero) that
validates must be accepted. Candidates cover every integer in [-1,200, 1,200] and decimals
around the bounds, so each digit-range branch is crossed."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest

from pdserve.runner.structured.byte_dfa import ByteDFA, compile_dfa
from pdserve.runner.structured.json_schema import schema_node

INTEGERS = [str(i) for i in range(-1200, 1201)]
INTEGER_ODDITIES = ["-0", "007", "1.0", "1e2", "+5", "--1", "0-"]
DECIMALS = (
    [
        f"{sign}{whole}.{fraction}"
        for sign, whole, fraction in itertools.product(
            ("", "-"), range(0, 13), ("0", "00", "5", "05", "50", "001", "999")
        )
    ]
    + [str(i) for i in range(-130, 131)]
    + ["-0", "-0.0", "1e1", "0.5e1", "1E0", ".5", "5."]
)

INTEGER_SCHEMAS = [
    {"minimum": 0},
    {"minimum": 1},
    {"minimum": 17},
    {"minimum": -5},
    {"minimum": -1000},
    {"maximum": 0},
    {"maximum": 99},
    {"maximum": -100},
    {"minimum": 0, "maximum": 0},
    {"minimum": 1, "maximum": 12},
    {"minimum": 10, "maximum": 1000},
    {"minimum": 123, "maximum": 987},
    {"minimum": -37, "maximum": 451},
    {"minimum": -999, "maximum": -10},
    {"minimum": 250, "maximum": 250},
    {"exclusiveMinimum": 0},
    {"exclusiveMinimum": -1, "exclusiveMaximum": 100},
    {"exclusiveMaximum": -9},
    {"minimum": 0.5, "maximum": 10.5},
    {"minimum": -2.5, "exclusiveMaximum": 7.0},
    {"minimum": 3, "exclusiveMinimum": 3},  # the tighter: > 3
    {"maximum": 50, "exclusiveMaximum": 60},  # the tighter: <= 50
]

NUMBER_SCHEMAS = [
    {"minimum": 0},
    {"exclusiveMinimum": 0},
    {"minimum": 0, "maximum": 1},
    {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"minimum": -5, "maximum": 5},
    {"minimum": -3, "exclusiveMaximum": 0},
    {"exclusiveMaximum": 0},
    {"maximum": -2},
    {"minimum": 7, "maximum": 7},
    {"minimum": 2, "maximum": 11},
    {"minimum": -12, "exclusiveMaximum": -3},
    {"exclusiveMinimum": 9},
]


def _dfa(schema: dict) -> ByteDFA:
    return compile_dfa(schema_node(schema))


def _valid(validator, text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return validator.is_valid(value)


def _check(schema: dict, candidates: list[str], promised, draft=jsonschema.Draft202012Validator):
    dfa, validator = _dfa(schema), draft(schema)
    accepted = 0
    for text in candidates:
        got = dfa.matches(text.encode())
        valid = _valid(validator, text)
        if got:
            accepted += 1
            assert valid, (schema, text, "accepted but invalid")
        elif promised(text):
            assert not valid, (schema, text, "valid but refused")
    return accepted


def _canonical_integer(text: str) -> bool:
    return re.fullmatch(r"-?(0|[1-9][0-9]*)", text) is not None and text != "-0"


def _plain_decimal(text: str) -> bool:
    if re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", text) is None:
        return False
    return not (text.startswith("-") and float(text) == 0)


@pytest.mark.parametrize("bounds", INTEGER_SCHEMAS, ids=str)
def test_integer_bounds_are_exact(bounds):
    """Guards integer ranges: exactly the canonical integers in range, nothing outside it
    (a fraction, an exponent, `-0` and leading zeros are never made)."""
    schema = {"type": "integer", **bounds}
    accepted = _check(schema, INTEGERS + INTEGER_ODDITIES, _canonical_integer)
    assert accepted > 0
    assert not any(_dfa(schema).matches(t.encode()) for t in ("-0", "007", "1.0", "1e2"))


@pytest.mark.parametrize("bounds", NUMBER_SCHEMAS, ids=str)
def test_number_bounds_are_exact(bounds):
    """Guards number ranges: every decimal without an exponent in range (fractions right
    at a strict bound are refused, `.0` at an inclusive top is taken), nothing outside."""
    schema = {"type": "number", **bounds}
    assert _check(schema, DECIMALS, _plain_decimal) > 0


def test_draft4_boolean_exclusive_bounds_make_the_plain_ones_strict():
    """Guards draft 4's form (`exclusiveMinimum: true` beside `minimum`), which pydantic v1
    and older OpenAPI tools still write."""
    draft = jsonschema.Draft4Validator
    for bounds in ({"minimum": 0, "exclusiveMinimum": True},
                   {"minimum": -4, "maximum": 4, "exclusiveMaximum": True},
                   {"minimum": 2, "exclusiveMinimum": False}):  # fmt: skip
        _check({"type": "integer", **bounds}, INTEGERS, _canonical_integer, draft)
        _check({"type": "number", **bounds}, DECIMALS, _plain_decimal, draft)


def test_int64_bounds_stay_small():
    """Guards the common int64 range: its ends are exact at 19 digits and the automaton
    stays small (digit by digit, not one state per number)."""
    schema = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    dfa = _dfa(schema)
    assert dfa.matches(b"9223372036854775807") and not dfa.matches(b"9223372036854775808")
    assert dfa.matches(b"-9223372036854775808") and not dfa.matches(b"-9223372036854775809")
    assert not dfa.matches(b"10000000000000000000") and dfa.matches(b"999999999999999999")
    assert dfa.num_states < 200, dfa.num_states


def test_bounds_inside_an_object_and_implied_type():
    """Guards bounds where tool schemas put them: on properties, and `minimum` alone
    meaning a number (JSON Schema applies it to numbers only)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
              "maximum": 5}, "x": {"minimum": 0}}, "required": ["n", "x"]}  # fmt: skip
    dfa = _dfa(schema)
    assert dfa.matches(b'{"n": 3, "x": 0.25}') and dfa.matches(b'{"n":5,"x":12}')
    assert not dfa.matches(b'{"n": 0, "x": 1}') and not dfa.matches(b'{"n": 6, "x": 1}')
    assert not dfa.matches(b'{"n": 3, "x": -1}') and not dfa.matches(b'{"n": 3, "x": "a"}')
