"""vLLM's structural tags: free text, except that where a trigger appears, a structure
follows (its `begin`, JSON valid against its `schema`, its `end`), then free text again.

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...},
                     "end": "</function>"}],
     "triggers": ["<function="]}

(`response_format`, or `structured_outputs.structural_tag` as its JSON text.) Each
structure's `begin` starts with one of the triggers. The pattern is

    free (structure free)*        free = Avoid(triggers)

so free text never holds a trigger, and a trigger can only be the start of a structure's
begin. The output may end wherever free text may: never inside a structure. Tool calls
in a known format and JSON after a reasoning model's `</think>` are what clients use it
for.

xgrammar's newer form (`"format": {...}`) is refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.runner.structured.json_schema import schema_node
from pdserve.runner.structured.regex_ast import Avoid, Node, Repeat, alt, literal, seq

_KEYS = {"type", "structures", "triggers"}
_STRUCTURE_KEYS = {"begin", "schema", "end"}


def structural_tag_node(text: str) -> Node:
    """The pattern tree of a structural tag given as JSON text; ValueError says what is
    wrong with it."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from e
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be an object with 'structures' and 'triggers'")
    if "format" in tag:
        raise ValueError(
            "structural_tag's 'format' form is not supported; give 'structures' "
            "(begin, schema, end) and 'triggers'"
        )
    unknown = sorted(set(tag) - _KEYS)
    if unknown:
        raise ValueError(f"structural_tag has unknown field(s) {unknown}")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"structural_tag's type must be 'structural_tag' (got {tag['type']!r})")
    triggers = _strings(tag.get("triggers"), "triggers")
    structures = tag.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag needs 'structures': a non-empty list")
    options = [_structure(s, i, triggers) for i, s in enumerate(structures)]
    free = Avoid(tuple(t.encode() for t in triggers))
    return seq(free, Repeat(seq(alt(*options), free), 0, None))


def _strings(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"structural_tag needs '{name}': a non-empty list of strings")
    if not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"structural_tag's '{name}' must be non-empty strings (got {value!r})")
    return value


def _structure(value: Any, i: int, triggers: list[str]) -> Node:
    where = f"structural_tag's structures[{i}]"
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object with 'begin', 'schema' and 'end'")
    unknown = sorted(set(value) - _STRUCTURE_KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {unknown}")
    begin, end = value.get("begin"), value.get("end")
    if not isinstance(begin, str) or not isinstance(end, str):
        raise ValueError(f"{where} needs 'begin' and 'end' strings")
    if not any(begin.startswith(t) for t in triggers):
        raise ValueError(
            f"{where}'s begin {begin!r} starts with none of the triggers {triggers!r}; "
            "each structure's begin must start with a trigger"
        )
    if "schema" not in value:
        raise ValueError(f"{where} needs a 'schema' (a JSON schema; true for any JSON)")
    try:
        body = schema_node(value["schema"])
    except ValueError as e:
        raise ValueError(f"{where}'s schema: {e}") from e
    return seq(literal(begin), body, literal(end))
