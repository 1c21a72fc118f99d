"""GBNF grammars (`structured_outputs.grammar`): the parser, the unrolled automaton against
an independent matcher, and the depth the compiler picks.

The oracle (`grammar_oracle.accepts`) interprets the parsed rules directly by backtracking over the text,
with the same bound on recursion (a rule that can reach itself open at most `depth` times
at once); the automaton under test comes from unrolling the rules into one pattern tree and
compiling it. Regular grammars are also checked for exact language equality against the
DFA of a hand-written regex.
"""

from __future__ import annotations

import itertools
import re

import pytest
from grammar_oracle import accepts, equivalent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.structured_api import compile_checked, parse_structured
from pdserve.runner.structured.byte_dfa import compile_dfa
from pdserve.runner.structured.ebnf_parse import (
    CharClass,
    GAlt,
    GRepeat,
    Ref,
    Text,
    parse_grammar,
)
from pdserve.runner.structured.ebnf_unroll import grammar_node, recursive_rules
from pdserve.runner.structured.nfa import nfa_size
from pdserve.runner.structured.patterns import (
    GRAMMAR_MAX_DEPTH,
    compile_spec,
    grammar_depth,
    grammar_dfa,
    read_grammar,
)
from pdserve.runner.structured.regex_parse import parse_regex
from pdserve.runner.structured.spec import StructuredOutputs

