"""An independent reading of a parsed grammar, for the grammar tests: `accepts` matches a
text by backtracking over the rules themselves (regexes by Python's `re`), with the same
bound on recursion the compiler uses (a rule that can reach itself open at most `depth`
times at once); `equivalent` compares two byte DFAs' whole languages."""

from __future__ import annotations

import itertools
import re

from pdserve.runner.structured.byte_dfa import ByteDFA
from pdserve.runner.structured.ebnf_parse import (
    CharClass,
    GAlt,
    GRepeat,
    GSeq,
    Pattern,
    Ref,
    Text,
)


def _reachable_self(rules: dict, name: str) -> bool:
    seen, todo = set(), [name]
    while todo:
        body = rules[todo.pop()]
        for ref in _refs(body):
            if ref == name:
                return True
            if ref not in seen:
                seen.add(ref)
                todo.append(ref)
    return False


def _refs(e) -> list[str]:
    if isinstance(e, Ref):
        return [e.name]
    if isinstance(e, (GSeq, GAlt)):
        return [r for p in (e.items if isinstance(e, GSeq) else e.options) for r in _refs(p)]
    if isinstance(e, GRepeat):
        return _refs(e.item)
    return []


def accepts(rules: dict, text: str, depth: int, start: str = "root") -> bool:
    """Whether `text` is in root's language with recursion bounded by `depth`: every way
    through the rules, by backtracking on code points."""
    recursive = {n for n in rules if _reachable_self(rules, n)}

    def ends(e, i: int, open_: tuple) -> set[int]:
        if isinstance(e, Text):
            return {i + len(e.text)} if text.startswith(e.text, i) else set()
        if isinstance(e, CharClass):
            if i >= len(text):
                return set()
            cp = ord(text[i])
            inside = any(lo <= cp <= hi for lo, hi in e.ranges)
            return {i + 1} if inside != e.negate and not 0xD800 <= cp <= 0xDFFF else set()
        if isinstance(e, Pattern):  # regex_parse's \\d \\w \\s are ASCII, as re.ASCII's
            return {j for j in range(i, len(text) + 1)
                    if re.fullmatch(e.regex, text[i:j], re.ASCII)}  # fmt: skip
        if isinstance(e, Ref):
            if e.name in recursive and open_.count(e.name) >= depth:
                return set()
            return ends(rules[e.name], i, (*open_, e.name))
        if isinstance(e, GAlt):
            return set().union(*(ends(o, i, open_) for o in e.options))
        if isinstance(e, GSeq):
            here = {i}
            for item in e.items:
                here = set().union(*(ends(item, j, open_) for j in here)) if here else set()
            return here
        assert isinstance(e, GRepeat)
        out, here, seen = set(), {i}, set()
        for count in itertools.count():
            if count >= e.min:
                out |= here
            if (e.max is not None and count >= e.max) or not here:
                break
            here = set().union(*(ends(e.item, j, open_) for j in here))
            if count >= e.min:
                here -= seen
                seen |= here
        return out

    return len(text) in ends(rules[start], 0, ())


def equivalent(a: ByteDFA, b: ByteDFA) -> bool:
    """Whether two byte DFAs accept the same language (a walk over pairs of states; -1 is
    the dead state of either)."""
    seen, todo = {(a.start, b.start)}, [(a.start, b.start)]
    while todo:
        x, y = todo.pop()
        if (x >= 0 and bool(a.accept[x])) != (y >= 0 and bool(b.accept[y])):
            return False
        for byte in range(256):
            pair = (
                int(a.trans[x, byte]) if x >= 0 else -1,
                int(b.trans[y, byte]) if y >= 0 else -1,
            )
            if pair != (-1, -1) and pair not in seen:
                seen.add(pair)
                todo.append(pair)
    return True
