"""Pattern tree -> Thompson NFA with epsilon edges: the first stage of `byte_dfa.compile_dfa`.

The NFA's byte edges are labelled with byte equivalence classes (bytes no ByteSet in the
tree tells apart) rather than single bytes: JSON mode's tree has 42 classes and
`[a-z]+@[a-z]+\\.com` has 7, so the subset construction after this touches far fewer
transitions than with 256 byte columns.

`SepRepeat` builds its item once, which keeps nested JSON containers linear in depth;
`nfa_size` is the diagnostic that shows it. `Avoid` is built from its own automaton
(avoid.py), one NFA state per automaton state; each byte of its strings is a class of its
own there, the bytes outside them one more.

`epsilon_closures` lives here too: the subset construction keys a DFA state only by the NFA
states that have byte edges (plus the final state), and asks for closures over exactly
those.
"""

from __future__ import annotations

from pdserve.runner.structured.avoid import avoid_automaton
from pdserve.runner.structured.regex_ast import (
    Alt,
    Avoid,
    ByteSet,
    Node,
    Repeat,
    SepRepeat,
    Seq,
)


def _outside(node: Avoid) -> frozenset[int]:
    """The bytes that occur in none of `node`'s strings."""
    return frozenset(range(256)) - {b for s in node.strings for b in s}


def _avoid_sets(node: Avoid) -> list[frozenset[int]]:
    """The byte sets `Avoid` tells apart: each byte of its strings, and all the others."""
    rest = _outside(node)
    inside = frozenset(range(256)) - rest
    return [frozenset((b,)) for b in inside] + ([rest] if rest else [])


def _byte_sets(node: Node) -> set[frozenset[int]]:
    """Every distinct ByteSet value in the tree (shared subtrees visited once)."""
    found: set[frozenset[int]] = set()
    seen: set[int] = set()
    stack: list[Node] = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, ByteSet):
            found.add(n.values)
        elif isinstance(n, Seq):
            stack.extend(n.items)
        elif isinstance(n, Alt):
            stack.extend(n.options)
        elif isinstance(n, Repeat):
            stack.append(n.item)
        elif isinstance(n, SepRepeat):
            stack.extend((n.item, n.sep))
        elif isinstance(n, Avoid):
            found.update(_avoid_sets(n))
        else:
            raise TypeError(f"not a pattern node: {n!r}")
    return found


def _byte_classes(sets: set[frozenset[int]]) -> list[int]:
    """class_of[b]: bytes share a class iff every ByteSet holds both or neither."""
    label = [0] * 256
    for values in sets:
        ids: dict[tuple[int, bool], int] = {}
        label = [ids.setdefault((label[b], b in values), len(ids)) for b in range(256)]
    return label


