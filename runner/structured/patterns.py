"""A `StructuredOutputs` as a pattern tree and as a byte DFA, cached per process.

A spec with `reasoning` (set by the server for a `<think>`-tag reasoning parser) holds
what follows the reasoning block, as vLLM does (`after_reasoning`):

    opens inside the block:  think
    otherwise:               open think | constraint alone (a reply that does not reason)
    think = Avoid(close) close "\n"* constraint

The reasoning runs to the first close tag, as the parsers read it (cluster/reasoning/
base.py), and the newlines they drop after it are free.
"""

from __future__ import annotations

import functools
import json

from pdserve.runner.structured.byte_dfa import ByteDFA, compile_dfa
from pdserve.runner.structured.ebnf_parse import ROOT, Expr, parse_grammar
from pdserve.runner.structured.ebnf_unroll import grammar_node, recursive_rules
from pdserve.runner.structured.json_grammar import json_object_node
from pdserve.runner.structured.json_schema import schema_node
from pdserve.runner.structured.lark_parse import LARK_ROOT, looks_like_gbnf, parse_lark
from pdserve.runner.structured.regex_ast import Avoid, Node, Repeat, alt, is_empty, literal, seq
from pdserve.runner.structured.regex_parse import parse_regex
from pdserve.runner.structured.spec import StructuredOutputs
from pdserve.runner.structured.structural_tag import structural_tag_node

# JSON mode's bound on nesting (objects and arrays inside the top-level object): the
# automaton grows with it (see json_grammar.py). Deeper output is cut off by the mask.
JSON_OBJECT_MAX_DEPTH = 4
# A grammar's recursion bound (ebnf_unroll.py): the largest depth up to this whose
# automaton fits `compile_dfa`'s 20,000 states. 8 nested parentheses (or brackets, or
# clauses) is past what a short structured answer uses.
GRAMMAR_MAX_DEPTH = 8
# A spec's `reasoning`: (open tag, close tag, whether the reply opens inside the block).
Reasoning = tuple[str, str, bool] | None


def pattern_node(spec: StructuredOutputs) -> Node:
    """The spec's pattern tree (a grammar's with its recursion one level deep: this is the
    check that it parses; `compile_spec` picks its depth)."""
    if spec.grammar is not None:
        return _grammar_tree(*read_grammar(spec.grammar), depth=1, reasoning=spec.reasoning)
    return after_reasoning(_constraint_node(spec), spec.reasoning)


def after_reasoning(node: Node, reasoning: Reasoning) -> Node:
    """`node` after a reasoning block (module docstring); `node` itself without one."""
    if reasoning is None:
        return node
    open_tag, close_tag, opens = reasoning
    think = seq(
        Avoid((close_tag.encode(),)), literal(close_tag), Repeat(literal("\n"), 0, None), node
    )
    return think if opens else alt(seq(literal(open_tag), think), node)


def _constraint_node(spec: StructuredOutputs) -> Node:
    if spec.regex is not None:
        return parse_regex(spec.regex)
    if spec.choice is not None:
        return alt(*(literal(c) for c in spec.choice))
    if spec.structural_tag is not None:
        return structural_tag_node(spec.structural_tag)
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs json is not valid JSON: {e}") from e
        return schema_node(schema)
    return json_object_node(JSON_OBJECT_MAX_DEPTH)


def read_grammar(text: str) -> tuple[dict[str, Expr], str]:
    """A grammar's rules and the one generation starts at: GBNF (`root ::= ...`) or Lark
    (`start: ...`), told apart by `::=` as vLLM does."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            "the grammar is empty: give GBNF rules (root ::= ...) or Lark (start: ...)"
        )
    if looks_like_gbnf(text):
        return parse_grammar(text), ROOT
    return parse_lark(text), LARK_ROOT


def _grammar_tree(
    rules: dict[str, Expr], start: str, depth: int, reasoning: Reasoning = None
) -> Node:
    try:
        return after_reasoning(grammar_node(rules, start, depth), reasoning)
    except RecursionError:  # the builder and the tree's walks recurse on its depth
        raise ValueError(_TOO_DEEP.format(depth=depth)) from None


def _compiled(rules: dict[str, Expr], start: str, depth: int, reasoning: Reasoning) -> ByteDFA:
    tree = _grammar_tree(rules, start, depth, reasoning)
    try:
        return compile_dfa(tree)
    except RecursionError:
        raise ValueError(_TOO_DEEP.format(depth=depth)) from None


_TOO_DEEP = (
    "the grammar nests too deeply to compile with its recursion {depth} level(s) deep "
    "(rules inside rules inside rules...)"
)


def grammar_dfa(text: str, reasoning: Reasoning = None) -> tuple[ByteDFA, int]:
    """A grammar's DFA and the recursion depth it has (1 for a grammar without recursion):
    depths 1, 2, ... are compiled until one is too large or GRAMMAR_MAX_DEPTH is reached.

    Depth 1 is empty only when the whole language is: a shortest derivation never opens a
    rule inside itself (it could be cut shorter there), so it is within depth 1."""
    rules, start = read_grammar(text)
    if is_empty(_grammar_tree(rules, start, depth=1)):
        raise ValueError(
            "the grammar matches no text: every way through root refers again to a rule "
            "it is inside of, without end"
        )
    top = GRAMMAR_MAX_DEPTH if recursive_rules(rules) else 1
    best: tuple[ByteDFA, int] | None = None
    for depth in range(1, top + 1):
        try:
            best = _compiled(rules, start, depth, reasoning), depth
        except ValueError as e:
            if best is None:
                raise ValueError(f"grammar, with its recursion 1 level deep: {e}") from e
            break
    assert best is not None
    return best


@functools.lru_cache(maxsize=64)
def _grammar(text: str, reasoning: Reasoning) -> tuple[ByteDFA, int]:
    return grammar_dfa(text, reasoning)


def grammar_depth(spec: StructuredOutputs) -> int | None:
    """How deep a grammar spec's recursion is unrolled (None: not a grammar); compiles it
    if needed (cached)."""
    return None if spec.grammar is None else _grammar(spec.grammar, spec.reasoning)[1]


@functools.lru_cache(maxsize=64)
def _dfa(key: str) -> ByteDFA:
    spec = StructuredOutputs.from_wire(json.loads(key))
    if spec.grammar is not None:
        return _grammar(spec.grammar, spec.reasoning)[0]
    return compile_dfa(pattern_node(spec))


def compile_spec(spec: StructuredOutputs) -> ByteDFA:
    """The spec's byte DFA (cached per process); ValueError names what is wrong with it."""
    return _dfa(spec.key)
