"""Lark grammars (`structured_outputs.grammar` without `::=`): the reader, `%import common`
and `%ignore`, and the automaton against the oracle (tests/grammar_oracle.py)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from grammar_oracle import accepts, equivalent

from pdserve.runner.structured.byte_dfa import compile_dfa
from pdserve.runner.structured.ebnf_parse import CharClass, GRepeat, GSeq, Pattern, Ref
from pdserve.runner.structured.ebnf_unroll import grammar_node
from pdserve.runner.structured.json_schema import schema_node
from pdserve.runner.structured.lark_parse import COMMON, LARK_ROOT, parse_lark
from pdserve.runner.structured.patterns import (
    StructuredOutputs,
    compile_spec,
    grammar_dfa,
    read_grammar,
)
from pdserve.runner.structured.regex_ast import literal, seq
from pdserve.runner.structured.regex_parse import parse_regex

# Lark's JSON tutorial grammar, as its users write it (aliases, ?rules, common imports).
JSON_LARK = r"""
?start: value
?value: object
      | array
      | string
      | SIGNED_NUMBER      -> number
      | "true"             -> true
      | "false"            -> false
      | "null"             -> null

array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING

%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""


def test_the_reader_takes_lark_syntax():
    """Guards the syntax: modifiers and priorities dropped, `//` comments, a definition
    continued on lines starting with `|`, `[ ]` optional, `"a".."z"`, `"kw"i`, `~ n..m`
    and `{m,n}`, `/regex/` with an escaped slash, aliases dropped, imports with an alias
    and in a list."""
    rules = parse_lark(
        "!start.2: kw [NAME] x ~ 2..3 // a comment\n"
        "    | \"a\"..\"c\"{1,2} -> letters\n"
        'kw: "sel"i\n'
        "x: /a\\/b/\n"
        "%import common.CNAME -> NAME\n"
        "%import common (DIGIT, WS_INLINE)\n"
    )  # fmt: skip
    assert set(rules) == {"start", "kw", "x", "NAME", "DIGIT", "WS_INLINE", LARK_ROOT}
    first, second = rules["start"].options
    assert first == GSeq((Ref("kw"), GRepeat(Ref("NAME"), 0, 1), GRepeat(Ref("x"), 2, 3)))
    assert second == GRepeat(CharClass(((0x61, 0x63),), False), 1, 2)
    s, e, l_ = (CharClass(((ord(c.upper()), ord(c.upper())), (ord(c), ord(c))), False)
                for c in "sel")  # fmt: skip
    assert rules["kw"] == GSeq((s, e, l_))
    assert rules["x"] == Pattern("a/b")
    assert rules["NAME"] == Pattern(COMMON["CNAME"]) and rules[LARK_ROOT] == GSeq((Ref("start"),))


@pytest.mark.parametrize(
    "text, message",
    [
        ('x: "a"', "no `start` rule"),
        ("start: a", "rule 'start' refers to 'a', which is not defined"),
        ('start: A\nA: b\nb: "x"', "terminal 'A' refers to rule 'b'"),
        ('start: "a"\nstart: "b"', "defined twice"),
        ("start{x}: x", "templates"),
        ("start: A\n%declare A", "%declare is not supported"),
        ('start: "a"\n%import python.NAME', "only Lark's `common`"),
        ('start: "a"\n%import common.FOO', "common.FOO is not one of"),
        ("start: /a/i", "regex flags (i) are not supported"),
        ("start: /abc", "unterminated regex"),
        ('start: "a" ~ x', "`~ n` or `~ n..m`"),
        ('start: "a" ~ 3..1', "maximum below its minimum"),
        ("start: 'a'", 'unexpected "\'"'),
        ('start: "ab".."c"', "two single characters"),
        ('start: ("a"', "unclosed '('"),
        ('start: "a")', "unbalanced ')'"),
        ('start: "a"\n%ignore B', "%ignore B: not a terminal"),
        ('start ::= "a"\nx: "b"', "Lark syntax, and this grammar is GBNF"),
        ("start", "expected ':' after 'start'"),
        ("start: %json [1]", "%json needs a JSON schema (an object, or true / false) at line 1"),
        ('start: "a"\n  | %json {"type": }', "%json needs a JSON schema after it: Expecting"),
        ("start: %declare X", "%declare inside a definition (only %json is an item)"),
        ('start: "a"\n%json {}', "%json is an item inside a definition (name: %json {...})"),
    ],
)
def test_bad_lark_is_refused_with_where(text, message):
    """Guards the messages a client gets in its 400 for what the reader cannot take."""
    with pytest.raises(ValueError, match=re.escape(message)):
        read_grammar(text)


