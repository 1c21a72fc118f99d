"""Regex text -> byte tree -> minimal byte DFA: parity with Python `re`, UTF-8 classes,
SepRepeat, minimization, and the errors that refuse what cannot be enforced.

`re.ASCII` is the oracle's flag because the parser gives \\d \\w \\s their ASCII meanings.
"""

from __future__ import annotations

import functools
import re
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.runner.structured.byte_dfa import ByteDFA, compile_dfa
from pdserve.runner.structured.charsets import any_char, char_class
from pdserve.runner.structured.nfa import nfa_size
from pdserve.runner.structured.regex_ast import (
    Alt,
    ByteSet,
    SepRepeat,
    Seq,
    alt,
    literal,
    optional,
    seq,
)
from pdserve.runner.structured.regex_parse import parse_regex

PATTERNS = [
    r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,6}",
    r"\d{4}-\d{2}-\d{2}",
    r"(cat|dog|bird)s?",
    r"((a|b)c)*d",
    r"(?:x(?:y|z)+)?w",
    r"(?P<year>\d{2,4})/(?P<month>\d\d)",
    r"[à-ÿ]+",
    r"[α-ω]{1,3}[^α-ω]",
    r".",
    r"a.?b",
    r'"[^"\\]*"',
    r"a{2,4}b{3}c{,2}d{1,}",
    r"a+?b*?c??d{1,3}?",
    r"a|",
    r"|b",
    r"(a||b)c",
    r"\w+\s\W\S\D",
    r"[\d\s-]+",
    r"[]a-]+",
    r"[^]x]",
    r"\x41\u00e9\n\t",
    r"\(\)\[\]\{\}\.\*\+\?\|\^\$\/\-\"",
    r"^abc$",
    r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?",
    r"😀+|[\U0001F600-\U0001F64F]{2}",
    r"[^\x00-\x7f]{2}",
]
EXTRA_CHARS = ["a", "b", "z", "0", "9", " ", "-", ".", "@", "é", "ÿ", "α", "😀", "\n", '"', "\\"]
PARITY = settings(
    max_examples=75,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@functools.cache
def dfa_of(pattern: str) -> ByteDFA:
    return compile_dfa(parse_regex(pattern))


def oracle(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


def check_parity(pattern: str, text: str) -> None:
    dfa = dfa_of(pattern)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        # Surrogates have no UTF-8 form; their WTF-8 bytes must never be accepted.
        assert not dfa.matches(text.encode("utf-8", "surrogatepass"))
        return
    assert dfa.matches(text.encode()) == oracle(pattern, text), (pattern, text)


@st.composite
def near_misses(draw: st.DrawFn, pattern: str) -> str:
    """A matching string with a few characters inserted, deleted or replaced."""
    chars = list(draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True)))
    alphabet = sorted(set(pattern)) + EXTRA_CHARS
    edits = st.tuples(st.sampled_from("idr"), st.integers(0, 40), st.sampled_from(alphabet))
    for op, pos, ch in draw(st.lists(edits, min_size=1, max_size=3)):
        at = pos % (len(chars) + 1)
        if op == "i":
            chars.insert(at, ch)
        elif chars and at < len(chars):
            if op == "d":
                del chars[at]
            else:
                chars[at] = ch
    return "".join(chars)


@pytest.mark.parametrize("pattern", PATTERNS)
@PARITY
@given(data=st.data())
def test_generated_matches_are_accepted(pattern: str, data: st.DataObject) -> None:
    """Guards against the DFA rejecting strings `re` matches (a construct parsed wrong,
    a lost alternative, a bounded repeat expanded short)."""
    text = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True))
    assert oracle(pattern, text)
    check_parity(pattern, text)


@pytest.mark.parametrize("pattern", PATTERNS)
@PARITY
@given(data=st.data())
def test_other_strings_agree_with_re(pattern: str, data: st.DataObject) -> None:
    """Guards against the DFA accepting what `re` rejects (a class too wide, a repeat
    unbounded, a negation that leaks), on near misses and on random text."""
    alphabet = st.sampled_from(sorted(set(pattern)) + EXTRA_CHARS)
    text = data.draw(
        st.one_of(near_misses(pattern), st.text(alphabet, max_size=12), st.text(max_size=6))
    )
    check_parity(pattern, text)


