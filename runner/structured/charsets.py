"""Sets of Unicode characters as byte-level pattern trees (one character = its UTF-8 bytes).

A regex class like `[à-ÿ]` or `\\W` names code points, but the automaton reads bytes, so a
class becomes the alternatives of UTF-8 byte sequences whose decodings are exactly the
class: every piece is a `Seq` of `ByteSet`s, one per byte position. Only well-formed UTF-8
is ever produced (no overlong forms, no surrogates, nothing above U+10FFFF), so a
constrained output always decodes.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.runner.structured.regex_ast import Alt, ByteSet, Node, alt, seq

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
# The last code point of each UTF-8 length: 1, 2, 3 and 4 bytes.
_LENGTH_ENDS = (0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT)

Ranges = list[tuple[int, int]]


def normalize(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sorted, merged, disjoint inclusive ranges, clipped to 0..U+10FFFF, surrogates removed."""
    merged: Ranges = []
    for lo, hi in sorted((max(lo, 0), min(hi, MAX_CODE_POINT)) for lo, hi in ranges):
        if lo > hi:
            continue
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    # Surrogates have no UTF-8 encoding: cut them out of whatever range holds them.
    out: Ranges = []
    for lo, hi in merged:
        if hi < SURROGATES[0] or lo > SURROGATES[1]:
            out.append((lo, hi))
            continue
        if lo < SURROGATES[0]:
            out.append((lo, SURROGATES[0] - 1))
        if hi > SURROGATES[1]:
            out.append((SURROGATES[1] + 1, hi))
    return out


def complement(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Every encodable code point (surrogates excluded) that is not in `ranges`."""
    out: Ranges = []
    nxt = 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return normalize(out)


def _split_by_length(lo: int, hi: int) -> Ranges:
    """Cut [lo, hi] where the UTF-8 length changes, so each piece has one length."""
    pieces: Ranges = []
    for end in _LENGTH_ENDS:
        if lo > hi:
            break
        if lo <= end:
            pieces.append((lo, min(hi, end)))
            lo = end + 1
    return pieces


def _byte_ranges(lo: int, hi: int, out: list[list[tuple[int, int]]]) -> None:
    """Append to `out` byte-range rows (one (first, last) per position) covering [lo, hi].

    [lo, hi] must be one UTF-8 length. A row is exact only when, for every trailing
    continuation byte, the range covers it fully (lo's low bits all 0, hi's all 1) wherever
    the leading bytes differ; otherwise cut the range at that continuation boundary and
    recurse, so the halves become aligned.
    """
    n = len(chr(lo).encode())
    for i in range(1, n):
        mask = (1 << (6 * i)) - 1  # the low i continuation bytes
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                _byte_ranges(lo, lo | mask, out)
                _byte_ranges((lo | mask) + 1, hi, out)
                return
            if hi & mask != mask:
                _byte_ranges(lo, (hi & ~mask) - 1, out)
                _byte_ranges(hi & ~mask, hi, out)
                return
    a, b = chr(lo).encode(), chr(hi).encode()
    out.append([(a[k], b[k]) for k in range(n)])


def _byte_set(lo: int, hi: int) -> ByteSet:
    return ByteSet(frozenset(range(lo, hi + 1)))


def char_class(ranges: list[tuple[int, int]], negate: bool = False) -> Node:
    """One code point in the union of inclusive `ranges` (or, with `negate`, one not in them),
    as its UTF-8 bytes. Surrogates (U+D800..U+DFFF) are never matched: they have no UTF-8
    form. An empty class is `Alt(())`, which matches nothing."""
    cps = complement(ranges) if negate else normalize(ranges)
    rows: list[list[tuple[int, int]]] = []
    for lo, hi in cps:
        for a, b in _split_by_length(lo, hi):
            _byte_ranges(a, b, rows)
    # Rows that differ only in their first byte merge into one row whose first position is
    # the union: all of ASCII becomes one ByteSet, and e.g. U+0080..U+07FF one 2-byte row.
    heads: dict[tuple[tuple[int, int], ...], set[int]] = {}
    for row in rows:
        first, *tail = row
        heads.setdefault(tuple(tail), set()).update(range(first[0], first[1] + 1))
    options: list[Node] = []
    for tail, head in heads.items():
        items = [ByteSet(frozenset(head))] + [_byte_set(a, b) for a, b in tail]
        options.append(seq(*items))
    if not options:
        return Alt(())
    return alt(*options)


def any_char(newline: bool) -> Node:
    """Regex `.`: any code point; `\\n` only when `newline` (Python's DOTALL)."""
    if newline:
        return char_class([(0, MAX_CODE_POINT)])
    return char_class([(0x0A, 0x0A)], negate=True)


__all__ = ["Ranges", "any_char", "char_class", "complement", "normalize"]
