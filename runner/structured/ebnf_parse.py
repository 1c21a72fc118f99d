"""Grammars as vLLM's `structured_outputs.grammar` takes them: GBNF / xgrammar EBNF text.

    root   ::= "SELECT " column " FROM " table   # a comment
    column ::= [a-z_]+ | "*"
    table  ::= ident ("." ident)?
    ident  ::= [a-zA-Z] [a-zA-Z0-9_]{0,31}

A grammar is rules `name ::= body`; generation starts at `root`. A body is alternatives
(`|`) of sequences of items, each item optionally quantified by `*`, `+`, `?`, `{m}`,
`{m,}` or `{m,n}`. Items are string literals (`"..."` or `'...'`), character classes
(`[a-z]`, `[^"\\\\]`), `.` (any character), rule names and parenthesized bodies.
Escapes, in literals and classes: `\\n \\r \\t \\\\ \\" \\' \\[ \\] \\-`, `\\xHH`, `\\uHHHH`,
`\\UHHHHHHHH`. Whitespace and newlines separate items anywhere; a new rule starts where
a name is followed by `::=`. `#` starts a comment outside literals and classes.

Not supported (each refused by name): lookahead assertions `(= ...)` and anything else
the syntax above does not name. A grammar without `::=` is read as Lark (`lark_parse.py`).

This module only reads the text; `ebnf_unroll.py` turns the rules into an automaton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.runner.structured.charsets import MAX_CODE_POINT, Ranges

ROOT = "root"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "0": 0x00, "\\": 0x5C, '"': 0x22, "'": 0x27,
            "[": 0x5B, "]": 0x5D, "-": 0x2D, "/": 0x2F, "^": 0x5E}  # fmt: skip
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_HEX = frozenset("0123456789abcdefABCDEF")
_LARK_IN_GBNF = (
    "`name: ...` is Lark syntax, and this grammar is GBNF (it has `::=`): write `name ::= ...`"
)
MAX_REPEAT = 1024
MAX_NESTING = 100  # `{m,n}` bounds: each copy is a copy of its item in the automaton


@dataclass(frozen=True)
class Text:
    """Exactly this text (its UTF-8 bytes); "" matches the empty string."""

    text: str


@dataclass(frozen=True)
class CharClass:
    """One character in `ranges` (inclusive code point ranges), or not in them (`negate`)."""

    ranges: tuple[tuple[int, int], ...]
    negate: bool


@dataclass(frozen=True)
class Pattern:
    """Text the regex `regex` fully matches (regex_parse.py's syntax): Lark's `/.../`."""

    regex: str


@dataclass(frozen=True)
class JsonSchema:
    """A JSON value the schema allows (json_schema.py's reading): llguidance's `%json {...}`
    in a Lark grammar. `schema` is the schema's compact JSON text, keys in their order (the
    properties' order is the output's), so the node stays hashable."""

    schema: str


@dataclass(frozen=True)
class Ref:
    """The rule named `name`."""

    name: str


@dataclass(frozen=True)
class GSeq:
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class GAlt:
    options: tuple[Expr, ...]


@dataclass(frozen=True)
class GRepeat:
    """`item` min..max times (max None: no bound)."""

    item: Expr
    min: int
    max: int | None


Expr = Text | CharClass | Pattern | JsonSchema | Ref | GSeq | GAlt | GRepeat


def parse_grammar(text: str) -> dict[str, Expr]:
    """The rules of a GBNF grammar, in the order written; ValueError says what is wrong and
    where (line and column). Every rule referenced is defined and `root` is among them."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the grammar is empty: give rules as `name ::= ...`, starting at root")
    rules = GrammarReader(text).rules()
    if ROOT not in rules:
        raise ValueError(f"the grammar has no `{ROOT}` rule (generation starts at {ROOT})")
    check_defined(rules)
    return rules