@pytest.mark.parametrize(
    "pattern, texts",
    [
        ("a{}", ["a{}", "a", ""]),
        ("a{,}", ["", "aaa", "a{,}"]),
        ("x{1, 2}", ["x{1, 2}", "x", "xx"]),
        ("{a}", ["{a}", "a"]),
        (r"\0\012", ["\x00\n", "\x00"]),
        (r"[\b]", ["\x08", "b"]),
        (r"\N{BULLET}", ["•", "N"]),
        (r"[a-c-e]+", ["a-e", "b", "d"]),
        (r"[--/]", ["-", ".", "/", "0"]),
        (r"\é\%", ["é%"]),
        (r"^a$|^b$", ["a", "b", "ab", "a\n"]),
        (r"()", ["", "a"]),
        (r"(a|b|)+", ["", "ab", "c"]),
    ],
)
def test_edge_syntax_agrees_with_re(pattern: str, texts: list[str]) -> None:
    """Guards against odd-but-valid syntax (literal braces, octal, backspace in a class,
    named characters, trailing ranges, per-branch anchors) being parsed unlike Python."""
    for text in texts:
        check_parity(pattern, text)


# --- character classes over UTF-8 ---------------------------------------------------------

CLASSES = [
    ([(0x61, 0x7A)], False),
    ([(0xE0, 0xFF)], False),
    ([(0x7F, 0x80), (0x7FF, 0x800)], False),
    ([(0xD000, 0xE100)], False),  # spans the surrogate gap
    ([(0xFFFF, 0x10000), (0x10FFFF, 0x10FFFF)], False),
    ([(0x0A, 0x0A)], True),
    ([(0x30, 0x39), (0x4E00, 0x9FFF)], True),
    ([(0x80, 0x10FFFF)], True),  # only ASCII left
    ([(0x1F600, 0x1F64F), (0x3B1, 0x3C9), (0x20, 0x20)], False),
]
BOUNDARY_CODE_POINTS = [
    0, 0x0A, 0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF,
    0xFFFD, 0x61, 0x7A, 0xE0, 0xFF, 0x3B1, 0x3C9, 0x4E00, 0x9FFF, 0x1F600, 0x1F64F, 0xD000,
]  # fmt: skip


def in_class(cp: int, ranges: list[tuple[int, int]], negate: bool) -> bool:
    return any(lo <= cp <= hi for lo, hi in ranges) != negate


def one_char(data: bytes) -> int | None:
    """The code point when `data` is exactly one well-formed UTF-8 character, else None."""
    try:
        text = data.decode("utf-8", "strict")
    except UnicodeDecodeError:
        return None
    return ord(text) if len(text) == 1 else None


@functools.cache
def class_dfa(index: int) -> ByteDFA:
    ranges, negate = CLASSES[index]
    return compile_dfa(char_class(ranges, negate=negate))


@pytest.mark.parametrize("index", range(len(CLASSES)))
def test_char_class_boundary_code_points(index: int) -> None:
    """Guards against off-by-one splits where the UTF-8 length or a continuation byte
    range changes (U+007F/0080, U+07FF/0800, U+FFFF/10000, the surrogate gap)."""
    ranges, negate = CLASSES[index]
    dfa = class_dfa(index)
    for cp in BOUNDARY_CODE_POINTS + [lo for lo, _ in ranges] + [hi for _, hi in ranges]:
        for c in (cp - 1, cp, cp + 1):
            if 0 <= c <= 0x10FFFF and not 0xD800 <= c <= 0xDFFF:
                assert dfa.matches(chr(c).encode()) == in_class(c, ranges, negate), hex(c)


@pytest.mark.parametrize("index", range(len(CLASSES)))
@settings(max_examples=150, deadline=None)
@given(
    cp=st.integers(0, 0x10FFFF).filter(lambda c: not 0xD800 <= c <= 0xDFFF),
    junk=st.binary(min_size=1, max_size=5),
    lead=st.integers(0xC0, 0xFF),
    tail=st.lists(st.integers(0x80, 0xBF), max_size=4),
)
def test_char_class_is_exactly_the_utf8_of_its_members(
    index: int, cp: int, junk: bytes, lead: int, tail: list[int]
) -> None:
    """Guards against a class accepting a code point outside it (or missing one inside),
    and against accepting malformed UTF-8: arbitrary bytes and lead+continuation runs
    (overlong forms, surrogates, > U+10FFFF, truncations) must match iff they are one
    well-formed character of the class."""
    ranges, negate = CLASSES[index]
    dfa = class_dfa(index)
    assert dfa.matches(chr(cp).encode()) == in_class(cp, ranges, negate)
    for data in (junk, bytes([lead, *tail])):
        decoded = one_char(data)
        expected = decoded is not None and in_class(decoded, ranges, negate)
        assert dfa.matches(data) == expected, data


