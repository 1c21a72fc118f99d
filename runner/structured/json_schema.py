"""JSON schemas as byte-level pattern trees (`regex_ast`), for `byte_dfa.compile_dfa`.

OpenAI's `response_format: json_schema` and vLLM's `guided_json` constrain an output to
JSON text valid against a schema; `schema_node(schema, max_depth)` turns the schema into
the tree of those texts. This module handles the schema document: which keywords are
allowed, `type`, `enum`/`const`, the combinators and `$ref`. The keywords of the string,
array and object types are `json_schema_types.py`; the JSON text itself (whitespace,
strings, numbers, any value) is `json_grammar.py`.

A DFA has no stack, so every construct that nests is bounded. A `$ref` that recurses is
expanded while the value it stands for is less than `max_depth` containers deep, and below
that the recursing alternative is dropped (a schema with nothing left raises ValueError).
The parts the schema leaves open (`true`, `{}`, objects without `properties`) are JSON
values nested at most `OPEN_MAX_DEPTH` (4) deep, and never past `max_depth` counted from
the top-level value: an open value's automaton doubles with each level (see
`json_grammar.py`), ~28,000 DFA states at depth 8, past the 20,000 `compile_dfa` allows.

Schema support, and what is stricter than JSON Schema (the output is always valid, but not
every valid text can be produced):

- `type` (one or a list), `enum`, `const`: values emitted as compact `json.dumps` text (only
  `type` may sit beside `enum`/`const`). `integer` emits no fraction (`1.0` is never made).
  Without `type`, the keywords imply it (`properties` an object, `items` an array,
  `pattern` a string, `minimum` a number, ...); with none of those, any JSON value.
- numbers, integers: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`; see
  `json_numbers.py`.
- objects, arrays, strings: see `json_schema_types.py`.
- `anyOf` and `oneOf` are alternatives; `oneOf`'s "exactly one" is not enforced, so with
  overlapping branches the output may match several. `allOf` only with one subschema.
- `$ref`: local JSON pointers only (`#`, `#/$defs/...`, `#/definitions/...`, ...). `$ref`,
  `anyOf`, `oneOf` and `allOf` take no sibling keywords other than annotations.
- Annotations are ignored (title, description, examples, default, `$schema`, ...,
  extension keywords `x-...`); any other keyword raises ValueError rather than being
  ignored, since ignoring a constraint would produce output that breaks the schema.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from pdserve.runner.structured.json_grammar import BOOLEAN, NULL, json_value_node
from pdserve.runner.structured.json_numbers import NUMERIC_KEYWORDS, integer_node, number_node
from pdserve.runner.structured.json_schema_types import array_node, object_node, string_node
from pdserve.runner.structured.regex_ast import NOTHING, Node, alt, is_empty, literal

# Nesting allowed inside a value the schema leaves open (see the module docstring).
OPEN_MAX_DEPTH = 4

# Ignored: they describe values but do not constrain them. `$defs`/`definitions` only hold
# subschemas for `$ref`; `discriminator` (OpenAPI) restates what the oneOf branches enforce.
ANNOTATION_KEYWORDS = frozenset(
    {
        "title",
        "description",
        "examples",
        "default",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$defs",
        "definitions",
        "$anchor",
        "discriminator",
        "contentEncoding",
        "contentMediaType",
    }
)
_COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
_ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems"})
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties"})
_VALUE_KEYWORDS = frozenset({"type", "enum", "const"})
SUPPORTED_KEYWORDS = (
    (frozenset(_COMBINATORS) | _STRING_KEYWORDS | _ARRAY_KEYWORDS | _OBJECT_KEYWORDS)
    | _VALUE_KEYWORDS
    | NUMERIC_KEYWORDS
)
JSON_TYPES = ("string", "integer", "number", "boolean", "null", "array", "object")


def _compact(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"JSON schema enum/const value {value!r} is not JSON: {exc}") from exc


def _has_type(value: Any, type_: str) -> bool:
    """JSON Schema's type test for a decoded value (bool is not a number; 1.0 is an integer)."""
    if type_ == "null":
        return value is None
    if type_ == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if type_ == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if type_ == "number":
        return isinstance(value, (int, float))
    if type_ == "string":
        return isinstance(value, str)
    if type_ == "array":
        return isinstance(value, list)
    return isinstance(value, dict)


