"""A parsed grammar (`ebnf_parse.py`) as one byte-level pattern tree (`regex_ast`).

A DFA has no stack, so recursion is unrolled: a rule that can reach itself (through any
cycle of references) may be open at most `depth` times at once on any path of nested
references; one level deeper its branch matches nothing, so the mask steers the output
away from nesting past the bound. A grammar without recursion is a regular language and
is matched exactly, whatever `depth`.

Sizes. Each rule's tree is built once per distinct stack of open recursive rules of its
own cycle (memoized), so the tree is a DAG; but the automaton copies an item for each
place it is used, and a rule used twice per level doubles per level. `item (sep item)*`
is therefore rewritten to `SepRepeat` (one copy of `item`), which keeps lists of nested
values (`expr ::= term ("+" term)*`) linear in `depth`; what still doubles (a value that
may be an object or an array, each holding values) is the stack itself, which a DFA must
remember. `patterns.grammar_dfa` picks the largest depth whose automaton fits.
"""

from __future__ import annotations

import json

from pdserve.runner.structured.charsets import char_class
from pdserve.runner.structured.ebnf_parse import (
    CharClass,
    Expr,
    GAlt,
    GRepeat,
    GSeq,
    JsonSchema,
    Pattern,
    Ref,
    Text,
    refs_of,
)
from pdserve.runner.structured.json_schema import schema_node
from pdserve.runner.structured.regex_ast import (
    EMPTY,
    NOTHING,
    Alt,
    Node,
    Repeat,
    SepRepeat,
    is_empty,
    literal,
    seq,
)
from pdserve.runner.structured.regex_parse import parse_regex

MAX_NESTING = 200  # rule references open at once while building (Python's stack)


def recursive_rules(
    rules: dict[str, Expr], comp: dict[str, frozenset[str]] | None = None
) -> set[str]:
    """The rules that can reach themselves through references (`comp`: the components,
    when already known)."""
    comp = _components(rules) if comp is None else comp
    return {name for name, c in comp.items() if name in _reach(rules, c)}


def grammar_node(rules: dict[str, Expr], start: str, depth: int) -> Node:
    """`start`'s language with each recursive rule open at most `depth` times at once."""
    assert depth >= 1, f"depth must be >= 1, got {depth}"
    return _Unroller(rules, depth).rule(start)


def _components(rules: dict[str, Expr]) -> dict[str, frozenset[str]]:
    """Each rule's strongly connected component of the reference graph (iterative Tarjan:
    a chain of thousands of rules must not overflow Python's stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comp: dict[str, frozenset[str]] = {}
    edges = {name: sorted(refs_of(body)) for name, body in rules.items()}
    for root in rules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, k = work.pop()
            if k == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if k < len(edges[node]):
                work.append((node, k + 1))
                nxt = edges[node][k]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    members.append(m)
                    if m == node:
                        break
                for m in members:
                    comp[m] = frozenset(members)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return comp


def _reach(rules: dict[str, Expr], comp: frozenset[str]) -> set[str]:
    """Rules of `comp` referenced from inside it (a one-rule component is recursive only
    when the rule refers to itself)."""
    return {r for name in comp for r in refs_of(rules[name]) if r in comp}


class _Unroller:
    def __init__(self, rules: dict[str, Expr], depth: int) -> None:
        self.rules = rules
        self.depth = depth
        self.comp = _components(rules)
        self.recursive = recursive_rules(rules, self.comp)
        self.open: dict[str, int] = dict.fromkeys(rules, 0)  # references open now
        self.nesting = 0
        self.memo: dict[tuple, Node] = {}

    def rule(self, name: str) -> Node:
        if name in self.recursive and self.open[name] >= self.depth:
            return NOTHING
        members = sorted(self.comp[name])
        key = (name, tuple(self.open[m] for m in members))
        if key in self.memo:
            return self.memo[key]
        if self.nesting >= MAX_NESTING:
            raise ValueError(f"grammar: rule references nest more than {MAX_NESTING} deep")
        self.open[name] += 1
        self.nesting += 1
        try:
            node = self.expr(self.rules[name])
        finally:
            self.open[name] -= 1
            self.nesting -= 1
        self.memo[key] = node
        return node

    def expr(self, e: Expr) -> Node:
        if isinstance(e, Text):
            return literal(e.text) if e.text else EMPTY
        if isinstance(e, CharClass):
            return char_class(list(e.ranges), e.negate)
        if isinstance(e, Pattern):
            return parse_regex(e.regex)
        if isinstance(e, JsonSchema):
            return schema_node(json.loads(e.schema))
        if isinstance(e, Ref):
            return self.rule(e.name)
        if isinstance(e, GAlt):
            options = [n for n in (self.expr(o) for o in e.options) if not is_empty(n)]
            if not options:
                return NOTHING
            return options[0] if len(options) == 1 else Alt(tuple(options))
        if isinstance(e, GRepeat):
            item = self.expr(e.item)
            if is_empty(item):
                return EMPTY if e.min == 0 else NOTHING
            return Repeat(item, e.min, e.max)
        assert isinstance(e, GSeq), f"not a grammar expression: {e!r}"
        items = [self.expr(i) if not isinstance(i, _Sep) else i.node(self) for i in _seps(e)]
        if any(is_empty(i) for i in items):
            return NOTHING
        return seq(*items) if items else EMPTY


class _Sep:
    """`item (sep item)*` found in a sequence: built as one SepRepeat."""

    def __init__(self, item: Expr, sep: Expr) -> None:
        self.item, self.sep = item, sep

    def node(self, u: _Unroller) -> Node:
        item, sep = u.expr(self.item), u.expr(self.sep)
        if is_empty(item):
            return NOTHING
        return item if is_empty(sep) else SepRepeat(item, sep)


def _seps(e: GSeq) -> list[Expr | _Sep]:
    """The sequence's items, each `X (S X)*` merged into one `_Sep(X, S)`; X may be several
    items (`string ":" value ("," string ":" value)*`), the longest that matches."""
    out: list[Expr | _Sep] = []
    for item in e.items:
        body = _star_body(item)
        for m in range(len(body) - 1, 0, -1):
            tail = body[-m:]
            if (
                len(out) >= m
                and all(not isinstance(o, _Sep) for o in out[-m:])
                and (tuple(out[-m:]) == tail)
            ):
                del out[-m:]
                sep = body[:-m]
                x = tail[0] if m == 1 else GSeq(tail)
                out.append(_Sep(x, sep[0] if len(sep) == 1 else GSeq(sep)))
                break
        else:
            out.append(item)
    return out


def _star_body(item: Expr) -> tuple[Expr, ...]:
    """The items of `(a b c)*`; () for anything else."""
    star = isinstance(item, GRepeat) and (item.min, item.max) == (0, None)
    return item.item.items if star and isinstance(item.item, GSeq) else ()
