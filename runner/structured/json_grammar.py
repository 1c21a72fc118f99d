"""JSON text as byte-level pattern trees (`regex_ast`): the lexical pieces and any JSON value.

JSON mode (OpenAI's `response_format: json_object`) is `json_object_node`; the schema
compiler (`json_schema.py`) builds on the same pieces (strings, numbers, literals,
containers), so both agree on what JSON text looks like. A DFA has no stack, so nesting
is bounded:

- `json_value_node(d)` / `json_object_node(d)`: containers nest at most `d` deep (depth 1 =
  an object or array whose members are scalars). Each level is one copy of the value
  automaton; comma-separated members use `SepRepeat`, so the tree stays linear in `d`.

The automaton of an open value doubles with each level (after a member it must remember
whether each enclosing container is an object or an array): depth 4 is ~1,700 DFA states,
depth 8 ~28,000, past the 20,000 `compile_dfa` allows, hence `json_schema.OPEN_MAX_DEPTH`
and JSON mode's depth of 4.

Whitespace: at most one space, and only after `{`, `[`, `:`, `,` and before `}`, `]`; none
before `:` or `,` and none around the top-level value. Compact and "one space" renderings
(`json.dumps(..., separators=(", ", ": "))`) are accepted, and a small model cannot loop
on whitespace forever.

Digit runs (`[0-9]*` in integers, fractions, exponents) and string lengths are unbounded
unless the schema bounds them: the request's max_tokens ends a runaway.

Strings are `"`, then code points other than `"`, `\\` and U+0000..U+001F, or the escapes
`\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX`, then `"`. A `\\u` escape never encodes a lone
surrogate: a high surrogate escape must be followed by a low one, and the pair counts as
one character, so every output decodes and `minLength`/`maxLength` count code points the
way JSON Schema does.
"""

from __future__ import annotations

import functools

from pdserve.runner.structured.charsets import char_class
from pdserve.runner.structured.regex_ast import (
    ByteSet,
    Node,
    Repeat,
    SepRepeat,
    alt,
    literal,
    optional,
    seq,
)


def byte_class(spec: str) -> ByteSet:
    """One ASCII byte out of a class written like a regex class body: `"0-9a-fA-F"`."""
    values: set[int] = set()
    i = 0
    while i < len(spec):
        if i + 2 < len(spec) and spec[i + 1] == "-":
            values.update(range(ord(spec[i]), ord(spec[i + 2]) + 1))
            i += 3
        else:
            values.add(ord(spec[i]))
            i += 1
    return ByteSet(frozenset(values))


def times(item: Node, n: int) -> Node:
    return Repeat(item, n, n)


WS = optional(literal(" "))
COMMA = seq(literal(","), WS)
DIGIT = byte_class("0-9")
HEX = byte_class("0-9a-fA-F")


def _string_char() -> Node:
    """One JSON string character: a raw code point or an escape, always one code point."""
    # Raw: anything but `"` (0x22), `\` (0x5C) and the controls JSON requires escaped.
    raw = char_class([(0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF)])
    non_surrogate = alt(
        seq(byte_class("0-9a-cA-Ce-fE-F"), times(HEX, 3)),
        seq(byte_class("dD"), byte_class("0-7"), times(HEX, 2)),
    )
    high = seq(byte_class("dD"), byte_class("89abAB"), times(HEX, 2))
    low = seq(byte_class("dD"), byte_class("c-fC-F"), times(HEX, 2))
    escape = seq(
        literal("\\"),
        alt(
            byte_class('"\\\\/bfnrt'),
            seq(literal("u"), non_surrogate),
            # A surrogate pair is one character; a lone surrogate does not decode.
            seq(literal("u"), high, literal("\\u"), low),
        ),
    )
    return alt(raw, escape)


CHAR = _string_char()
STRING = seq(literal('"'), Repeat(CHAR, 0, None), literal('"'))
_INT_PART = alt(literal("0"), seq(byte_class("1-9"), Repeat(DIGIT, 0, None)))
INTEGER = seq(optional(literal("-")), _INT_PART)
NUMBER = seq(
    INTEGER,
    optional(seq(literal("."), Repeat(DIGIT, 1, None))),
    optional(seq(byte_class("eE"), optional(byte_class("+-")), Repeat(DIGIT, 1, None))),
)
BOOLEAN = alt(literal("true"), literal("false"))
NULL = literal("null")
_SCALAR = alt(STRING, NUMBER, BOOLEAN, NULL)


def container(open_: str, items: Node, close: str, may_be_empty: bool = True) -> Node:
    """`open_ items close` with the optional spaces inside; `items` is never empty text."""
    body = seq(items, WS)
    return seq(literal(open_), WS, optional(body) if may_be_empty else body, literal(close))


def object_of_any_keys(value: Node) -> Node:
    return container("{", SepRepeat(seq(STRING, literal(":"), WS, value), COMMA), "}")


def array_of(value: Node) -> Node:
    return container("[", SepRepeat(value, COMMA), "]")


@functools.lru_cache(maxsize=64)
def json_value_node(max_depth: int) -> Node:
    """Any JSON value whose containers nest at most `max_depth` deep (0 = scalars only)."""
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    value = _SCALAR
    for _ in range(max_depth):
        # Each level wraps the previous one: linear in depth since members use SepRepeat.
        value = alt(_SCALAR, object_of_any_keys(value), array_of(value))
    return value


def json_object_node(max_depth: int = 4) -> Node:
    """JSON mode: a JSON object (never a bare array or scalar) nested at most `max_depth`
    deep, its members any JSON values."""
    if max_depth < 1:
        raise ValueError(f"JSON mode needs max_depth >= 1 (the object itself), got {max_depth}")
    return object_of_any_keys(json_value_node(max_depth - 1))
