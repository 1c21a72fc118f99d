"""The pattern language structured output compiles: byte-level regular expressions as a tree.

Everything a request can constrain an output to (a regex, a JSON schema, JSON mode, a
choice of strings) becomes one of these trees, then one byte DFA (`byte_dfa.compile_dfa`),
then one token table (`token_table.py`). The tree works on UTF-8 bytes, not characters,
because tokens are byte strings: a token may hold half of a character.

`SepRepeat` is not expressible in regex text: `item (sep item)*` with `item` once in the
automaton. JSON's comma-separated members and elements use it, so an object nested d
levels deep costs d copies of the value automaton, not 2**d.

`Avoid` is not expressible in regex text either (it is a complement): any bytes in which
none of some strings occurs, the free text between a structural tag's structures
(structural_tag.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ByteSet:
    """One byte out of `values` (each 0..255)."""

    values: frozenset[int]

    def __post_init__(self) -> None:
        assert self.values, "an empty byte set matches nothing; use Alt(()) for that"
        assert all(0 <= b < 256 for b in self.values), f"bytes are 0..255: {sorted(self.values)}"


@dataclass(frozen=True)
class Seq:
    """`items` one after another (an empty Seq matches the empty string)."""

    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    """Any one of `options` (an empty Alt matches nothing)."""

    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    """`item` at least `min` and at most `max` times (None = no bound)."""

    item: Node
    min: int
    max: int | None

    def __post_init__(self) -> None:
        assert self.min >= 0 and (self.max is None or self.max >= self.min), (
            f"repeat bounds must satisfy 0 <= min <= max: {self.min}, {self.max}"
        )


@dataclass(frozen=True)
class SepRepeat:
    """`item (sep item)*`: one or more items with `sep` between them."""

    item: Node
    sep: Node


@dataclass(frozen=True)
class Avoid:
    """Any byte string (the empty one too) in which none of `strings` occurs."""

    strings: tuple[bytes, ...]

    def __post_init__(self) -> None:
        assert self.strings and all(self.strings), "Avoid needs non-empty strings"


Node = ByteSet | Seq | Alt | Repeat | SepRepeat | Avoid


def literal(text: str | bytes) -> Node:
    """Exactly `text` (a str is taken as its UTF-8 bytes)."""
    data = text.encode() if isinstance(text, str) else text
    return Seq(tuple(ByteSet(frozenset((b,))) for b in data))


def optional(item: Node) -> Node:
    return Repeat(item, 0, 1)


def alt(*options: Node) -> Node:
    return options[0] if len(options) == 1 else Alt(tuple(options))


def seq(*items: Node) -> Node:
    return items[0] if len(items) == 1 else Seq(tuple(items))


NOTHING: Node = Alt(())  # matches no text
EMPTY: Node = Seq(())  # matches only the empty text


def is_empty(node: Node) -> bool:
    """Whether `node` matches no text at all (an impossible branch, to be dropped)."""
    if isinstance(node, (ByteSet, Avoid)):
        return False
    if isinstance(node, Seq):
        return any(is_empty(i) for i in node.items)
    if isinstance(node, Alt):
        return all(is_empty(o) for o in node.options)
    if isinstance(node, Repeat):
        return node.min > 0 and is_empty(node.item)
    return is_empty(node.item)