@pytest.mark.parametrize(
    "data",
    [
        b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf",
        b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf",
        b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\xfe", b"\xe2\x82", b"\xc3",
    ],
)  # fmt: skip
def test_any_char_rejects_malformed_utf8(data: bytes) -> None:
    """Guards against `.` or a negated class admitting lone continuation bytes, overlong
    encodings, UTF-8-encoded surrogates, code points past U+10FFFF or truncated
    sequences: any of these would make the constrained output undecodable."""
    for node in (any_char(newline=True), any_char(newline=False), char_class([], negate=True)):
        assert not compile_dfa(node).matches(data)


def test_every_two_byte_sequence() -> None:
    """Guards against the 2-byte lead range (C2..DF, not C0/C1) and the 1-byte range being
    wrong anywhere: checks all 65,536 two-byte and 256 one-byte inputs against Python's
    strict UTF-8 decoder."""
    dfa = compile_dfa(any_char(newline=True))
    for b1 in range(256):
        assert dfa.matches(bytes([b1])) == (b1 < 0x80)
        for b2 in range(256):
            data = bytes([b1, b2])
            assert dfa.matches(data) == (one_char(data) is not None), data


def test_any_char_newline_flag() -> None:
    """Guards against `.` matching a newline (Python's default) or DOTALL dropping it."""
    assert not compile_dfa(any_char(newline=False)).matches(b"\n")
    assert compile_dfa(any_char(newline=True)).matches(b"\n")
    assert compile_dfa(any_char(newline=False)).matches("😀".encode())


def test_ascii_classes_are_one_byte_set() -> None:
    """Guards against ASCII classes turning into alternations of single bytes (more NFA
    states and slower compiles for every \\w, \\d, [a-z] in a schema)."""
    assert char_class([(0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A)]) == ByteSet(
        frozenset(range(0x30, 0x3A)) | frozenset(range(0x41, 0x5B)) | frozenset(range(0x61, 0x7B))
    )
    assert isinstance(parse_regex(r"\w"), ByteSet)
    assert isinstance(parse_regex(r"[^\x80-\U0010ffff]"), ByteSet)
    assert char_class([(0x80, 0x10FFFF)], negate=True) == ByteSet(frozenset(range(0x80)))
    assert char_class([], negate=False) == Alt(())


# --- SepRepeat ----------------------------------------------------------------------------


def test_sep_repeat_language() -> None:
    """Guards against SepRepeat allowing zero items, a trailing or leading separator."""
    dfa = compile_dfa(SepRepeat(literal("ab"), literal(",")))
    for text in (b"ab", b"ab,ab", b"ab,ab,ab"):
        assert dfa.matches(text)
    for text in (b"", b"ab,", b",ab", b"abab", b"ab,,ab", b"a"):
        assert not dfa.matches(text)


def test_sep_repeat_with_empty_separator_and_nullable_item() -> None:
    """Guards against epsilon cycles (empty sep, item that may be empty) looping forever
    or losing strings in the epsilon closure."""
    dfa = compile_dfa(SepRepeat(optional(literal("x")), Seq(())))
    for text in (b"", b"x", b"xxxx"):
        assert dfa.matches(text)
    assert not dfa.matches(b"y")


def nested_lists(depth: int):
    """JSON-like lists of lists of `x`, up to `depth` deep."""
    value = literal("x")
    for _ in range(depth):
        items = optional(SepRepeat(value, literal(",")))
        value = alt(literal("x"), seq(literal("["), items, literal("]")))
    return value


def test_nested_sep_repeat_stays_linear() -> None:
    """Guards against SepRepeat copying its item (item (sep item)*): nested d deep that
    would cost 2**d, in the NFA and in compile time. Both automata must grow by a
    constant per level."""
    nfa = [nfa_size(nested_lists(d)) for d in range(1, 7)]
    dfa = [compile_dfa(nested_lists(d)).num_states for d in range(1, 7)]
    assert len({b - a for a, b in zip(nfa, nfa[1:])}) == 1, nfa
    assert len({b - a for a, b in zip(dfa, dfa[1:])}) == 1, dfa
    assert nfa[-1] < 100 and dfa[-1] < 40, (nfa, dfa)
    deep = compile_dfa(nested_lists(6))
    assert deep.matches(b"[[x,[]],[[[[[x]]]]],x]")
    assert not deep.matches(b"[[[[[[[x]]]]]]]")  # 7 deep
    assert not deep.matches(b"[x,]")


