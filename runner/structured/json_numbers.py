"""JSON Schema's numeric bounds (`minimum`, `maximum`, `exclusiveMinimum`,
`exclusiveMaximum`) as byte-level pattern trees: the decimal texts of the numbers in range.

A range of whole numbers is a regular language: for each digit count, the texts between
the range's ends at that count, built digit by digit (the first digit below the high
end's leaves the rest free, and so on). What is stricter than JSON Schema (the output is
always valid, but not every valid text can be produced):

- `integer` with bounds: canonical decimals only (no `-0`, no leading zeros, no fraction
  or exponent); any numeric bound is taken (`minimum: 0.5` means from 1).
- `number` with bounds: decimals without an exponent; the bounds must be whole numbers
  (`minimum: 0`, `exclusiveMaximum: 100`), otherwise the schema is refused (ValueError).
- Draft 4's boolean `exclusiveMinimum`/`exclusiveMaximum` (making `minimum`/`maximum`
  strict) is read too; where both forms bound one side, the tighter bound holds.
"""

from __future__ import annotations

import math
from typing import Any

from pdserve.runner.structured.json_grammar import DIGIT, INTEGER, NUMBER, byte_class, times
from pdserve.runner.structured.regex_ast import NOTHING, Node, Repeat, alt, is_empty, literal, seq

NUMERIC_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})

Bound = tuple[float, bool]  # (value, strict)

_ANY_FRACTION = Repeat(seq(literal("."), Repeat(DIGIT, 1, None)), 0, 1)
_ZERO_FRACTION = Repeat(seq(literal("."), Repeat(literal("0"), 1, None)), 0, 1)
_NONZERO_FRACTION = seq(
    literal("."), Repeat(DIGIT, 0, None), byte_class("1-9"), Repeat(DIGIT, 0, None)
)


