"""Parse regex text (vLLM's `guided_regex`, JSON Schema `pattern`) into a byte-level tree.

A practical subset of Python `re` syntax, matched as a whole string (fullmatch): literals,
escapes, classes, `.`, groups, alternation and greedy or lazy quantifiers. Laziness only
changes which match a backtracking engine reports, not which strings match, so a lazy
quantifier is read as the greedy one. `\\d \\w \\s` take their ASCII meanings (what
`re.ASCII` gives); their negations match every other code point, non-ASCII included.

Whatever cannot be a regular language over bytes (backreferences, lookaround, word
boundaries, inline flags, anchors in the middle) raises ValueError naming the construct
and its position, rather than being silently ignored: the server must refuse a constraint
it would not enforce.
"""

from __future__ import annotations

import unicodedata

from pdserve.runner.structured.charsets import Ranges, any_char, char_class, complement
from pdserve.runner.structured.regex_ast import Node, Repeat, Seq, alt, literal, seq

# Bounded repeats are expanded copy by copy in the automaton; past this the pattern is
# almost certainly a mistake and would be refused for size anyway.
MAX_REPEAT = 1000
# Each group level costs a few Python stack frames here and in the compiler.
MAX_NESTING = 100

_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20)]  # \t \n \v \f \r and space
_CLASS_ESCAPES: dict[str, Ranges] = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CHAR_ESCAPES = {"a": 0x07, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_ANCHOR_ESCAPES = {
    "b": "word boundary \\b",
    "B": "non-word boundary \\B",
    "A": "anchor \\A",
    "Z": "anchor \\Z",
    "z": "anchor \\z",
}
_GROUP_EXTENSIONS = [  # longest prefix first
    ("(?P=", "named backreference (?P=...)"),
    ("(?<=", "lookbehind (?<=...)"),
    ("(?<!", "negative lookbehind (?<!...)"),
    ("(?=", "lookahead (?=...)"),
    ("(?!", "negative lookahead (?!...)"),
    ("(?#", "comment group (?#...)"),
    ("(?>", "atomic group (?>...)"),
    ("(?(", "conditional group (?(...)...)"),
]
_OCTAL = "01234567"
_HEX = "0123456789abcdefABCDEF"


def parse_regex(pattern: str) -> Node:
    """The byte-level tree of the strings `pattern` fully matches (as UTF-8).

    Raises ValueError for syntax errors and unsupported constructs, with the position.
    """
    return _Parser(pattern).parse()


class _Parser:
    """Recursive descent: alternation -> sequence -> quantified atom -> atom."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.depth = 0

    def error(self, what: str, pos: int | None = None) -> ValueError:
        at = self.i if pos is None else pos
        return ValueError(f"regex {self.p!r}: {what} at position {at}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.p[j] if j < len(self.p) else ""

    def parse(self) -> Node:
        node = self.alternation()
        if self.i < len(self.p):  # alternation only stops early at a ')'
            raise self.error("unbalanced parenthesis ')'")
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return alt(*branches)

    def sequence(self) -> Node:
        items: list[Node] = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            c = self.p[self.i]
            # Under fullmatch `^` opening and `$` closing a top-level branch are no-ops;
            # anywhere else they would constrain the match, which we cannot express.
            if c == "^":
                if self.depth or items:
                    raise self.error("anchor '^' other than at the start is not supported")
                self.i += 1
                continue
            if c == "$":
                if self.depth or self.peek(1) not in ("", "|"):
                    raise self.error("anchor '$' other than at the end is not supported")
                self.i += 1
                continue
            if c in "*+?" or (c == "{" and self.braces() is not None):
                raise self.error(f"quantifier {c!r} with nothing to repeat")
            items.append(self.quantified(self.atom()))
        return seq(*items) if items else Seq(())

    def braces(self) -> tuple[int, int | None, int] | None:
        """`{n}`, `{n,}`, `{,m}`, `{n,m}` at self.i as (min, max, end index); None when the
        brace is not a quantifier (then, like Python, it is a literal '{')."""
        p, j = self.p, self.i + 1
        k = j
        while k < len(p) and p[k].isdigit() and p[k].isascii():
            k += 1
        lo_text, k2 = p[j:k], k
        if k2 < len(p) and p[k2] == ",":
            k2 += 1
            while k2 < len(p) and p[k2].isdigit() and p[k2].isascii():
                k2 += 1
            hi_text: str | None = p[k + 1 : k2]
        else:
            hi_text = None
        if k2 >= len(p) or p[k2] != "}" or (not lo_text and hi_text is None):
            return None
        lo = int(lo_text) if lo_text else 0
        if hi_text is None:
            hi: int | None = lo
        else:
            hi = int(hi_text) if hi_text else None
        return lo, hi, k2 + 1

    def quantified(self, atom: Node) -> Node:
        start = self.i
        c = self.peek()
        if c == "*":
            lo, hi, end = 0, None, self.i + 1
        elif c == "+":
            lo, hi, end = 1, None, self.i + 1
        elif c == "?":
            lo, hi, end = 0, 1, self.i + 1
        elif c == "{" and (b := self.braces()) is not None:
            lo, hi, end = b
        else:
            return atom
        for count in (lo, hi):
            if count is not None and count > MAX_REPEAT:
                raise self.error(f"repeat count {count} is over the limit of {MAX_REPEAT}", start)
        if hi is not None and hi < lo:
            raise self.error(f"repeat {{{lo},{hi}}} has max below min", start)
        self.i = end
        if self.peek() == "?":  # lazy: same language as greedy
            self.i += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifier '+' is not supported")
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.braces() is not None):
            raise self.error("multiple repeat (a quantifier on a quantifier)")
        return Repeat(atom, lo, hi)

    def atom(self) -> Node:
        c = self.p[self.i]
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_set()
        if c == ".":
            self.i += 1
            return any_char(newline=False)
        if c == "\\":
            pos = self.i
            value = self.escape(in_class=False)
            if isinstance(value, int):
                return self.char(value, pos)
            ranges, negate = value
            return char_class(ranges, negate=negate)
        self.i += 1
        return self.char(ord(c), self.i - 1)

    def char(self, cp: int, pos: int) -> Node:
        if 0xD800 <= cp <= 0xDFFF:
            raise self.error(f"surrogate U+{cp:04X} has no UTF-8 encoding", pos)
        return literal(chr(cp))

    def group(self) -> Node:
        start = self.i
        rest = self.p[start:]
        if rest.startswith("(?"):
            if rest.startswith("(?:"):
                self.i += 3
            elif rest.startswith("(?P<"):
                close = self.p.find(">", start + 4)
                name = self.p[start + 4 : close] if close >= 0 else ""
                if not name.isidentifier():
                    raise self.error("bad group name in (?P<name>...)", start)
                self.i = close + 1
            else:
                for prefix, what in _GROUP_EXTENSIONS:
                    if rest.startswith(prefix):
                        raise self.error(f"{what} is not supported", start)
                raise self.error(f"inline flag or group extension {rest[:3]!r} is not supported")
        else:
            self.i += 1
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"groups nested more than {MAX_NESTING} deep", start)
        node = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            raise self.error("missing ')': unterminated group", start)
        self.i += 1
        return node

    def char_set(self) -> Node:
        start = self.i
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: Ranges = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise self.error("unterminated character set '['", start)
            if self.p[self.i] == "]" and not first:  # a ']' right after '[' or '[^' is literal
                self.i += 1
                break
            first = False
            lo_pos = self.i
            lo = self.set_item()
            # 'a-b' is a range unless the '-' is the last thing before ']'.
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                hi = self.set_item()
                if isinstance(lo, list) or isinstance(hi, list):
                    raise self.error("bad character range: a class escape as an endpoint", lo_pos)
                if hi < lo:
                    text = self.p[lo_pos : self.i]
                    raise self.error(f"bad character range {text} (end below start)", lo_pos)
                ranges.append((lo, hi))
            elif isinstance(lo, list):
                ranges.extend(lo)
            else:
                ranges.append((lo, lo))
        return char_class(ranges, negate=negate)

    def set_item(self) -> int | Ranges:
        """One class member: a code point, or the ranges of a class escape like \\d."""
        if self.p[self.i] == "\\":
            value = self.escape(in_class=True)
            if isinstance(value, int):
                return value
            ranges, negate = value
            return complement(ranges) if negate else list(ranges)
        self.i += 1
        return ord(self.p[self.i - 1])

    def escape(self, in_class: bool) -> int | tuple[Ranges, bool]:
        """The escape at self.i: a code point, or a class escape as (ranges, negated)."""
        start = self.i
        if self.i + 1 >= len(self.p):
            raise self.error("pattern ends with a lone backslash", start)
        c = self.p[self.i + 1]
        self.i += 2
        if c.lower() in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c.lower()], c.isupper()
        if c in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[c]
        if c == "b" and in_class:  # inside a class, \b is backspace as in Python
            return 0x08
        if c in _ANCHOR_ESCAPES:
            raise self.error(f"{_ANCHOR_ESCAPES[c]} is not supported", start)
        if c in _HEX_ESCAPES:
            width = _HEX_ESCAPES[c]
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or any(d not in _HEX for d in digits):
                raise self.error(f"incomplete escape \\{c} (needs {width} hex digits)", start)
            self.i += width
            cp = int(digits, 16)
            if cp > 0x10FFFF:
                raise self.error(f"escape \\{c}{digits} is beyond U+10FFFF", start)
            return cp
        if c == "N":
            close = self.p.find("}", self.i)
            if self.peek() != "{" or close < 0:
                raise self.error("bad escape \\N (needs {NAME})", start)
            name = self.p[self.i + 1 : close]
            try:
                ch = unicodedata.lookup(name)
            except KeyError:
                raise self.error(f"unknown character name {name!r}", start) from None
            self.i = close + 1
            return ord(ch)
        if c.isdigit() and c.isascii():
            return self.octal_or_backref(c, start)
        if c.isascii() and c.isalnum():
            raise self.error(f"escape \\{c} is not supported", start)
        return ord(c)  # any other escaped character stands for itself

    def octal_or_backref(self, c: str, start: int) -> int:
        """`\\0`, `\\0o`, `\\0oo` and `\\ooo` (first digit <= 3) are octal, as in Python;
        any other `\\N` is a backreference, which no finite automaton can express."""
        if c == "0":
            digits = c
            while len(digits) < 3 and self.peek() and self.peek() in _OCTAL:
                digits += self.peek()
                self.i += 1
            return int(digits, 8)
        nxt = self.p[self.i : self.i + 2]
        if c in "0123" and len(nxt) == 2 and all(d in _OCTAL for d in nxt):
            self.i += 2
            return int(c + nxt, 8)
        raise self.error(f"backreference \\{c} is not supported", start)
