"""The keywords of JSON Schema's string, array and object types as byte-level pattern trees.

`json_schema.py` resolves a schema down to its types and hands each one here together with
`sub`, which compiles a subschema one container deeper (it carries the `$ref` stack and the
depth budget, so this module never sees them). What is stricter than JSON Schema (the
output is always valid, but not every valid text can be produced):

- objects: declared `properties` appear in declared order, the `required` ones always,
  the others optionally; undeclared properties are never emitted, whatever
  `additionalProperties` says. Without `properties`: any string keys (duplicates are not
  prevented), values per `additionalProperties` (any value when absent or true, `{}`
  when false).
- arrays: `items` (one schema), `prefixItems`, `minItems`/`maxItems` (at most 64 each:
  every allowed count is a copy of the element automaton).
- strings: `minLength`/`maxLength` (at most 256 each), `format` (date, time, date-time,
  uuid, email: `json_formats.py`), `pattern` (at most one of these three groups per
  schema). `pattern` is a search in JSON Schema; here it must match the whole string
  content (`^` and `$` at its ends are allowed and change nothing), which implies the
  search: `"a"` only yields `a`. The pattern applies to the decoded characters, so
  pattern-constrained strings are emitted without escapes: characters that JSON must
  escape (`"`, `\\`, controls) never appear in them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pdserve.runner.structured.json_formats import FORMATS
from pdserve.runner.structured.json_grammar import CHAR, COMMA, WS, container, object_of_any_keys
from pdserve.runner.structured.regex_ast import (
    EMPTY,
    NOTHING,
    Alt,
    ByteSet,
    Node,
    Repeat,
    SepRepeat,
    Seq,
    alt,
    is_empty,
    literal,
    optional,
    seq,
)
from pdserve.runner.structured.regex_parse import parse_regex

MAX_ITEMS_BOUND = 64
MAX_LENGTH_BOUND = 256

# Compiles a subschema for a value one container deeper than the one being built.
SubSchema = Callable[[Any], Node]

# Bytes a JSON string may not hold raw: `"`, `\` and U+0000..U+001F. They are single-byte
# characters in UTF-8 (never inside a multi-byte one), so banning the bytes bans the characters.
_MUST_ESCAPE = frozenset({0x22, 0x5C, *range(0x20)})


def _bound(schema: dict, key: str, limit: int) -> int | None:
    """`schema[key]` as a count in 0..limit, None when absent."""
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"JSON schema '{key}' must be a non-negative integer, got {value!r}")
    if value > limit:
        raise ValueError(f"JSON schema '{key}' above {limit} is not supported (got {value})")
    return value


def _without_bytes(node: Node, banned: frozenset[int]) -> Node:
    """`node` restricted to texts that contain none of the `banned` bytes.

    Exact because a text is matched byte by byte, each byte by one ByteSet: removing the
    banned bytes from every ByteSet removes exactly the texts that use one.
    """
    if isinstance(node, ByteSet):
        kept = node.values - banned
        return ByteSet(kept) if kept else NOTHING
    if isinstance(node, Seq):
        return Seq(tuple(_without_bytes(i, banned) for i in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_without_bytes(o, banned) for o in node.options))
    if isinstance(node, Repeat):
        return Repeat(_without_bytes(node.item, banned), node.min, node.max)
    return SepRepeat(_without_bytes(node.item, banned), _without_bytes(node.sep, banned))


def string_node(schema: dict) -> Node:
    used = [k for k in ("format", "pattern") if k in schema]
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    if len(used) + (1 if lengths else 0) > 1:
        names = ", ".join(repr(k) for k in used + lengths)
        raise ValueError(f"JSON schema string keywords {names} together are not supported")
    if "format" in schema:
        fmt = schema["format"]
        if fmt not in FORMATS:
            raise ValueError(f"JSON schema string format {fmt!r} is not supported")
        return seq(literal('"'), FORMATS[fmt](), literal('"'))
    if "pattern" in schema:
        return seq(literal('"'), _pattern(schema["pattern"]), literal('"'))
    lo = _bound(schema, "minLength", MAX_LENGTH_BOUND) or 0
    hi = _bound(schema, "maxLength", MAX_LENGTH_BOUND)
    if hi is not None and lo > hi:
        return NOTHING
    return seq(literal('"'), Repeat(CHAR, lo, hi), literal('"'))


def _pattern(pattern: Any) -> Node:
    if not isinstance(pattern, str):
        raise ValueError(f"JSON schema 'pattern' must be a string, got {pattern!r}")
    try:
        # parse_regex matches the whole text and takes `^`/`$` at the ends as no-ops.
        node = parse_regex(pattern)
    except ValueError as exc:
        raise ValueError(f"JSON schema 'pattern' {pattern!r}: {exc}") from exc
    return _without_bytes(node, _MUST_ESCAPE)


def array_node(schema: dict, sub: SubSchema) -> Node:
    items = schema.get("items", True)
    if isinstance(items, list):
        raise ValueError(
            "JSON schema 'items' as a list (the draft-07 tuple form) is not supported; "
            "use 'prefixItems'"
        )
    prefix_schemas = schema.get("prefixItems", [])
    if not isinstance(prefix_schemas, list):
        raise ValueError("JSON schema 'prefixItems' must be a list of schemas")
    lo = _bound(schema, "minItems", MAX_ITEMS_BOUND) or 0
    hi = _bound(schema, "maxItems", MAX_ITEMS_BOUND)
    prefix: list[Node] = []
    for s in prefix_schemas:
        node = sub(s)
        if is_empty(node):
            # No value fits here, so the array cannot reach this position.
            hi = len(prefix) if hi is None else min(hi, len(prefix))
            break
        prefix.append(node)
    rest = NOTHING if (hi is not None and hi <= len(prefix)) else sub(items)
    if is_empty(rest):
        hi = len(prefix) if hi is None else min(hi, len(prefix))
    if hi is not None and lo > hi:
        return NOTHING
    if hi == 0:
        return container("[", NOTHING, "]")

    def after(i: int) -> Node:
        """Elements from index i on, each after a comma, once i elements are written."""
        if hi is not None and i >= hi:
            return EMPTY
        if i < len(prefix):
            piece = seq(COMMA, prefix[i], after(i + 1))
            return piece if i < lo else optional(piece)
        return Repeat(seq(COMMA, rest), max(0, lo - i), None if hi is None else hi - i)

    if prefix:
        elements = seq(prefix[0], after(1))
    elif hi is None and lo <= 1:
        elements = SepRepeat(rest, COMMA)  # the element automaton once
    else:
        elements = seq(rest, after(1))
    return container("[", elements, "]", may_be_empty=lo == 0)


def object_node(schema: dict, sub: SubSchema) -> Node:
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError("JSON schema 'properties' must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError("JSON schema 'required' must be a list of property names")
    for name in required:
        if name not in properties:
            raise ValueError(f"JSON schema 'required' names {name!r}, which is not in 'properties'")
    additional = schema.get("additionalProperties", True)
    if not properties:
        value = NOTHING if additional is False else sub(additional)
        if is_empty(value):
            return container("{", NOTHING, "}")  # only the empty object
        return object_of_any_keys(value)
    members: list[tuple[Node, bool]] = []
    for name, member_schema in properties.items():
        value = sub(member_schema)
        is_required = name in required
        if is_empty(value):
            if is_required:
                return NOTHING
            continue  # an optional property no value fits is left out
        key = literal(json.dumps(name, ensure_ascii=False))
        members.append((seq(key, literal(":"), WS, value), is_required))
    return _ordered_members(members)


def _ordered_members(members: list[tuple[Node, bool]]) -> Node:
    """An object of `members` in their order, required ones present, optional ones maybe.

    A comma goes between two written members, so whether a member needs one depends on
    whether any came before: the first written member is chosen explicitly (any optional
    one before the first required one), and from there on every member is `, member`.
    That costs one copy of the tail per leading optional member (quadratic in the worst
    case, all optional), but each piece stays a plain sequence.
    """
    pieces = [seq(COMMA, node) if req else optional(seq(COMMA, node)) for node, req in members]
    firsts: list[Node] = []
    all_optional = True
    for j, (node, req) in enumerate(members):
        firsts.append(Seq((node, *pieces[j + 1 :])))
        if req:
            all_optional = False
            break
    if not firsts:
        return container("{", NOTHING, "}")  # no property can be written
    return container("{", alt(*firsts), "}", may_be_empty=all_optional)