def integer_node(schema: dict) -> Node:
    """The texts of the integers `schema`'s bounds allow (any integer without bounds)."""
    low, high = _bounds(schema)
    if low is None and high is None:
        return INTEGER
    lo = None if low is None else math.floor(low[0]) + 1 if low[1] else math.ceil(low[0])
    hi = None if high is None else math.ceil(high[0]) - 1 if high[1] else math.floor(high[0])
    if lo is not None and hi is not None and lo > hi:
        return NOTHING
    parts = []
    if hi is None or hi >= 0:
        parts.append(_naturals(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        top = -1 if hi is None else min(hi, -1)
        parts.append(seq(literal("-"), _naturals(-top, None if lo is None else -lo)))
    return alt(*parts)


def number_node(schema: dict) -> Node:
    """The texts of the numbers `schema`'s whole-number bounds allow (any JSON number
    without bounds)."""
    low, high = _bounds(schema)
    if low is None and high is None:
        return NUMBER
    for name, bound in (("minimum", low), ("maximum", high)):
        if bound is not None and not float(bound[0]).is_integer():
            raise ValueError(
                f"a JSON schema bound ({name} side, {bound[0]!r}) on a 'number' must be a "
                "whole number here ('integer' takes any bound)"
            )
    lo = None if low is None else (int(low[0]), low[1])
    hi = None if high is None else (int(high[0]), high[1])
    parts = []
    reaches_zero = hi is None or hi[0] > 0 or hi == (0, False)
    if reaches_zero:  # the values >= 0
        parts.append(_decimals(lo if lo is not None and lo[0] >= 0 else (0, False), hi))
    if lo is None or lo[0] < 0:  # the values < 0, as '-' and their absolute value
        above = (0, False) if reaches_zero else (-hi[0], hi[1])
        below = None if lo is None else (-lo[0], lo[1])
        parts.append(seq(literal("-"), _decimals(above, below)))
    parts = [p for p in parts if not is_empty(p)]
    return alt(*parts) if parts else NOTHING


def _bounds(schema: dict) -> tuple[Bound | None, Bound | None]:
    """The lower and upper bound the schema sets, each (value, strict), the tighter one
    where two keywords bound a side."""
    for key in NUMERIC_KEYWORDS & schema.keys():
        value = schema[key]
        draft4 = key.startswith("exclusive") and isinstance(value, bool)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (draft4 or (number and math.isfinite(value))):
            raise ValueError(f"JSON schema '{key}' must be a finite number, got {value!r}")
    low = _tighter(schema, "minimum", "exclusiveMinimum", max)
    high = _tighter(schema, "maximum", "exclusiveMaximum", min)
    return low, high


def _tighter(schema: dict, plain: str, exclusive: str, pick: Any) -> Bound | None:
    """One side's bound: `plain` (strict when draft 4's boolean `exclusive` is true) and
    the numeric `exclusive`; of both, the one `pick` (max for the low side, min for the
    high side) chooses, a strict bound winning a tie."""
    candidates: list[Bound] = []
    flag = schema.get(exclusive)
    if plain in schema:
        candidates.append((schema[plain], flag is True))
    if exclusive in schema and not isinstance(flag, bool):
        candidates.append((flag, True))
    if not candidates:
        return None
    best = pick(c[0] for c in candidates)
    return best, any(strict for value, strict in candidates if value == best)


def _naturals(a: int, b: int | None) -> Node:
    """Canonical decimals (no leading zeros) of the integers in [a, b]; b None: no end."""
    parts = []
    last = len(str(a)) if b is None else len(str(b))
    for n in range(len(str(a)), last + 1):
        lo = max(a, 10 ** (n - 1) if n > 1 else 0)
        hi = 10**n - 1 if b is None else min(b, 10**n - 1)
        if lo <= hi:
            parts.append(_same_length(str(lo), str(hi)))
    if b is None:  # every longer number
        parts.append(seq(byte_class("1-9"), Repeat(DIGIT, last, None)))
    return alt(*parts) if parts else NOTHING


def _same_length(lo: str, hi: str) -> Node:
    """The digit strings of lo's length from lo to hi (lo <= hi, both that long). Linear
    in the length: a side whose remaining digits are all free (lo's zeros, hi's nines)
    joins the middle digits' branch instead of recursing."""
    if lo == hi:
        return literal(lo)
    first, last, rest = lo[0], hi[0], len(lo) - 1
    if first == last:
        return seq(literal(first), _same_length(lo[1:], hi[1:]))
    low_free, high_free = set(lo[1:]) <= {"0"}, set(hi[1:]) <= {"9"}
    parts = []
    if not low_free:
        parts.append(seq(literal(first), _same_length(lo[1:], "9" * rest)))
    middle_lo = first if low_free else chr(ord(first) + 1)
    middle_hi = last if high_free else chr(ord(last) - 1)
    if middle_lo <= middle_hi:
        digits = byte_class(f"{middle_lo}-{middle_hi}")
        parts.append(seq(digits, times(DIGIT, rest)) if rest else digits)
    if not high_free:
        parts.append(seq(literal(last), _same_length("0" * rest, hi[1:])))
    return alt(*parts)


def _decimals(low: tuple[int, bool], high: tuple[int, bool] | None) -> Node:
    """Decimal texts (no sign, no exponent) of the numbers x >= 0 within whole-number
    bounds: x > a (strict) or x >= a, and x < b or x <= b (high None: no end)."""
    a, a_strict = low
    if high is not None:
        b, b_strict = high
        if a > b or (a == b and (a_strict or b_strict)):
            return NOTHING
        if a == b:
            return seq(_naturals(a, a), _ZERO_FRACTION)
    parts = [seq(_naturals(a, a), _NONZERO_FRACTION if a_strict else _ANY_FRACTION)]
    middle_end = None if high is None else high[0] - 1
    if middle_end is None or a + 1 <= middle_end:
        parts.append(seq(_naturals(a + 1, middle_end), _ANY_FRACTION))
    if high is not None and not high[1]:
        parts.append(seq(_naturals(high[0], high[0]), _ZERO_FRACTION))
    return alt(*parts)