EXPR = r"""
# arithmetic, the usual three levels
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor ("*" factor)*
factor ::= [0-9] | "(" expr ")"
"""
LISTS = r"""
root ::= v
v    ::= "[" (v ("," v)*)? "]" | item
item ::= "1" | "22"
"""
# The README's example (vLLM's docs use the same shape).
SQL = r"""
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


def test_the_parser_reads_gbnf_and_xgrammar_syntax():
    """Guards the syntax: both quotes, escapes (\\x, \\u, \\U, \\n, \\"), classes with ranges,
    negation and escaped brackets, `.`, every quantifier, groups across lines, comments, and
    a rule boundary found by `name ::=` whatever the line breaks."""
    rules = parse_grammar(
        'root ::= "a\\"\\x41\\u00e9\\U0001F600" \'b\' # comment\n'
        '  ( x | [^\\]a-c\\n] )+ .? x{2} x{1,} x{0,3}\n'
        "x ::=\n  [0-9]\n  | \"\"   # an empty option\n"
    )  # fmt: skip
    assert list(rules) == ["root", "x"]
    items = rules["root"].items
    assert items[0] == Text('a"A\u00e9\U0001f600') and items[1] == Text("b")
    assert items[2] == GRepeat(
        GAlt((Ref("x"), CharClass(((0x5D, 0x5D), (0x61, 0x63), (0x0A, 0x0A)), True))), 1, None
    )
    assert items[3] == GRepeat(CharClass(((0, 0x10FFFF),), False), 0, 1)
    assert [(i.min, i.max) for i in items[4:]] == [(2, 2), (1, None), (0, 3)]
    assert rules["x"] == GAlt((CharClass(((0x30, 0x39),), False), Text("")))


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ('x ::= "a"', "no `root` rule"),
        ("root ::= y", "refers to 'y', which is not defined"),
        ('root ::= "a"\nroot ::= "b"', "defined twice"),
        ('root ::= x\nx: "a"', "is Lark syntax, and this grammar is GBNF"),
        ('root ::= (= "a") "a"', "lookahead"),
        ('root ::= "abc', "unterminated string literal at line 1, column 10"),
        ('root ::= "a\nb"', "newline inside a string"),
        ("root ::= [a-", "unclosed character class"),
        ("root ::= [z-a]", "reversed"),
        ('root ::= "\\q"', "unknown escape \\q"),
        ('root ::= "\\x4"', "needs 2 hex digits"),
        ('root ::= "\\uD800"', "not a character"),
        ('root ::= "a"{3,1}', "repeat 3..1 has its maximum below its minimum"),
        ('root ::= "a"{x}', "bad repeat"),
        ('root ::= "a"{2000}', "over 1024"),
        ("root ::= * 'a'", "nothing to repeat"),
        ("root ::= 'a')", "unbalanced"),
        ("root ::= ('a'", "unclosed parenthesis"),
        ("root ::= 'a' @", "unexpected '@' at line 1, column 14"),
        ("root ::= '\ud800'", "lone surrogate"),
    ],
)
def test_bad_grammars_are_refused_with_where(text, message):
    """Guards the error messages a client sees in its 400: what is wrong and where."""
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_grammar(text)


@pytest.mark.parametrize(
    "grammar, regex",
    [
        (SQL, r"SELECT (col_1 |col_2 ) from (table_1 |table_2 ) where (col_1 |col_2 )= (1 |2 )"),
        (
            r'root ::= "-"? d+ ("." d{1,3})? ; d ::= [0-9]'.replace(";", "\n"),
            r"-?[0-9]+(\.[0-9]{1,3})?",
        ),  # fmt: skip
        (
            "root ::= [^\"\\\\\\n]* 'é' [\\u4e00-\\u4e05]{2,} .",
            '[^"\\\\\\n]*é[\u4e00-\u4e05]{2,}(.|\\n)',
        ),  # fmt: skip
        ('root ::= w (", " w)* | ""\nw ::= [a-c]+', r"([a-c]+(, [a-c]+)*)?"),
    ],
)
def test_a_regular_grammar_is_exactly_its_regex(grammar, regex):
    """Guards that a grammar without recursion loses nothing to the bound: its automaton
    accepts exactly the language of the equivalent regex (whole-language equality of the
    two DFAs, plus the oracle on samples)."""
    rules = parse_grammar(grammar)
    assert not recursive_rules(rules)
    dfa, depth = grammar_dfa(grammar)
    assert depth == 1 and equivalent(dfa, compile_dfa(parse_regex(regex)))
    for text in ("SELECT col_2  from table_1  where col_1 = 2 ", "-12.5", "a, bc", "", "ab,"):
        assert dfa.matches(text.encode()) == accepts(rules, text, 1), text


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize(
    "grammar, alphabet, max_len",
    [(EXPR, "(1+*)", 6), (LISTS, "[],12", 6)],
)
def test_recursion_to_a_depth_agrees_with_the_oracle_on_every_short_string(
    grammar, alphabet, max_len, depth
):
    """Guards the unrolling (the memo keyed by the open rules of a cycle, the `X (S X)*`
    rewrite, dropping branches past the bound) against the oracle: every string over the
    alphabet up to `max_len` characters, accepted exactly when the oracle accepts it."""
    rules = parse_grammar(grammar)
    dfa = compile_dfa(grammar_node(rules, "root", depth))
    agreed = accepted = 0
    for n in range(max_len + 1):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            want = accepts(rules, text, depth)
            assert dfa.matches(text.encode()) == want, (text, depth)
            agreed, accepted = agreed + 1, accepted + want
    assert accepted >= 3 and agreed > accepted  # both outcomes were exercised


def test_the_bound_is_where_nesting_stops():
    """Guards the depth semantics the docs state: with depth d, d - 1 parentheses nest
    inside the top expression, and one more is outside the language."""
    rules = parse_grammar(EXPR)
    for depth in (2, 5, 8):
        dfa = compile_dfa(grammar_node(rules, "root", depth))
        inside = "(" * (depth - 1) + "1+2" + ")" * (depth - 1)
        assert dfa.matches(inside.encode()) and accepts(rules, inside, depth)
        deeper = "(" + inside + ")"
        assert not dfa.matches(deeper.encode()) and not accepts(rules, deeper, depth)


def test_lists_of_nested_values_stay_linear_in_depth():
    """Guards the `X (S X)*` rewrite: without it each level of EXPR doubles the automaton
    (term and factor appear twice a level) and depth 8 would not fit."""
    rules = parse_grammar(EXPR)
    sizes = [nfa_size(grammar_node(rules, "root", d)) for d in range(1, 9)]
    steps = {b - a for a, b in itertools.pairwise(sizes)}
    assert len(steps) == 1, sizes  # the same number of states for every level


def test_the_compiler_takes_the_deepest_bound_that_fits():
    """Guards the depth search: four kinds of brackets make a DFA that must remember the
    stack (~4^d states), so depth 8 does not fit 20,000 states and the compiler keeps the
    deepest that does; the result accepts nesting to that depth and no deeper."""
    grammar = 'root ::= x\nx ::= "(" x* ")" | "[" x* "]" | "{" x* "}" | "<" x* ">" | "a"'
    dfa, depth = grammar_dfa(grammar)
    assert 2 <= depth < GRAMMAR_MAX_DEPTH
    with pytest.raises(ValueError, match="more than 20000 automaton states"):
        compile_dfa(grammar_node(parse_grammar(grammar), "root", depth + 1))
    nest = "".join("([{<"[i % 4] for i in range(depth - 1))
    close = "".join(")]}>"[i % 4] for i in reversed(range(depth - 1)))
    assert dfa.matches((nest + "a" + close).encode())
    assert not dfa.matches((nest + "(a)" + close).encode())
    assert grammar_dfa(EXPR)[1] == GRAMMAR_MAX_DEPTH
    # What the worker's log reports beside the states.
    assert grammar_depth(StructuredOutputs(grammar=grammar)) == depth
    assert grammar_depth(StructuredOutputs(regex="a")) is None


def test_a_grammar_that_never_ends_is_refused():
    """Guards the empty language: a grammar whose every derivation recurses is refused with
    a message that says so (not as a "too large" automaton, and not at some depth)."""
    for grammar in ('root ::= "(" root ")"', 'root ::= a\na ::= "(" b ")"\nb ::= a "x" | a'):
        with pytest.raises(ValueError, match="matches no text: every way through root"):
            grammar_dfa(grammar)
    assert grammar_dfa('root ::= a\na ::= "(" b ")"\nb ::= a | "x"')[0].matches(b"(((x)))")


def test_the_api_takes_grammars_under_both_names_and_refuses_bad_ones_by_field():
    """Guards the request side: `structured_outputs.grammar` and `guided_grammar` both give
    the grammar spec (which travels in the wire form and compiles), and a bad grammar is a
    400 naming the field it came in."""
    import asyncio

    for body in ({"structured_outputs": {"grammar": SQL}}, {"guided_grammar": SQL}):
        spec = parse_structured(body)
        assert spec == StructuredOutputs(grammar=SQL)
        assert StructuredOutputs.from_wire(spec.to_wire()) == spec
        asyncio.run(compile_checked(spec, "guided_grammar"))
        assert compile_spec(spec).matches(b"SELECT col_1  from table_1  where col_2 = 1 ")
    for body, param in (
        ({"guided_grammar": "root ::= nope"}, "guided_grammar"),
        ({"structured_outputs": {"grammar": "start: a"}}, "structured_outputs"),
        ({"guided_grammar": SQL, "guided_regex": "a"}, "guided_grammar"),  # the second
    ):
        with pytest.raises(ApiError) as e:
            parse_structured(body)
        assert (e.value.status, e.value.param) == (400, param), e.value.message
    spec = parse_structured({"guided_grammar": 'root ::= "(" root ")"'})
    with pytest.raises(ApiError, match="matches no text") as e:  # found as it compiles
        asyncio.run(compile_checked(spec, "guided_grammar"))
    assert e.value.param == "guided_grammar"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="ab:=|()[]{}\"'/\\*+?~.,%-_ \n\tAZ019#i", max_size=60))
def test_any_text_is_read_or_refused_with_a_value_error(text):
    """Guards the readers against text a client may send: every string either reads as a
    grammar or raises ValueError (a hang, a RecursionError or an IndexError would reach the
    router as a crash)."""
    try:
        rules, start = read_grammar(text)
    except ValueError as e:
        assert str(e).startswith(("grammar", "the grammar", "rule", "terminal", "%ignore")), e
        return
    assert start in rules


def test_deep_groups_are_refused_not_a_recursion_error():
    """Guards Python's stack: 60,000 nested groups are a ValueError naming the bound."""
    for text in ("root ::= " + "(" * 60_000, "start: " + "[" * 60_000):
        with pytest.raises(ValueError, match="nest more than 100 deep"):
            read_grammar(text)


def test_rules_nested_past_the_stack_are_a_value_error_or_a_shallower_depth():
    """Guards RecursionError (the unrolled tree's depth is rules x levels): a 51-rule cycle
    compiles at the depth whose tree still fits Python's stack, a 200-rule one, too deep
    even at depth 1, is refused with a ValueError saying why."""
    ring = [f'r{i} ::= "(" r{i + 1} ")" | "x"' for i in range(50)]
    dfa, depth = grammar_dfa("\n".join(["root ::= r0", *ring, 'r50 ::= root | "y"']))
    assert 1 <= depth < GRAMMAR_MAX_DEPTH and dfa.matches(b"(" * 50 + b"y" + b")" * 50)
    ring = [f'r{i} ::= "(" r{i + 1} ")" | "x"' for i in range(199)]
    with pytest.raises(ValueError, match="nests too deeply|nest more than 200 deep"):
        grammar_dfa("\n".join(["root ::= r0", *ring, 'r199 ::= root | "y"']))
