"""Compile a byte-level pattern tree (`regex_ast`) into a minimal DFA over bytes.

The token table built on top of this walks every vocabulary token through every state, so
the state count drives memory and build time: states that cannot reach acceptance are
dropped (their transitions become -1) and equivalent states are merged (Hopcroft).

Pipeline: tree -> Thompson NFA with epsilon edges (`nfa.py`) -> subset construction -> prune
dead states -> minimize -> [S, 256] table. Work is done over byte equivalence classes (bytes
no ByteSet in the tree tells apart) rather than 256 bytes, and a DFA state is keyed only by
its NFA states that have byte edges (plus the final state), so the subset construction
touches far fewer transitions and builds fewer duplicate states.

Measured on the shared 2-core dev box: an alternation of 1,000 random words (7,300 NFA
states, 3,600 minimal DFA states) compiles in 0.14 s; `.{0,1000}` (25,000 NFA states, 8,000
DFA states) in 0.46 s; `(a|b)*a(a|b){11}` (4,096 DFA states) in 0.06 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pdserve.runner.structured.nfa import NFA, build_nfa, epsilon_closures
from pdserve.runner.structured.regex_ast import Node

# The subset construction may overshoot the final (minimal) size; allow this much before
# giving up, so a pattern whose minimal DFA fits is not refused for its raw size.
_SUBSET_SLACK = 4
# NFA states per allowed DFA state before the tree is refused outright: bounds memory for
# trees like `(x{1000}){1000}` before any DFA work starts.
_NFA_PER_DFA_STATE = 10
# Subset-construction steps (NFA states and edges visited) per allowed DFA state: ordinary
# patterns use under 30; the default limit (5M steps) is about 1.5 s here.
_WORK_PER_DFA_STATE = 250


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays have no truth value for ==
class ByteDFA:
    """A DFA over bytes; state `start` is 0 after `compile_dfa`.

    `trans[s, b]` is the state after reading byte b in state s, -1 where no accepted string
    continues that way; `accept[s]` says whether input may end in s.
    """

    start: int
    trans: np.ndarray  # [S, 256] int32, next state, -1 = dead
    accept: np.ndarray  # [S] bool

    @property
    def num_states(self) -> int:
        return int(self.trans.shape[0])

    @cached_property
    def _rows(self) -> list[list[int]]:
        # Python lists index ~10x faster than numpy scalars in the byte-at-a-time loop.
        return self.trans.tolist()

    def walk(self, data: bytes, state: int | None = None) -> int:
        """The state after reading `data` from `state` (from `start` when None); -1 if dead."""
        s = self.start if state is None else state
        rows = self._rows
        for b in data:
            if s < 0:
                return -1
            s = rows[s][b]
        return s

    def matches(self, data: bytes) -> bool:
        """Whether the whole of `data` is in the language."""
        s = self.walk(data)
        return s >= 0 and bool(self.accept[s])


def _too_big(max_states: int) -> ValueError:
    return ValueError(f"the pattern needs more than {max_states} automaton states")


def _subset(
    nfa: NFA, start: int, final: int, num_classes: int, cap: int, budget: int
) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction over byte classes: ([D, K] int32 table, [D] bool accept)."""
    keep = [bool(e) for e in nfa.edges]
    keep[final] = True
    closure = epsilon_closures(nfa.eps, keep)
    # Per NFA state: its byte edges with the target already closed.
    out = [[(cls, closure[t]) for cls, t in edges] for edges in nfa.edges]
    first = closure[start]
    ids: dict[frozenset[int], int] = {first: 0}
    sets = [first]
    rows: list[list[int]] = []

    def state_id(key: frozenset[int]) -> int:
        got = ids.get(key)
        if got is None:
            if len(sets) >= cap:
                raise _too_big(cap // _SUBSET_SLACK)
            got = ids[key] = len(sets)
            sets.append(key)
        return got

    work = 0
    while len(rows) < len(sets):
        members = sets[len(rows)]
        edges = [e for s in members for e in out[s]]
        # Ambiguous bounded repeats (`(\w+\s?){0,300}`) make few DFA states out of huge
        # NFA subsets: count the subset work too, so such a pattern fails fast.
        work += len(members) + len(edges)
        if work > budget:
            raise ValueError(
                "the pattern is too complex to compile (ambiguous repeats make its automaton "
                "construction too costly); simplify it or lower its repeat counts"
            )
        row = [-1] * num_classes
        if len(edges) == 1:
            cls, target = edges[0]
            t = state_id(target)
            for c in cls:
                row[c] = t
        elif edges:
            # Group classes by which edges they take (a bitmask), so each distinct target
            # set is unioned once, not once per class.
            sig: dict[int, int] = {}
            for i, (cls, _) in enumerate(edges):
                bit = 1 << i
                for c in cls:
                    sig[c] = sig.get(c, 0) | bit
            by_sig: dict[int, list[int]] = {}
            for c, m in sig.items():
                by_sig.setdefault(m, []).append(c)
            for m, classes in by_sig.items():
                parts = [edges[i][1] for i in range(m.bit_length()) if m >> i & 1]
                t = state_id(parts[0] if len(parts) == 1 else frozenset().union(*parts))
                for c in classes:
                    row[c] = t
        rows.append(row)
    table = np.array(rows, dtype=np.int32).reshape(len(rows), num_classes)
    accept = np.array([final in s for s in sets], dtype=bool)
    return table, accept


def _predecessors(table: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """Incoming edges grouped by target: for target t, edges ptr[t]..ptr[t+1] of (src, cls)."""
    src, cls = np.nonzero(table >= 0)
    dst = table[src, cls]
    order = np.argsort(dst, kind="stable")
    ptr = np.searchsorted(dst[order], np.arange(table.shape[0] + 1))
    return src[order].tolist(), cls[order].tolist(), ptr.tolist()


def _prune(table: np.ndarray, accept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop states that cannot reach acceptance; the start (0) stays 0."""
    src, _, ptr = _predecessors(table)
    live = accept.copy()
    todo = np.flatnonzero(accept).tolist()
    while todo:
        t = todo.pop()
        for j in range(ptr[t], ptr[t + 1]):
            s = src[j]
            if not live[s]:
                live[s] = True
                todo.append(s)
    if not live[0]:
        raise ValueError("the pattern matches no string")
    new_id = np.full(table.shape[0] + 1, -1, dtype=np.int32)  # slot -1 maps dead to dead
    new_id[np.flatnonzero(live)] = np.arange(int(live.sum()), dtype=np.int32)
    return new_id[table[live]], accept[live]


def _minimize(table: np.ndarray, accept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hopcroft partition refinement; blocks renumbered breadth-first from state 0.

    The implicit dead state (-1) is its own block and is left out of the initial worklist
    (Hopcroft may omit any one initial block), so edges into it are never scanned. A split
    always queues the smaller half: whether or not the parent was queued, that suffices.
    """
    src, cls, ptr = _predecessors(table)
    block_of = [0 if a else 1 for a in accept.tolist()]
    blocks: list[set[int]] = [set(), set()]
    for s, b in enumerate(block_of):
        blocks[b].add(s)
    work = [b for b in (0, 1) if blocks[b]]
    while work:
        splitter = work.pop()
        preds_by_class: dict[int, list[int]] = {}
        for t in blocks[splitter]:
            for j in range(ptr[t], ptr[t + 1]):
                preds_by_class.setdefault(cls[j], []).append(src[j])
        for preds in preds_by_class.values():
            touched: dict[int, list[int]] = {}
            for s in preds:
                touched.setdefault(block_of[s], []).append(s)
            for b, part in touched.items():
                whole = blocks[b]
                if len(part) == len(whole):
                    continue
                if 2 * len(part) <= len(whole):
                    moved = set(part)
                    whole.difference_update(moved)
                else:
                    moved = whole.difference(part)
                    whole.intersection_update(part)
                new = len(blocks)
                blocks.append(moved)
                for s in moved:
                    block_of[s] = new
                work.append(new)
    # Renumber breadth-first from the start's block, so the start is 0.
    block_arr = np.array(block_of, dtype=np.int64)
    reps = [next(iter(b)) if b else -1 for b in blocks]
    order = {block_of[0]: 0}
    queue = [block_of[0]]
    rows = table.tolist()
    for b in queue:
        for t in rows[reps[b]]:
            if t >= 0 and block_of[t] not in order:
                order[block_of[t]] = len(queue)
                queue.append(block_of[t])
    remap = np.full(len(blocks) + 1, -1, dtype=np.int32)  # slot -1 maps dead to dead
    for b, i in order.items():
        remap[b] = i
    rep_states = np.array([reps[b] for b in queue], dtype=np.int64)
    lookup = np.append(block_arr, len(blocks))  # table's -1 indexes the appended dead slot
    new_table = remap[lookup[table[rep_states]]]
    return new_table.astype(np.int32), accept[rep_states]


def compile_dfa(node: Node, max_states: int = 20_000) -> ByteDFA:
    """The minimal byte DFA of `node`, start state 0.

    Raises ValueError when the pattern matches no string, or when its minimal DFA (or the
    intermediate automata, beyond a fixed slack) would exceed `max_states` states.
    """
    nfa, start, final, class_of = build_nfa(node, limit=_NFA_PER_DFA_STATE * max_states)
    table, accept = _subset(
        nfa,
        start,
        final,
        max(class_of) + 1,
        cap=_SUBSET_SLACK * max_states,
        budget=_WORK_PER_DFA_STATE * max_states,
    )
    table, accept = _prune(table, accept)
    table, accept = _minimize(table, accept)
    if table.shape[0] > max_states:
        raise _too_big(max_states)
    # Expand byte classes back to 256 columns.
    trans = np.ascontiguousarray(table[:, np.array(class_of, dtype=np.int64)], dtype=np.int32)
    return ByteDFA(start=0, trans=trans, accept=accept.astype(bool))
