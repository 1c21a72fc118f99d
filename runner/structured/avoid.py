"""The automaton of `Avoid`: byte strings in which none of some strings occurs.

Its states are what the text read so far ends with that could still grow into one of the
strings: the longest suffix of the text that is a prefix of one of them (the
Aho-Corasick automaton's states, with each transition resolved in advance). A byte that
completes one of the strings has no transition: the text would contain it. A byte that
occurs in none of the strings leads back to the start, whatever the state. Every state
accepts.

Built from the strings directly (each state's text + a byte, cut from the front until it
is a prefix again): the strings are a few short triggers, so the quadratic build is
microseconds, and `MAX_AVOID_BYTES` bounds it.
"""

from __future__ import annotations

MAX_AVOID_BYTES = 4096  # the strings' total length


def avoid_automaton(strings: tuple[bytes, ...]) -> list[dict[int, int]]:
    """Per state (0 = start), the next state of each byte that occurs in `strings`; a byte
    it lacks completes one of the strings (no transition). Bytes that occur in none of
    them lead to state 0 from every state."""
    if not strings or not all(strings):
        raise ValueError("the strings to avoid must be non-empty")
    if sum(len(s) for s in strings) > MAX_AVOID_BYTES:
        raise ValueError(f"the strings to avoid are longer than {MAX_AVOID_BYTES} bytes")
    prefixes = {s[:i] for s in strings for i in range(len(s))}  # the whole strings excluded
    alphabet = sorted({b for s in strings for b in s})
    index: dict[bytes, int] = {b"": 0}
    order = [b""]
    table: list[dict[int, int]] = []
    for text in order:  # grows as new states are found (breadth first from the start)
        row: dict[int, int] = {}
        for b in alphabet:
            grown = text + bytes((b,))
            if any(grown.endswith(s) for s in strings):
                continue  # one of the strings ends here
            while grown not in prefixes:
                grown = grown[1:]
            if grown not in index:
                index[grown] = len(order)
                order.append(grown)
            row[b] = index[grown]
        table.append(row)
    return table