class _SchemaCompiler:
    """One schema document: resolves `$ref`s against `root`, bounds recursion by `max_depth`."""

    def __init__(self, root: dict | bool, max_depth: int) -> None:
        self.root = root
        self.max_depth = max_depth

    def free(self, depth: int) -> Node:
        """Any JSON value at value depth `depth` (containers around it): the rest of the
        nesting budget up to OPEN_MAX_DEPTH, scalars only once the declared structure has
        used it up."""
        return json_value_node(max(0, min(OPEN_MAX_DEPTH, self.max_depth - depth)))

    def value(self, schema: Any, depth: int, stack: tuple[tuple[str, int], ...]) -> Node:
        """The texts of `schema` for a value inside `depth` containers; `stack` holds the
        `$ref`s being expanded around it, with the depth each was met at."""
        if schema is True:
            return self.free(depth)
        if schema is False:
            return NOTHING
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object or a boolean, got {schema!r}")
        for key in schema:
            if not (
                key in SUPPORTED_KEYWORDS or key in ANNOTATION_KEYWORDS or key.startswith("x-")
            ):
                raise ValueError(f"JSON schema keyword {key!r} is not supported")
        constraints = [k for k in schema if k in SUPPORTED_KEYWORDS]
        combinators = [k for k in constraints if k in _COMBINATORS]
        if combinators:
            if len(constraints) > 1:
                others = ", ".join(repr(k) for k in constraints if k != combinators[0])
                raise ValueError(
                    f"JSON schema keyword {combinators[0]!r} together with {others} "
                    "is not supported"
                )
            return self.combinator(combinators[0], schema[combinators[0]], depth, stack)
        types = self.types(schema)
        if "enum" in schema or "const" in schema:
            return self.enum(schema, types)
        if types is None:
            return self.free(depth)
        options = [n for n in (self.typed(t, schema, depth, stack) for t in types)]
        options = [n for n in options if not is_empty(n)]  # e.g. minLength > maxLength
        return alt(*options) if options else NOTHING

    def combinator(
        self, key: str, arg: Any, depth: int, stack: tuple[tuple[str, int], ...]
    ) -> Node:
        if key == "$ref":
            return self.ref(arg, depth, stack)
        if not isinstance(arg, list) or not arg:
            raise ValueError(f"JSON schema '{key}' must be a non-empty list of schemas")
        if key == "allOf":
            if len(arg) != 1:
                raise ValueError(
                    "JSON schema 'allOf' with more than one subschema is not supported"
                )
            return self.value(arg[0], depth, stack)
        # Impossible branches (a recursion cut off, a `false`) are dropped.
        options = [n for n in (self.value(s, depth, stack) for s in arg) if not is_empty(n)]
        return alt(*options) if options else NOTHING

    def ref(self, ref: Any, depth: int, stack: tuple[tuple[str, int], ...]) -> Node:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise ValueError(
                f"JSON schema $ref {ref!r} is not supported: only local '#/...' pointers are"
            )
        if (ref, depth) in stack:
            # Back at the same ref without entering a container: that branch only restates
            # the language being defined (X = X | ...), so it adds no text.
            return NOTHING
        if depth >= self.max_depth and any(r == ref for r, _ in stack):
            return NOTHING  # a recursion past the depth budget: that branch is cut
        return self.value(self.resolve(ref), depth, (*stack, (ref, depth)))

    def resolve(self, ref: str) -> Any:
        target: Any = self.root
        for raw in ref[2:].split("/") if ref != "#" else []:
            token = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                raise ValueError(f"JSON schema $ref {ref!r} does not resolve")
        return target

    def types(self, schema: dict) -> list[str] | None:
        """The types the schema allows: declared, else implied by its keywords, else None
        (any type)."""
        if "type" in schema:
            declared = schema["type"]
            types = [declared] if isinstance(declared, str) else declared
            if not isinstance(types, list) or not types:
                raise ValueError(f"JSON schema 'type' must be a name or a list, got {declared!r}")
            for t in types:
                if t not in JSON_TYPES:
                    raise ValueError(f"JSON schema type {t!r} is unknown")
            return list(dict.fromkeys(types))
        implied = [
            t
            for t, keywords in (
                ("string", _STRING_KEYWORDS),
                ("array", _ARRAY_KEYWORDS),
                ("object", _OBJECT_KEYWORDS),
                ("number", NUMERIC_KEYWORDS),
            )
            if keywords & schema.keys()
        ]
        # Without `type` a non-string value also passes `pattern`, but whoever wrote a
        # pattern wants a string: the implied types are a valid (smaller) choice.
        return implied or None

    def enum(self, schema: dict, types: list[str] | None) -> Node:
        others = [k for k in schema if k in SUPPORTED_KEYWORDS - _VALUE_KEYWORDS]
        if others:
            raise ValueError(
                f"JSON schema keyword {others[0]!r} together with 'enum'/'const' is not supported"
            )
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise ValueError("JSON schema 'enum' must be a non-empty list")
        else:
            values = [schema["const"]]
        texts = {_compact(v): v for v in values}
        if "const" in schema and "enum" in schema:
            const = _compact(schema["const"])
            texts = {t: v for t, v in texts.items() if t == const}
        if types is not None:
            texts = {t: v for t, v in texts.items() if any(_has_type(v, ty) for ty in types)}
        return alt(*(literal(t) for t in texts)) if texts else NOTHING

    def typed(
        self, type_: str, schema: dict, depth: int, stack: tuple[tuple[str, int], ...]
    ) -> Node:
        if type_ == "string":
            return string_node(schema)
        if type_ == "integer":
            return integer_node(schema)
        if type_ == "number":
            return number_node(schema)
        if type_ == "boolean":
            return BOOLEAN
        if type_ == "null":
            return NULL

        # A container's members and elements are one level deeper, under the same `$ref`s.
        def sub(subschema: Any) -> Node:
            return self.value(subschema, depth + 1, stack)

        return array_node(schema, sub) if type_ == "array" else object_node(schema, sub)


def schema_node(schema: dict | bool, max_depth: int = 8) -> Node:
    """The JSON texts valid against `schema` (see the module docstring for what is
    supported and where the output is stricter than the schema).

    `max_depth` bounds recursive `$ref`s and, with OPEN_MAX_DEPTH, the nesting of the
    parts the schema leaves open. Raises ValueError for an invalid or unsupported schema,
    or one that admits nothing this grammar can produce.
    """
    if not isinstance(schema, (dict, bool)):
        raise ValueError(
            f"a JSON schema must be an object or a boolean, got {type(schema).__name__}"
        )
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    # The root is on the stack from the start, so `{"$ref": "#"}` inside it counts as recursion.
    node = _SchemaCompiler(schema, max_depth).value(schema, 0, (("#", 0),))
    if is_empty(node):
        raise ValueError("the JSON schema admits no value that can be generated")
    return node


__all__ = ["OPEN_MAX_DEPTH", "schema_node"]
