"""JSON Schema string formats as byte-level pattern trees: date, time, date-time, uuid, email.

`{"type": "string", "format": ...}` in a schema (`json_schema_types.py`) becomes `"`, one of
these, `"`. Dates and times follow RFC 3339 as Python's `datetime` parses it (real month
lengths and leap years, no year 0000, no leap second); email is a simple subset of RFC 5322
(dot-separated atoms, no quoted local parts, a domain of two or more labels). Every text
these produce is a valid instance of its format; not every valid instance can be produced.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.runner.structured.json_grammar import DIGIT, HEX, byte_class, times
from pdserve.runner.structured.regex_ast import Node, Repeat, SepRepeat, alt, literal, optional, seq


def _date() -> Node:
    """RFC 3339 full-date YYYY-MM-DD with real month lengths and leap years; no year 0000
    (Python's date, which jsonschema checks with, starts at year 1)."""
    d = DIGIT
    year = alt(
        seq(byte_class("1-9"), d, d, d),
        seq(literal("0"), byte_class("1-9"), d, d),
        seq(literal("00"), byte_class("1-9"), d),
        seq(literal("000"), byte_class("1-9")),
    )
    # Two-digit multiples of 4 other than 00.
    mult4 = alt(
        seq(literal("0"), byte_class("48")),
        seq(byte_class("2468"), byte_class("048")),
        seq(byte_class("13579"), byte_class("26")),
    )
    # Leap: divisible by 4 but not 100 (last two digits a nonzero multiple of 4), or by 400
    # (last two 00 and the century a nonzero multiple of 4: year 0000 does not exist).
    leap_year = alt(seq(d, d, mult4), seq(mult4, literal("00")))
    day28 = alt(
        seq(literal("0"), byte_class("1-9")),
        seq(literal("1"), d),
        seq(literal("2"), byte_class("0-8")),
    )
    day30 = alt(day28, literal("29"), literal("30"))
    day31 = alt(day30, literal("31"))
    month31 = alt(*(literal(m) for m in ("01", "03", "05", "07", "08", "10", "12")))
    month30 = alt(*(literal(m) for m in ("04", "06", "09", "11")))
    return alt(
        seq(
            year,
            literal("-"),
            alt(
                seq(month31, literal("-"), day31),
                seq(month30, literal("-"), day30),
                seq(literal("02-"), day28),
            ),
        ),
        seq(leap_year, literal("-02-29")),
    )


def _time() -> Node:
    """RFC 3339 full-time: HH:MM:SS, optional fraction, then `Z` or a +HH:MM offset (no leap
    second 60, which Python's time does not accept)."""
    hour = alt(seq(byte_class("01"), DIGIT), seq(literal("2"), byte_class("0-3")))
    sixty = seq(byte_class("0-5"), DIGIT)
    fraction = optional(seq(literal("."), Repeat(DIGIT, 1, None)))
    offset = alt(literal("Z"), seq(byte_class("+-"), hour, literal(":"), sixty))
    return seq(hour, literal(":"), sixty, literal(":"), sixty, fraction, offset)


def _uuid() -> Node:
    groups = [times(HEX, n) for n in (8, 4, 4, 4, 12)]
    return seq(*[p for g in groups for p in (literal("-"), g)][1:])


def _email() -> Node:
    """A simple address: dot-separated RFC 5322 atoms, `@`, a domain of two or more labels."""
    atom = Repeat(byte_class("A-Za-z0-9!#$%&'*+/=?^_`{|}~-"), 1, None)
    label = seq(
        byte_class("A-Za-z0-9"),
        optional(seq(Repeat(byte_class("A-Za-z0-9-"), 0, None), byte_class("A-Za-z0-9"))),
    )
    return seq(
        SepRepeat(atom, literal(".")),
        literal("@"),
        label,
        Repeat(seq(literal("."), label), 1, None),
    )


# Format name -> the string content (without the quotes), built on demand.
FORMATS: dict[str, Callable[[], Node]] = {
    "date": _date,
    "time": _time,
    "date-time": lambda: seq(_date(), literal("T"), _time()),
    "uuid": _uuid,
    "email": _email,
}