def check_defined(rules: dict[str, Expr], kind: Callable[[str], str] = lambda _: "rule") -> None:
    """ValueError naming the first reference to a name `rules` does not define (`kind`
    names what the referring definition is: a rule, or a Lark terminal)."""
    for name, body in rules.items():
        for ref in sorted(refs_of(body)):
            if ref not in rules:
                raise ValueError(f"{kind(name)} {name!r} refers to {ref!r}, which is not defined")


def refs_of(expr: Expr) -> set[str]:
    """The rule names `expr` refers to directly."""
    if isinstance(expr, Ref):
        return {expr.name}
    if isinstance(expr, (GSeq, GAlt)):
        parts = expr.items if isinstance(expr, GSeq) else expr.options
        return set().union(*(refs_of(p) for p in parts)) if parts else set()
    if isinstance(expr, GRepeat):
        return refs_of(expr.item)
    return set()


class GrammarReader:
    """Recursive descent over GBNF text: rules -> alternatives -> sequence -> item. The
    lexing pieces (literals, escapes, `{m,n}`, errors with line and column) are shared with
    the Lark reader (`lark_parse.py`), which overrides the structure."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.depth = 0  # groups open (Python's stack bounds the recursive descent)

    def error(self, what: str, pos: int | None = None) -> ValueError:
        at = self.i if pos is None else pos
        line = self.s.count("\n", 0, at) + 1
        col = at - (self.s.rfind("\n", 0, at) + 1) + 1
        return ValueError(f"grammar: {what} at line {line}, column {col}")

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def skip_space(self) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c == "#":
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end
            elif c.isspace():
                self.i += 1
            else:
                return

    def name_at(self, i: int) -> int:
        """The end of a rule name starting at `i` (== i when there is none)."""
        j = i
        while j < len(self.s) and self.s[j] in _NAME_CHARS:
            j += 1
        return j

    def rule_starts(self) -> bool:
        """Whether a `name ::=` begins at self.i (after spaces)."""
        end = self.name_at(self.i)
        if end == self.i:
            return False
        j = end
        while j < len(self.s) and self.s[j] in " \t":
            j += 1
        return self.s.startswith("::=", j)

    def rules(self) -> dict[str, Expr]:
        out: dict[str, Expr] = {}
        self.skip_space()
        while self.i < len(self.s):
            start = self.i
            if not self.rule_starts():
                end = self.name_at(self.i)
                if end > self.i and self.s[end : end + 1] == ":":
                    raise self.error(_LARK_IN_GBNF)
                raise self.error("expected a rule `name ::= ...`")
            name = self.s[self.i : self.name_at(self.i)]
            if name in out:
                raise self.error(f"rule {name!r} is defined twice", start)
            self.i = self.s.index("::=", self.i) + 3
            out[name] = self.alternatives(nested=False)
            self.skip_space()
        return out

    def alternatives(self, nested: bool) -> Expr:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"groups nest more than {MAX_NESTING} deep")
        options = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence(nested))
        self.depth -= 1
        return options[0] if len(options) == 1 else GAlt(tuple(options))

    def sequence(self, nested: bool) -> Expr:
        items: list[Expr] = []
        while True:
            self.skip_space()
            c = self.peek()
            if c in ("", "|") or (c == ")" and nested):
                break
            if c == ")":
                raise self.error("unbalanced parenthesis ')'")
            if not nested and self.rule_starts():
                break
            items.append(self.quantified(self.item()))
        return items[0] if len(items) == 1 else GSeq(tuple(items))

    def item(self) -> Expr:
        c, start = self.peek(), self.i
        if c in "\"'":
            return Text(self.literal(c))
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return CharClass(((0, MAX_CODE_POINT),), False)
        if c == "(":
            self.i += 1
            self.skip_space()
            if self.peek() == "=":
                raise self.error("lookahead assertions `(= ...)` are not supported", start)
            body = self.alternatives(nested=True)
            self.skip_space()
            if self.peek() != ")":
                raise self.error("unclosed parenthesis '('", start)
            self.i += 1
            return body
        end = self.name_at(self.i)
        if end > self.i:
            self.i = end
            return Ref(self.s[start:end])
        if c in "*+?{":
            raise self.error(f"quantifier {c!r} with nothing to repeat")
        if c == ":":
            raise self.error(_LARK_IN_GBNF)
        raise self.error(f"unexpected {c!r}")

    def quantified(self, item: Expr) -> Expr:
        while True:
            c = self.peek()
            if c == "*":
                item, self.i = GRepeat(item, 0, None), self.i + 1
            elif c == "+":
                item, self.i = GRepeat(item, 1, None), self.i + 1
            elif c == "?":
                item, self.i = GRepeat(item, 0, 1), self.i + 1
            elif c == "{":
                item = self.braces(item)
            else:
                return item

    def braces(self, item: Expr) -> Expr:
        start = self.i
        close = self.s.find("}", self.i)
        if close < 0:
            raise self.error("unclosed '{'", start)
        body = self.s[self.i + 1 : close].replace(" ", "")
        lo_text, comma, hi_text = body.partition(",")
        if not lo_text.isdigit() or (hi_text and not hi_text.isdigit()):
            raise self.error(f"bad repeat {{{body}}} (write {{m}}, {{m,}} or {{m,n}})", start)
        lo = int(lo_text)
        hi = None if comma and not hi_text else int(hi_text or lo_text)
        self.i = close + 1
        return self.bounded(item, lo, hi, start)

    def bounded(self, item: Expr, lo: int, hi: int | None, start: int) -> Expr:
        """`item` lo..hi times, the bounds checked."""
        if hi is not None and hi < lo:
            raise self.error(f"repeat {lo}..{hi} has its maximum below its minimum", start)
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repeat {lo}..{hi} is over {MAX_REPEAT}", start)
        return GRepeat(item, lo, hi)

    def literal(self, quote: str) -> str:
        start = self.i
        self.i += 1
        out: list[str] = []
        while True:
            c = self.peek()
            if c == "":
                raise self.error("unterminated string literal", start)
            if c == quote:
                self.i += 1
                return "".join(out)
            if c == "\n":
                raise self.error("a newline inside a string literal (write \\n)", start)
            out.append(chr(self.char()))

    def char_class(self) -> Expr:
        start = self.i
        self.i += 1
        negate = self.peek() == "^"
        self.i += negate
        ranges: Ranges = []
        while True:
            c = self.peek()
            if c == "":
                raise self.error("unclosed character class '['", start)
            if c == "]":
                self.i += 1
                return CharClass(tuple(ranges), negate)
            lo = self.char()
            hi = lo
            if self.peek() == "-" and self.s[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.char()
                if hi < lo:
                    raise self.error(f"class range {chr(lo)!r}-{chr(hi)!r} is reversed", start)
            ranges.append((lo, hi))

    def char(self) -> int:
        """One character of a literal or class at self.i (an escape or itself)."""
        c = self.peek()
        if c != "\\":
            if 0xD800 <= ord(c) <= 0xDFFF:
                raise self.error("a lone surrogate is not a character")
            self.i += 1
            return ord(c)
        start = self.i
        e = self.s[self.i + 1 : self.i + 2]
        self.i += 2
        if e in _ESCAPES:
            return _ESCAPES[e]
        if e in _HEX_WIDTH:
            digits = self.s[self.i : self.i + _HEX_WIDTH[e]]
            if len(digits) != _HEX_WIDTH[e] or not set(digits) <= _HEX:
                raise self.error(f"escape \\{e} needs {_HEX_WIDTH[e]} hex digits", start)
            self.i += len(digits)
            cp = int(digits, 16)
            if cp > MAX_CODE_POINT or 0xD800 <= cp <= 0xDFFF:
                raise self.error(f"escape \\{e}{digits} is not a character", start)
            return cp
        raise self.error(f"unknown escape \\{e or '(end)'}", start)
