"""A `StructuredOutputs` as a pattern tree and as a byte DFA, cached per process."""

from __future__ import annotations

import functools
import json

from pdserve.runner.structured.byte_dfa import ByteDFA, compile_dfa
from pdserve.runner.structured.json_grammar import json_object_node
from pdserve.runner.structured.json_schema import schema_node
from pdserve.runner.structured.regex_ast import Node, alt, literal
from pdserve.runner.structured.regex_parse import parse_regex
from pdserve.runner.structured.spec import StructuredOutputs

# JSON mode's bound on nesting (objects and arrays inside the top-level object): the
# automaton grows with it (see json_grammar.py). Deeper output is cut off by the mask.
JSON_OBJECT_MAX_DEPTH = 4


def pattern_node(spec: StructuredOutputs) -> Node:
    if spec.regex is not None:
        return parse_regex(spec.regex)
    if spec.choice is not None:
        return alt(*(literal(c) for c in spec.choice))
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs json is not valid JSON: {e}") from e
        return schema_node(schema)
    return json_object_node(JSON_OBJECT_MAX_DEPTH)


@functools.lru_cache(maxsize=64)
def _dfa(key: str) -> ByteDFA:
    return compile_dfa(pattern_node(StructuredOutputs.from_wire(json.loads(key))))


def compile_spec(spec: StructuredOutputs) -> ByteDFA:
    """The spec's byte DFA (cached per process); ValueError names what is wrong with it."""
    return _dfa(spec.key)