# --- minimization, pruning, API -----------------------------------------------------------


def moore_classes(dfa: ByteDFA) -> int:
    """Equivalence classes of states by plain Moore refinement (independent of Hopcroft)."""
    block = dfa.accept.astype(np.int64)
    while True:
        nxt = np.where(dfa.trans >= 0, block[dfa.trans], -1)
        sig = np.concatenate([block[:, None], nxt], axis=1)
        _, new = np.unique(sig, axis=0, return_inverse=True)
        new = new.reshape(-1)
        if len(np.unique(new)) == len(np.unique(block)):
            return len(np.unique(new))
        block = new


def test_textbook_minimal_dfa() -> None:
    """Guards against minimization leaving equivalent states unmerged: (a|b)*abb has the
    4-state minimal DFA of the dragon book, every other byte dead."""
    dfa = compile_dfa(parse_regex("(a|b)*abb"))
    assert dfa.num_states == 4 and dfa.start == 0
    A, B, C, D = (dfa.walk(s) for s in (b"", b"a", b"ab", b"abb"))
    assert sorted((A, B, C, D)) == [0, 1, 2, 3] and A == 0
    a, b = ord("a"), ord("b")
    expected = {A: (B, A), B: (B, C), C: (B, D), D: (B, A)}
    for state, (on_a, on_b) in expected.items():
        assert (dfa.trans[state, a], dfa.trans[state, b]) == (on_a, on_b)
        others = np.delete(dfa.trans[state], [a, b])
        assert (others == -1).all()
    assert dfa.accept.tolist() == [s == D for s in range(4)]


def test_equivalent_patterns_minimize_alike() -> None:
    """Guards against duplicate branches surviving as duplicate states."""
    assert compile_dfa(parse_regex("a*|a*")).num_states == compile_dfa(parse_regex("a*")).num_states
    assert compile_dfa(parse_regex("a*")).num_states == 1
    assert compile_dfa(parse_regex("(ab|ab)(c|c)*")).num_states == 3


@pytest.mark.parametrize("k", [1, 3, 6])
def test_nth_from_last_needs_exponential_states(k: int) -> None:
    """Guards against over-merging: 'an a k+1 from the end' needs exactly 2**(k+1) states."""
    assert compile_dfa(parse_regex(f"(a|b)*a(a|b){{{k}}}")).num_states == 2 ** (k + 1)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_is_minimal_trim_and_starts_at_zero(pattern: str) -> None:
    """Guards against dead states kept (-1 must mean 'no accepted continuation'), states
    unreachable from the start, and unmerged equivalent states."""
    dfa = dfa_of(pattern)
    assert dfa.start == 0 and dfa.trans.dtype == np.int32 and dfa.trans.shape[1] == 256
    assert moore_classes(dfa) == dfa.num_states
    live = dfa.accept.copy()  # every state must reach acceptance
    for _ in range(dfa.num_states):
        live |= ((dfa.trans >= 0) & live[dfa.trans]).any(axis=1)
    assert live.all()
    seen = {0}  # ... and be reachable from the start
    todo = [0]
    while todo:
        for t in set(dfa.trans[todo.pop()].tolist()) - {-1} - seen:
            seen.add(t)
            todo.append(t)
    assert len(seen) == dfa.num_states


