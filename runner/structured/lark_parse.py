"""Lark grammars, the other syntax vLLM's `structured_outputs.grammar` takes (its guidance
backend reads them; OpenAI's custom tools send them):

    start: "SELECT " NAME ("," NAME)* " FROM " NAME
    NAME: /[a-z_]+/
    %import common.WS
    %ignore WS

Rules are lowercase (`name: ...`, modifiers `?` `!` and priorities `.n` read and dropped),
terminals uppercase (`NAME: ...`, regular: they refer only to terminals); generation
starts at `start`. Items: `"text"` (with `i`: either case), `/regex/` (regex_parse.py's
syntax, no flags), `"a".."z"`, names, `( )`, `[ ]` (optional), and the quantifiers `?` `*`
`+` `~n` `~n..m` (and llguidance's `{m,n}`); `-> alias` is dropped. llguidance's
`%json {schema}` is an item too: one JSON value the schema allows, as a `json_schema`
response format reads it (json_schema.py; its whitespace rules inside the value), taken
as one lexeme (ignored terminals may come before and after it, not inside). A
definition ends at the end of its line unless the next line starts with `|`; inside
brackets, newlines are spaces. `//` starts a comment. Directives: `%import common.NAME`
(`-> ALIAS`, or `common (A, B)`: the terminals of Lark's common.lark, below) and
`%ignore` (a terminal, string or regex). Anything else (`%declare`, `%override`, other modules, templates) is
refused by name.

Which strings match: Lark's Earley parser with its dynamic lexer: any split of the text
into terminals the rules allow, with the ignored terminals anywhere between (and before
and after) them. (Lark's standard lexer would, e.g., not split `ab` into two NAMEs.)

The result is the same rule dict as a GBNF grammar's (`ebnf_parse.py`), with `start`
reached from a rule no Lark name can spell.
"""

from __future__ import annotations

import json

from pdserve.runner.structured.ebnf_parse import (
    CharClass,
    Expr,
    GAlt,
    GrammarReader,
    GRepeat,
    GSeq,
    JsonSchema,
    Pattern,
    Ref,
    Text,
    check_defined,
    refs_of,
)

LARK_START = "start"
LARK_ROOT = "%root"  # the rule generation starts at: `%ignore`d terminals, then start
IGNORED = "%ignored"
# Lark's common.lark, as regexes in regex_parse.py's syntax (written for what each
# terminal matches; `.` there excludes a newline, as Lark's does).
COMMON = {
    "DIGIT": "[0-9]",
    "HEXDIGIT": "[0-9a-fA-F]",
    "INT": "[0-9]+",
    "SIGNED_INT": "[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    "SIGNED_FLOAT": r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    "NUMBER": r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+",
    "SIGNED_NUMBER": (
        r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)"
    ),
    "ESCAPED_STRING": r'"([^"\\\n]|\\.)*"',
    "LCASE_LETTER": "[a-z]",
    "UCASE_LETTER": "[A-Z]",
    "LETTER": "[a-zA-Z]",
    "WORD": "[a-zA-Z]+",
    "CNAME": "[a-zA-Z_][a-zA-Z0-9_]*",
    "WS_INLINE": "[ \t]+",
    "WS": "[ \t\f\r\n]+",
    "CR": "\r",
    "LF": "\n",
    "NEWLINE": "(\r?\n)+",
    "SH_COMMENT": "#[^\n]*",
    "CPP_COMMENT": "//[^\n]*",
    "C_COMMENT": r"/\*([^*]|\*+[^*/])*\*+/",
    "SQL_COMMENT": "--[^\n]*",
}


def looks_like_gbnf(text: str) -> bool:
    """GBNF defines with `::=`, Lark with `:` (vLLM tells them apart the same way)."""
    return "::=" in text


def parse_lark(text: str) -> dict[str, Expr]:
    """A Lark grammar's rules, with `LARK_ROOT` the rule to start at; ValueError says what
    is wrong and where."""
    reader = _LarkReader(text)
    defs, ignored = reader.definitions()
    if LARK_START not in defs:
        raise ValueError(f"the grammar has no `{LARK_START}` rule (generation starts there)")
    check_defined(defs, _kind)
    for name, body in defs.items():
        for ref in sorted(refs_of(body)):
            if _is_terminal(name) and not _is_terminal(ref):
                raise ValueError(
                    f"terminal {name!r} refers to rule {ref!r} (terminals are regular)"
                )
    for ref in sorted(set().union(*(refs_of(e) for e in ignored)) if ignored else ()):
        if ref not in defs or not _is_terminal(ref):
            raise ValueError(f"%ignore {ref}: not a terminal defined in the grammar")
    rules = {
        n: (b if _is_terminal(n) else _lexemes_then_ignored(b, ignored)) for n, b in defs.items()
    }
    lead: list[Expr] = [GRepeat(Ref(IGNORED), 0, None)] if ignored else []
    rules[LARK_ROOT] = GSeq((*lead, Ref(LARK_START)))
    if ignored:
        rules[IGNORED] = ignored[0] if len(ignored) == 1 else GAlt(tuple(ignored))
    return rules


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def _kind(name: str) -> str:
    return "terminal" if _is_terminal(name) else "rule"