@pytest.mark.parametrize("name", sorted(COMMON))
def test_common_terminals_match_what_lark_defines(name):
    """Guards the built-in `%import common` table against samples of each terminal: what
    Lark's common.lark accepts and rejects (written from its definitions)."""
    samples = {
        "DIGIT": (["7"], ["", "12", "a"]),
        "HEXDIGIT": (["f", "A", "9"], ["g", "ff"]),
        "INT": (["0", "0042"], ["", "-1", "1.0"]),
        "SIGNED_INT": (["-3", "+3", "3"], ["--3", "3-"]),
        "DECIMAL": (["1.", "1.5", ".5"], [".", "1", "1e3"]),
        "FLOAT": (["1e3", "1.5E-2", ".5", "2."], ["1", "e3", "1e"]),
        "SIGNED_FLOAT": (["-1e3", "+.5"], ["-1", "+-1.0"]),
        "NUMBER": (["1", "1.5", "1e3"], ["-1", "1..5"]),
        "SIGNED_NUMBER": (["-1", "+1.5e-3", "7"], ["- 1", "+"]),
        "ESCAPED_STRING": (['""', '"a\\"b"', '"\\\\"'], ['"a', '"a"b"', '"\n"', '"\\"']),
        "LCASE_LETTER": (["q"], ["Q", "qq"]),
        "UCASE_LETTER": (["Q"], ["q"]),
        "LETTER": (["q", "Q"], ["1", "é"]),
        "WORD": (["Hello"], ["", "he llo", "h1"]),
        "CNAME": (["_x1", "abc"], ["1x", "a-b"]),
        "WS_INLINE": ([" \t "], ["", "\n"]),
        "WS": ([" \n\r\t\f"], ["", "x"]),
        "CR": (["\r"], ["\n"]),
        "LF": (["\n"], ["\r"]),
        "NEWLINE": (["\n", "\r\n\n"], ["\r", ""]),
        "SH_COMMENT": (["# x", "#"], ["# x\n"]),
        "CPP_COMMENT": (["// x"], ["/ x"]),
        "C_COMMENT": (["/* a */", "/**/", "/* * / **/"], ["/* a */ */", "/* a"]),
        "SQL_COMMENT": (["-- x"], ["- x"]),
    }
    dfa = compile_dfa(parse_regex(COMMON[name]))
    good, bad = samples[name]
    for text in good:
        assert dfa.matches(text.encode()), (name, text)
    for text in bad:
        assert not dfa.matches(text.encode()), (name, text)


def test_the_json_tutorial_grammar_with_ignored_whitespace():
    """Guards `%ignore WS` (whitespace between any two lexemes, before and after, never
    inside one) on Lark's own JSON grammar: JSON texts as json.dumps writes them pass, in
    compact and spread forms; broken ones and space inside a number do not."""
    dfa, depth = grammar_dfa(JSON_LARK)
    assert depth >= 4
    value = {"a": [1, -2.5e3, {"b": None, "c": 'x"y'}], "d": True}
    for text in (json.dumps(value), json.dumps(value, indent=2), f"  {json.dumps(value)}\n"):
        assert dfa.matches(text.encode()), text
    for text in ('{"a" 1}', "[1,]", "[1 2]", "- 1", '{"a": tru e}', "[1.5e 3]"):
        assert not dfa.matches(text.encode()), text