class NFA:
    """Thompson NFA. `build(node, start)` returns the fragment's end state and only ever
    adds edges into states it creates, never into `start`: so fragments may share a start
    (Alt options, Seq items) without a loop in one letting the walk slip into another."""

    def __init__(self, classes_of: dict[frozenset[int], tuple[int, ...]], limit: int) -> None:
        self.classes_of = classes_of
        self.limit = limit
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[tuple[int, ...], int]]] = []

    def new(self) -> int:
        if len(self.eps) >= self.limit:
            raise ValueError(
                f"the pattern is too large: more than {self.limit} NFA states "
                "(lower its repeat counts or nesting)"
            )
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node: Node, start: int) -> int:
        if isinstance(node, ByteSet):
            end = self.new()
            self.edges[start].append((self.classes_of[node.values], end))
            return end
        if isinstance(node, Seq):
            cur = start
            for item in node.items:
                cur = self.build(item, cur)
            return cur
        if isinstance(node, Alt):
            end = self.new()  # an empty Alt leaves `end` unreachable: matches nothing
            for option in node.options:
                self.eps[self.build(option, start)].append(end)
            return end
        if isinstance(node, Repeat):
            return self._repeat(node, start)
        if isinstance(node, SepRepeat):
            # item (sep item)*, one copy of item: sep leads from item's exit to its entry.
            entry = self.new()
            self.eps[start].append(entry)
            exit_ = self.build(node.item, entry)
            self.eps[self.build(node.sep, exit_)].append(entry)
            return exit_
        if isinstance(node, Avoid):
            return self._avoid(node, start)
        raise TypeError(f"not a pattern node: {node!r}")

    def _avoid(self, node: Avoid, start: int) -> int:
        table = avoid_automaton(node.strings)
        states = [self.new() for _ in table]
        end = self.new()
        self.eps[start].append(states[0])
        others = _outside(node)
        for state, row in zip(states, table, strict=True):
            self.eps[state].append(end)  # every state accepts
            targets: dict[int, list[int]] = {}
            for b, nxt in row.items():
                targets.setdefault(nxt, []).extend(self.classes_of[frozenset((b,))])
            if others:  # a byte in none of the strings: back to the start
                targets.setdefault(0, []).extend(self.classes_of[others])
            for nxt, classes in targets.items():
                self.edges[state].append((tuple(sorted(classes)), states[nxt]))
        return end

    def _repeat(self, node: Repeat, start: int) -> int:
        cur = start
        if node.max is None:
            for _ in range(max(node.min - 1, 0)):
                cur = self.build(node.item, cur)
            loop = self.new()
            self.eps[cur].append(loop)
            body_end = self.build(node.item, loop)
            if node.min == 0:  # item*: the loop state is also the exit
                self.eps[body_end].append(loop)
                return loop
            exit_ = self.new()  # item+: at least one pass through the body
            self.eps[body_end].append(exit_)
            self.eps[exit_].append(loop)
            return exit_
        for _ in range(node.min):
            cur = self.build(node.item, cur)
        if node.max == node.min:
            return cur
        # {n,m}: the n copies, then m-n optional copies that may each stop early.
        stops = []
        for _ in range(node.max - node.min):
            stops.append(cur)
            cur = self.build(node.item, cur)
        end = self.new()
        for s in [*stops, cur]:
            self.eps[s].append(end)
        return end


def epsilon_closures(eps: list[list[int]], keep: list[bool]) -> list[frozenset[int]]:
    """Per NFA state, the `keep` states reachable by epsilon edges (itself included).

    Epsilon cycles exist (`(a*)*`), so strongly connected components are found first
    (iterative Tarjan, which emits sinks first) and each component's closure is built from
    the already-finished closures of the components it points to.
    """
    n = len(eps)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp_of = [-1] * n
    comp_closure: list[frozenset[int]] = []
    stack: list[int] = []
    counter = 0
    for root in range(n):
        if index[root] >= 0:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        work = [(root, 0)]
        while work:
            v, i = work[-1]
            if i < len(eps[v]):
                work[-1] = (v, i + 1)
                w = eps[v][i]
                if index[w] < 0:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] != index[v]:
                continue
            members = []
            while True:
                w = stack.pop()
                on_stack[w] = False
                comp_of[w] = len(comp_closure)
                members.append(w)
                if w == v:
                    break
            closure = {m for m in members if keep[m]}
            for m in members:
                for w in eps[m]:
                    if comp_of[w] != comp_of[m]:
                        closure.update(comp_closure[comp_of[w]])
            comp_closure.append(frozenset(closure))
    return [comp_closure[comp_of[s]] for s in range(n)]


def build_nfa(node: Node, limit: int) -> tuple[NFA, int, int, list[int]]:
    """(nfa, start, final, class_of) for `node`, refusing more than `limit` NFA states."""
    sets = _byte_sets(node)
    class_of = _byte_classes(sets)
    classes_of = {values: tuple(sorted({class_of[b] for b in values})) for values in sets}
    nfa = NFA(classes_of, limit)
    start = nfa.new()
    final = nfa.build(node, start)
    return nfa, start, final, class_of


def nfa_size(node: Node) -> int:
    """How many NFA states `compile_dfa` builds for `node`: a size diagnostic, e.g. to see
    that nested SepRepeats stay linear (the minimal DFA alone would hide a blow-up)."""
    return len(build_nfa(node, limit=1 << 62)[0].eps)