def test_walk_resumes_and_reports_dead() -> None:
    """Guards against `walk` ignoring its `state` argument or running past a dead state
    (the token table walks tokens from every state)."""
    dfa = compile_dfa(parse_regex(r"\d{4}-\d{2}"))
    mid = dfa.walk(b"20")
    assert mid >= 0 and dfa.walk(b"24-01", mid) == dfa.walk(b"2024-01")
    assert dfa.accept[dfa.walk(b"24-01", mid)]
    assert dfa.walk(b"x") == -1 and dfa.walk(b"2x0") == -1 and dfa.walk(b"0", -1) == -1
    assert dfa.walk(b"", mid) == mid
    assert not dfa.matches(b"2024-1") and dfa.matches(b"2024-01")


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pattern, message",
    [
        (r"(a)\1", "backreference \\1 is not supported at position 3"),
        (r"(?P<x>a)(?P=x)", "named backreference"),
        (r"(?=a)a", "lookahead (?=...) is not supported at position 0"),
        (r"b(?!a)", "negative lookahead (?!...) is not supported at position 1"),
        (r"(?<=a)b", "lookbehind (?<=...)"),
        (r"(?<!a)b", "negative lookbehind (?<!...)"),
        (r"(?i)abc", "inline flag"),
        (r"(?>a)", "atomic group"),
        (r"\bfoo", "word boundary \\b is not supported at position 0"),
        (r"x\B", "non-word boundary \\B"),
        (r"\Afoo", "anchor \\A"),
        (r"foo\Z", "anchor \\Z"),
        (r"a^b", "anchor '^' other than at the start is not supported at position 1"),
        (r"(^a)", "anchor '^'"),
        (r"a$b", "anchor '$' other than at the end"),
        (r"a*+", "possessive quantifier '+' is not supported at position 2"),
        (r"a{2}+", "possessive"),
        (r"a**", "multiple repeat"),
        (r"a*?+", "multiple repeat"),
        (r"(ab", "missing ')': unterminated group at position 0"),
        (r"a(b(c)", "unterminated group at position 1"),
        (r"ab)", "unbalanced parenthesis ')' at position 2"),
        (r"[z-a]", "bad character range z-a (end below start) at position 1"),
        (r"[a-\d]", "bad character range"),
        (r"[abc", "unterminated character set '[' at position 0"),
        (r"*a", "quantifier '*' with nothing to repeat at position 0"),
        (r"a|+b", "nothing to repeat at position 2"),
        (r"(?:{2})", "nothing to repeat"),
        (r"a{3,2}", "repeat {3,2} has max below min at position 1"),
        (r"a{1001}", "repeat count 1001 is over the limit of 1000 at position 1"),
        (r"a{0,5000}", "over the limit of 1000"),
        (r"\q", "escape \\q is not supported"),
        (r"\x4", "incomplete escape \\x"),
        (r"\u12", "incomplete escape \\u"),
        (r"\U00110000", "beyond U+10FFFF"),
        (r"\ud800", "surrogate U+D800 has no UTF-8 encoding"),
        ("abc\\", "lone backslash"),
        ("(" * 101 + ")" * 101, "nested more than 100 deep"),
    ],
)
def test_unsupported_syntax_is_refused_with_position(pattern: str, message: str) -> None:
    """Guards against silently ignoring a construct the automaton cannot enforce (the
    server would then claim a constraint it does not apply), and against errors that do
    not say what is wrong or where."""
    with pytest.raises(ValueError) as info:
        parse_regex(pattern)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "node",
    [Alt(()), seq(literal("a"), Alt(())), parse_regex(r"[^\x00-\U0010ffff]"), char_class([])],
)
def test_empty_language_is_refused(node) -> None:
    """Guards against returning a DFA with no accepting path (every token would be masked
    and generation could never finish)."""
    with pytest.raises(ValueError, match="the pattern matches no string"):
        compile_dfa(node)


def test_dead_branches_are_pruned() -> None:
    """Guards against states that lead only into an empty alternative staying in the DFA."""
    dfa = compile_dfa(alt(literal("ok"), seq(literal("n"), Alt(()))))
    assert dfa.num_states == 3 and dfa.walk(b"n") == -1


def test_max_states_is_enforced() -> None:
    """Guards against unbounded automata: the limit must raise, with the limit in the text."""
    node = parse_regex("(a|b)*a(a|b){9}")  # 1,024 states
    assert compile_dfa(node, max_states=1024).num_states == 1024
    with pytest.raises(ValueError, match="the pattern needs more than 1000 automaton states"):
        compile_dfa(node, max_states=1000)


def test_oversized_trees_fail_fast() -> None:
    """Guards against hanging (or exhausting memory) on patterns whose NFA or subset
    construction explodes even when the final DFA would be small."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match="too large"):
        compile_dfa(parse_regex("(a{1000}){1000}"), max_states=1000)
    with pytest.raises(ValueError, match="too complex"):
        compile_dfa(parse_regex(r"(\w+\s?){0,1000}"), max_states=2000)
    assert time.perf_counter() - start < 10


def test_large_pattern_compiles_quickly() -> None:
    """Guards against a quadratic (or per-byte rather than per-class) subset construction:
    600 words (~4,500 NFA states) take ~0.1 s on a 2-core box; 5 s is a generous bound."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=int(rng.integers(3, 12)))) for _ in range(600)]
    node = parse_regex("(" + "|".join(words) + ")")
    assert 4000 < nfa_size(node) < 6000
    start = time.perf_counter()
    dfa = compile_dfa(node)
    assert time.perf_counter() - start < 5
    assert all(dfa.matches(w.encode()) for w in words[:50])
    assert not dfa.matches(b"")