def test_terminals_split_as_the_dynamic_lexer_splits_them():
    """Guards the documented lexing: any split of the text into the terminals the rules
    allow (Earley's dynamic lexer), so `ab` is two NAMEs here; ignored text goes only
    between lexemes, never inside one."""
    dfa, _ = grammar_dfa('start: NAME NAME\nNAME: /[a-z]+/\n%ignore " "')
    for text, want in (("ab", True), ("a b", True), (" a  b ", True), ("a", False)):
        assert dfa.matches(text.encode()) == want, text
    dfa, _ = grammar_dfa('start: WORD\n%import common.WORD\n%ignore " "')
    assert dfa.matches(b" ab ") and not dfa.matches(b"a b")


NESTED = r"""
start: list
list: "[" [item ("," item)*] "]"
item: list | NUM
NUM: /[0-9]/ | "x"i
%ignore " "
"""


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_recursion_and_ignored_text_agree_with_the_oracle_on_every_short_string(depth):
    """Guards the Lark path end to end (reader, lexemes followed by ignored text, the
    unrolling) against the oracle: every string over `[],1 X` up to 5 characters."""
    rules = parse_lark(NESTED)
    dfa = compile_dfa(grammar_node(rules, LARK_ROOT, depth))
    accepted = 0
    for n in range(6):
        for chars in itertools.product("[],1 X", repeat=n):
            text = "".join(chars)
            want = accepts(rules, text, depth, start=LARK_ROOT)
            assert dfa.matches(text.encode()) == want, (text, depth)
            accepted += want
    assert accepted >= 10


def test_a_regular_lark_grammar_is_exactly_its_regex():
    """Guards a Lark grammar without recursion against its regex, whole-language."""
    dfa, depth = grammar_dfa('start: "SELECT " COL ("," COL)* " FROM " /[a-z]+/\nCOL: "a".."c"+')
    want = compile_dfa(parse_regex("SELECT [a-c]+(,[a-c]+)* FROM [a-z]+"))
    assert depth == 1 and equivalent(dfa, want)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_a_json_item_is_its_schemas_language():
    """Guards llguidance's `%json {schema}`: the schema written across lines in the middle
    of a rule is, whole-language, the json_schema compiler's value for it between the
    rule's other items (its property order kept: the compiler writes them in the schema's
    order), and `%json true` any JSON value."""
    text = (
        'start: "Answer: " %json {\n'
        '    "type": "object",\n'
        '    "properties": {"name": {"type": "string", "maxLength": 8},\n'
        '                   "age": {"type": "integer"}},\n'
        '    "required": ["name", "age"], "additionalProperties": false\n'
        '} "."\n'
    )  # fmt: skip
    dfa, depth = grammar_dfa(text)
    want = compile_dfa(seq(literal("Answer: "), schema_node(PERSON), literal(".")))
    assert depth == 1 and equivalent(dfa, want)
    assert equivalent(compile_spec(StructuredOutputs(grammar=text)), want)  # a request's
    assert dfa.matches(b'Answer: {"name":"Ann","age":7}.')
    for bad in ('{"age":7,"name":"Ann"}', '{"name":"Ann"}', '{"name":"Annabelle!","age":7}'):
        assert not dfa.matches(f"Answer: {bad}.".encode()), bad
    anything, _ = grammar_dfa("start: %json true")
    assert equivalent(anything, compile_dfa(schema_node(True)))


def test_a_json_item_is_one_lexeme_under_ignore():
    """Ignored whitespace comes around the JSON value as around any terminal, not inside
    it (where only the schema's own whitespace is allowed); a schema the compiler cannot
    carry out is refused when the grammar is compiled, naming the keyword."""
    dfa, _ = grammar_dfa(
        'start: "sum" %json {"type": "integer"} ";"\n%import common.WS\n%ignore WS'
    )
    for good in (b"sum 12 ;", b"sum12;", b" sum\n12 ;\n"):
        assert dfa.matches(good), good
    for bad in (b"sum 1 2;", b"sum 1.5;", b"sum ;"):
        assert not dfa.matches(bad), bad
    with pytest.raises(ValueError, match="multipleOf"):
        grammar_dfa('start: %json {"type": "integer", "multipleOf": 3}')