def _lexemes_then_ignored(e: Expr, ignored: list[Expr]) -> Expr:
    """A rule body with each lexeme (a terminal, string or regex) followed by any number of
    ignored terminals."""
    if not ignored:
        return e
    if isinstance(e, Ref) and not _is_terminal(e.name):
        return e
    if isinstance(e, (Text, CharClass, Pattern, JsonSchema, Ref)):
        return GSeq((e, GRepeat(Ref(IGNORED), 0, None)))
    if isinstance(e, GSeq):
        return GSeq(tuple(_lexemes_then_ignored(i, ignored) for i in e.items))
    if isinstance(e, GAlt):
        return GAlt(tuple(_lexemes_then_ignored(o, ignored) for o in e.options))
    assert isinstance(e, GRepeat), e
    return GRepeat(_lexemes_then_ignored(e.item, ignored), e.min, e.max)


class _LarkReader(GrammarReader):
    def skip_space(self, newlines: bool = True) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if self.s.startswith("//", self.i):
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end
            elif c in " \t\r" or (c == "\n" and (newlines or self.continues())):
                self.i += 1
            else:
                return

    def continues(self) -> bool:
        """Whether the definition goes on past the newline at self.i (next line: `|`)."""
        j = self.i
        while j < len(self.s) and (self.s[j].isspace() or self.s.startswith("//", j)):
            if self.s.startswith("//", j):
                end = self.s.find("\n", j)
                j = len(self.s) if end < 0 else end
            else:
                j += 1
        return self.s[j : j + 1] == "|"

    def definitions(self) -> tuple[dict[str, Expr], list[Expr]]:
        defs: dict[str, Expr] = {}
        ignored: list[Expr] = []
        self.skip_space()
        while self.i < len(self.s):
            start = self.i
            if self.peek() == "%":
                self.directive(defs, ignored)
            else:
                name = self.head()
                if name in defs:
                    raise self.error(f"{_kind(name)} {name!r} is defined twice", start)
                defs[name] = self.alternatives(nested=False)
            self.skip_space(newlines=False)
            if self.i < len(self.s) and self.peek() != "\n":
                raise self.error(f"unexpected {self.peek()!r}")
            self.skip_space()
        return defs, ignored

    def head(self) -> str:
        """`name:` with Lark's modifiers (`?`, `!`) and priority (`.n`): the name."""
        start = self.i
        self.i += self.peek() in ("?", "!")
        end = self.name_at(self.i)
        if end == self.i:
            raise self.error("expected a definition `name: ...` or a %directive", start)
        name = self.s[self.i : end]
        self.i = end
        if self.peek() == "{":
            raise self.error(f"templates ({name}{{...}}) are not supported", start)
        if self.peek() == ".":
            self.i += 1
            while self.peek() in "-0123456789" and self.peek():
                self.i += 1
        self.skip_space(newlines=False)
        if self.peek() != ":":
            if self.s.startswith("::=", self.i):
                raise self.error("`::=` is GBNF: a grammar is either GBNF or Lark", start)
            raise self.error(f"expected ':' after {name!r}", start)
        self.i += 1
        return name

    def directive(self, defs: dict[str, Expr], ignored: list[Expr]) -> None:
        start = self.i
        end = self.name_at(self.i + 1)
        word = self.s[self.i + 1 : end]
        self.i = end
        self.skip_space(newlines=False)
        if word == "ignore":
            ignored.append(self.alternatives(nested=False))
            return
        if word == "json":
            raise self.error("%json is an item inside a definition (name: %json {...})", start)
        if word != "import":
            raise self.error(f"%{word} is not supported (only %import common and %ignore)", start)
        module_end = self.name_at(self.i)
        while self.s[module_end : module_end + 1] == "." and self.name_at(module_end + 1) > (
            module_end + 1
        ):
            module_end = self.name_at(module_end + 1)
        module = self.s[self.i : module_end]
        if not module.startswith("common"):
            raise self.error(f"%import {module or '...'}: only Lark's `common` is built in", start)
        self.i = module_end
        if module.startswith("common."):
            names = [(module[len("common.") :], None)]
            self.skip_space(newlines=False)
            if self.s.startswith("->", self.i):
                self.i += 2
                self.skip_space(newlines=False)
                alias_end = self.name_at(self.i)
                names = [(names[0][0], self.s[self.i : alias_end])]
                self.i = alias_end
        else:
            self.skip_space(newlines=False)
            close = self.s.find(")", self.i)
            if self.peek() != "(" or close < 0:
                raise self.error("write %import common.NAME or %import common (A, B)", start)
            names = [(n.strip(), None) for n in self.s[self.i + 1 : close].split(",") if n.strip()]
            self.i = close + 1
        for name, alias in names:
            if name not in COMMON:
                raise self.error(f"common.{name} is not one of the terminals built in", start)
            defs.setdefault(alias or name, Pattern(COMMON[name]))

    def sequence(self, nested: bool) -> Expr:
        items: list[Expr] = []
        while True:
            self.skip_space(newlines=nested)
            c = self.peek()
            if c in ("", "|", "\n") or (c in ")]" and nested):
                break
            if c in ")]":
                raise self.error(f"unbalanced {c!r}")
            if self.s.startswith("->", self.i):  # an alias: the tree's name, not the text's
                self.i += 2
                self.skip_space(newlines=False)
                self.i = self.name_at(self.i)
                continue
            items.append(self.quantified(self.item()))
        return items[0] if len(items) == 1 else GSeq(tuple(items))

    def item(self) -> Expr:
        c, start = self.peek(), self.i
        if c == '"':
            text = self.literal(c)
            if self.s.startswith("..", self.i):
                self.i += 2
                if self.peek() != '"':
                    raise self.error('a range is "a".."z"', start)
                hi = self.literal('"')
                if len(text) != 1 or len(hi) != 1 or hi < text:
                    raise self.error('a range is two single characters, "a".."z"', start)
                return CharClass(((ord(text), ord(hi)),), False)
            if self.peek() == "i" and self.name_at(self.i) == self.i + 1:
                self.i += 1
                return _either_case(text)
            return Text(text)
        if c == "/":
            return self.regex()
        if c == "%" and self.name_at(self.i + 1) > self.i + 1:
            return self.embedded_schema()
        if c in "([":
            self.i += 1
            body = self.alternatives(nested=True)
            self.skip_space()
            close = ")" if c == "(" else "]"
            if self.peek() != close:
                raise self.error(f"unclosed {c!r}", start)
            self.i += 1
            return body if c == "(" else GRepeat(body, 0, 1)
        end = self.name_at(self.i)
        if end > self.i:
            self.i = end
            return Ref(self.s[start:end])
        if c in "*+?~{":
            raise self.error(f"quantifier {c!r} with nothing to repeat")
        raise self.error(f"unexpected {c!r}")

    def embedded_schema(self) -> Expr:
        """`%json` then a JSON schema (an object, or true / false), across lines."""
        start, end = self.i, self.name_at(self.i + 1)
        word = self.s[self.i + 1 : end]
        if word != "json":
            raise self.error(f"%{word} inside a definition (only %json is an item)", start)
        self.i = end
        self.skip_space()
        try:
            schema, self.i = json.JSONDecoder().raw_decode(self.s, self.i)
        except json.JSONDecodeError as e:
            raise self.error(f"%json needs a JSON schema after it: {e.msg}", start) from None
        if not isinstance(schema, (dict, bool)):
            raise self.error("%json needs a JSON schema (an object, or true / false)", start)
        return JsonSchema(json.dumps(schema, separators=(",", ":")))  # in its key order

    def regex(self) -> Expr:
        start = self.i
        j = self.i + 1
        while j < len(self.s) and self.s[j] != "/":
            if self.s[j] == "\n":
                break
            j += 2 if self.s[j] == "\\" else 1
        if j >= len(self.s) or self.s[j] != "/":
            raise self.error("unterminated regex /.../", start)
        pattern = self.s[self.i + 1 : j].replace("\\/", "/")
        self.i = j + 1
        flags_end = self.name_at(self.i)
        if flags_end > self.i and self.s[self.i : flags_end].isalpha():
            flags = self.s[self.i : flags_end]
            raise self.error(f"regex flags ({flags}) are not supported", start)
        return Pattern(pattern)

    def quantified(self, item: Expr) -> Expr:
        while True:
            self.skip_space(newlines=False)  # Lark's grammar allows `a *`, `a ~ 2`
            c = self.peek()
            if c == "~":
                item = self.tilde(item)
            elif c and c in "*+?{":
                item = super().quantified(item)
            else:
                return item

    def tilde(self, item: Expr) -> Expr:
        """`item ~ n` or `item ~ n..m`."""
        start = self.i
        self.i += 1
        self.skip_space(newlines=False)
        j = self.i
        while self.s[j : j + 1].isdigit() or self.s[j : j + 1] == ".":
            j += 1
        lo, dots, hi = self.s[self.i : j].partition("..")
        if not lo.isdigit() or (dots and not hi.isdigit()):
            raise self.error("a repeat is `~ n` or `~ n..m`", start)
        self.i = j
        return self.bounded(item, int(lo), int(hi) if dots else int(lo), start)


def _either_case(text: str) -> Expr:
    items = tuple(
        CharClass(tuple((ord(x), ord(x)) for x in sorted({ch.lower(), ch.upper()})), False)
        if ch.lower() != ch.upper()
        else Text(ch)
        for ch in text
    )
    return items[0] if len(items) == 1 else GSeq(items)
