"""Structured output through the engine on the bundled SmolLM2: the token tables against a
token-by-token walk of the byte DFA, greedy decoding against transformers constrained by
brute force, and the constraint holding under sampling, async scheduling and batching."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import DEVICE
from structured_spec import constrained_greedy_choices

from pdserve import LLM, SamplingParams
from pdserve.runner.structured.byte_dfa import compile_dfa
from pdserve.runner.structured.patterns import compile_spec
from pdserve.runner.structured.regex_parse import parse_regex
from pdserve.runner.structured.spec import StructuredOutputs
from pdserve.runner.structured.token_bytes import token_byte_strings
from pdserve.runner.structured.token_table import build_token_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol(smollm_dir) -> LLM:
    return LLM(
        model=smollm_dir, device=DEVICE, dtype="float32", max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tok(smol):
    return smol.get_tokenizer()


@pytest.fixture(scope="module")
def vocab(smol, tok) -> list[bytes | None]:
    return token_byte_strings(tok, smol.engine.config.model.vocab_size)


@pytest.fixture(scope="module")
def hf(smollm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


def _chat(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def test_token_bytes_spell_what_the_tokenizer_encodes(tok, vocab):
    """Guards the byte-level alphabet: a wrong map (a space, a control byte, a byte past
    0x7F) would make the grammar walk other bytes than the detokenizer prints."""
    texts = ["Hello, world!", ' {"a": [1, 2.5e-3, null]}\n\ttabs', "naïve café – 東京 🙂",
             "\x00\x07 ctrl", "  leading spaces and trailing  "]  # fmt: skip
    for text in texts:
        ids = tok(text, add_special_tokens=False).input_ids
        assert b"".join(vocab[t] for t in ids) == text.encode(), text
    # Exactly the special tokens spell nothing (the model's vocabulary is the tokenizer's):
    # SmolLM2's 17 added tokens (<|im_start|>, <file_sep>, ...), none of its BPE pieces.
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert len(special) == 17 and special >= set(tok.all_special_ids)
    assert {i for i, v in enumerate(vocab) if v is None} == special


def test_token_table_is_the_walk_of_every_token_from_every_state(smol, vocab):
    """Guards the vectorised table build (spelling dedup, length buckets, state chunks,
    column classes) against a plain walk of each token's bytes: a token allowed where its
    bytes leave the language, or a wrong next state, breaks the output silently."""
    dfa = compile_dfa(
        parse_regex(r'(yes|no|maybe)( - [a-z ]{2,12}\.)?|-?\d{1,4}(\.\d+)?|"[^"\\]{0,6}"')
    )
    eos = frozenset(smol.engine.eos_token_ids)
    grammar = build_token_grammar(dfa, vocab, eos, torch.device("cpu"))
    table = grammar.table.numpy()
    klass = grammar.token_class.numpy()
    assert table.shape[0] == dfa.num_states + 1 and table.shape[1] < len(vocab) // 10
    for state in range(dfa.num_states):
        got = table[state][klass]
        for t, data in enumerate(vocab):
            if t in eos:
                want = state if dfa.accept[state] else -1
            elif data is None:
                want = -1
            else:
                want = dfa.walk(data, state)
            assert got[t] == want, (state, t, data)
    finish = table[grammar.finish][klass]
    assert {t for t in range(len(vocab)) if finish[t] >= 0} == set(eos)
    # A resumed request is placed where its output leads.
    ids = [vocab.index(b) for b in (b"yes", b" -", b" ok")]
    assert grammar.state_after(ids) == dfa.walk(b"yes - ok") >= 0
    # ... and one whose output left the language (it cannot, when every step was masked)
    # is placed where only EOS is allowed.
    assert grammar.state_after([vocab.index(b"no"), vocab.index(b"yes")]) == grammar.finish


def test_greedy_under_a_schema_equals_transformers_constrained_by_brute_force(smol, tok, vocab, hf):
    """Guards the whole path (engine cache, device state, mask, advance) against the spec
    above on transformers' float32 logits: token for token, EOS included. A second,
    unconstrained request in the same batch must come out as it does alone."""
    prompt = _chat(tok, "Describe a person as JSON with a name, an age and a city.")
    spec = StructuredOutputs(json=PERSON)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    free = SamplingParams(temperature=0, max_tokens=12)
    got, free_out = smol.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt}], [params, free],
        use_tqdm=False,
    )  # fmt: skip
    eos = frozenset(smol.engine.eos_token_ids)
    out = got.outputs[0]
    ids = list(out.token_ids)
    assert ids == constrained_greedy_choices(hf, prompt, compile_spec(spec), vocab, eos, ids, 40)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)
    alone = smol.generate({"prompt_token_ids": prompt}, free, use_tqdm=False)[0]
    assert free_out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_greedy_under_a_structural_tag_equals_transformers_constrained_by_brute_force(
    smol, tok, vocab, hf
):
    """Guards a structural tag through the engine: free text until the model writes the
    trigger (its unconstrained answer names Paris), then the structure (JSON of the
    schema, its end), then free again; token for token the spec's, EOS included."""
    country = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 12}},
               "required": ["country"], "additionalProperties": False}  # fmt: skip
    tag = {"type": "structural_tag", "triggers": ["Paris"],
           "structures": [{"begin": "Paris", "schema": country, "end": "."}]}  # fmt: skip
    spec = StructuredOutputs(structural_tag=json.dumps(tag))
    prompt = _chat(tok, "What is the capital of France?")
    free = SamplingParams(temperature=0, max_tokens=30)
    assert (
        "Paris"
        in smol.generate({"prompt_token_ids": prompt}, free, use_tqdm=False)[0].outputs[0].text
    )
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec)
    out = smol.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    eos = frozenset(smol.engine.eos_token_ids)
    ids = list(out.token_ids)
    assert ids == constrained_greedy_choices(hf, prompt, compile_spec(spec), vocab, eos, ids, 30)
    head, _, rest = out.text.partition("Paris")
    body, dot, tail = rest.rpartition(".")
    assert "Paris" not in head and dot and tail == ""  # one structure, nothing after it
    jsonschema.validate(json.loads(body), country)


def test_sampled_outputs_all_follow_the_pattern(smollm_dir):
    """Guards the constraint under random sampling (every token of every sample, n=6) and
    under async scheduling, where the host queues step N+1's mask before step N's token
    is known: the device-side state must have moved on by then. Greedy outputs must be
    the same with and without async scheduling."""
    pattern = r"(Yes|No)\. The answer is [0-9]{1,3}( (apples|pears))?\."
    spec = StructuredOutputs(regex=pattern)
    greedy_texts = []
    for async_scheduling in (False, True):
        llm = LLM(model=smollm_dir, device=DEVICE, dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=32 << 20, async_scheduling=async_scheduling)  # fmt: skip
        tok = llm.get_tokenizer()
        prompt = {"prompt_token_ids": _chat(tok, "How many apples are in the basket?")}
        sampled = SamplingParams(temperature=1.0, seed=11, n=6, max_tokens=30,
                                 structured_outputs=spec)  # fmt: skip
        for comp in llm.generate(prompt, sampled, use_tqdm=False)[0].outputs:
            assert comp.finish_reason == "stop" and re.fullmatch(pattern, comp.text), comp.text
        greedy = SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec)
        text = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
        assert re.fullmatch(pattern, text), text
        greedy_texts.append(text)
    assert greedy_texts[0] == greedy_texts[1]


def test_sampled_numbers_keep_their_schema_bounds(smol, tok):
    """Guards numeric bounds through the engine (the tool-call schemas' `minimum`s): every
    sampled reply that ends on EOS holds an integer and a number inside their bounds,
    checked by jsonschema; the sampling is seeded, so the count that ended is fixed."""
    schema = {"type": "object", "required": ["age", "score"], "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}}  # fmt: skip
    prompt = _chat(tok, "Describe a player as JSON with an age and a score.")
    params = SamplingParams(temperature=1.0, seed=5, n=8, max_tokens=48,
                            structured_outputs=StructuredOutputs(json=schema))  # fmt: skip
    done = [c for c in smol.generate({"prompt_token_ids": prompt}, params,
                                     use_tqdm=False)[0].outputs if c.finish_reason == "stop"]  # fmt: skip
    assert len(done) >= 4, "most replies end within 48 tokens"
    for comp in done:
        jsonschema.validate(json.loads(comp.text), schema)


SQL_GRAMMAR = r"""
root ::= "SELECT " column (", " column)* " FROM " table (" WHERE " column " = " value)? ";"
column ::= [a-z] [a-z_]{0,11}
table ::= [a-z]+
value ::= [0-9]+ | "'" [a-zA-Z ]{0,20} "'"
"""
EXPR_GRAMMAR = r"""
root   ::= expr
expr   ::= term ((" + " | " - ") term)*
term   ::= factor (" * " factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"""


def test_grammars_hold_greedy_and_sampled(smol, tok, vocab, hf):
    """Guards GBNF grammars (`structured_outputs.grammar`) through the engine: greedy under
    a grammar equals transformers constrained by brute force on the grammar's DFA, token
    for token, EOS included; samples under a recursive grammar never leave its language
    (and those that end, end in it)."""
    prompt = _chat(tok, "Write one SQL query that finds users by their name.")
    spec = StructuredOutputs(grammar=SQL_GRAMMAR)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    out = smol.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    eos = frozenset(smol.engine.eos_token_ids)
    ids = list(out.token_ids)
    assert ids == constrained_greedy_choices(hf, prompt, compile_spec(spec), vocab, eos, ids, 40)
    assert out.finish_reason == "stop" and compile_spec(spec).matches(out.text.encode())
    assert out.text.startswith("SELECT ") and out.text.endswith(";"), out.text
    spec = StructuredOutputs(grammar=EXPR_GRAMMAR)
    dfa = compile_spec(spec)
    prompt = {"prompt_token_ids": _chat(tok, "Write a long arithmetic expression.")}
    sampled = SamplingParams(temperature=1.0, seed=3, n=6, max_tokens=24, structured_outputs=spec)
    ended = 0
    for comp in smol.generate(prompt, sampled, use_tqdm=False)[0].outputs:
        if comp.finish_reason == "stop":
            ended += 1
            assert dfa.matches(comp.text.encode()), comp.text
        else:
            assert comp.finish_reason == "length" and dfa.walk(comp.text.encode()) >= 0
    assert ended >= 1


def test_json_mode_and_choice(smol, tok):
    """Guards JSON mode (any object, nested) and a choice list through the engine: each
    ends on EOS with a text that parses / is one of the choices."""
    json_mode = {"json_object": True}
    prompt = {"prompt_token_ids": _chat(tok, "What is the capital of Spain? Answer as JSON.")}
    out = smol.generate(prompt, SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=json_mode), use_tqdm=False
    )[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)
    # A model that loops inside an array runs out of tokens, but never out of the language.
    prompt = {"prompt_token_ids": _chat(tok, "Give me a JSON object describing a cat.")}
    out = smol.generate(prompt, SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=json_mode), use_tqdm=False
    )[0].outputs[0]  # fmt: skip
    dfa = compile_spec(StructuredOutputs(json_object=True))
    assert out.finish_reason == "length" and dfa.walk(out.text.encode()) >= 0, out.text
    choices = ["red", "green", "blue", "light blue"]
    prompt = {"prompt_token_ids": _chat(tok, "What colour is the sky? Answer in one word.")}
    for seed in range(4):
        out = smol.generate(prompt, SamplingParams(
            temperature=1.0, seed=seed, max_tokens=8, structured_outputs={"choice": choices}
        ), use_tqdm=False)[0].outputs[0]  # fmt: skip
        assert out.text in choices and out.finish_reason == "stop", out.text


def test_min_tokens_yields_where_the_grammar_allows_only_eos(smol, tok):
    """Guards min_tokens against a finished grammar: once a choice is complete its only way
    on is EOS, which min_tokens bans; the row then keeps EOS and the request ends there
    (before, it had every logit at -inf and emitted token 0 until min_tokens). The same for
    allowed_token_ids that hold only stop tokens."""
    eos = set(smol.engine.eos_token_ids)
    choices = ["red", "green", "blue", "light blue"]
    prompt = {"prompt_token_ids": _chat(tok, "What colour is the sky? Answer in one word.")}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=12, min_tokens=10,
                                structured_outputs={"choice": choices})  # fmt: skip
        out = smol.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        ids = list(out.token_ids)
        assert out.text in choices and out.finish_reason == "stop", (out.text, ids)
        assert ids[-1] in eos and len(ids) < 10, ids
        assert tok.decode(ids[:-1]) == out.text, ids
    # Without a restriction min_tokens still holds: EOS is banned until 10 tokens exist.
    out = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=10),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(out.token_ids) >= 10 and not eos & set(out.token_ids[:10]), out.token_ids
    stop_only = SamplingParams(temperature=0, max_tokens=12, min_tokens=5,
                               allowed_token_ids=sorted(eos))  # fmt: skip
    out = smol.generate(prompt, stop_only, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1, out.token_ids


def test_bad_words_yield_where_the_grammar_allows_nothing_else(smol, tok):
    """Guards bad_words against a grammar: a regex that only the banned word spells (as
    one token) still comes back matched, then EOS (before, every logit was -inf and the
    reply was token 0 until max_tokens, matching nothing); allowed_token_ids that are all
    bad words likewise keep to the allowed token."""
    word = tok.decode([100])
    assert tok(word, add_special_tokens=False).input_ids == [100], word
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=2, max_tokens=6,
                                structured_outputs={"regex": re.escape(word)},
                                bad_words=[word])  # fmt: skip
        out = smol.generate("Say:", params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason) == (word, "stop"), out.token_ids
    only_bad = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[100],
                              bad_words=[word])  # fmt: skip
    out = smol.generate("Say:", only_bad, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == [100] * 3, out.token_ids


def test_bad_constraints_are_refused_before_anything_is_queued(smol):
    """Guards the engine's edge: a bad regex or an unsupported schema keyword raises
    ValueError naming it, and the engine keeps serving."""
    for so, fragment in (
        ({"regex": "(a"}, "("),
        ({"regex": r"(a)\1"}, "\\1"),
        ({"json": {"type": "integer", "multipleOf": 3}}, "multipleOf"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "choice"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            smol.generate("Hi", SamplingParams(max_tokens=2, structured_outputs=so),
                          use_tqdm=False)  # fmt: skip
    assert not smol.engine.has_unfinished()
    assert smol.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text


def test_an_automaton_that_cannot_be_built_fails_its_request_not_the_loop(smol, tok):
    """Guards where a DFA is compiled: a regex that parses but needs more automaton states
    than allowed is not built in `add_request` (the serving loop only parses; the DFA is
    built on the grammar thread), so the request ends with an error naming the cause while
    the engine keeps serving; `LLM.generate` still raises it before queuing anything."""
    spec = {"regex": "(a|b)*a(a|b){16}"}
    with pytest.raises(ValueError, match="more than 20000 automaton states"):
        smol.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=spec),
                      use_tqdm=False)  # fmt: skip
    assert not smol.engine.has_unfinished()
    eng = smol.engine
    prompt = _chat(tok, "Say hello.")
    eng.add_request("big", prompt, SamplingParams(max_tokens=4, structured_outputs=spec))
    eng.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=6))
    finished = {}
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                finished[d.request_id] = (d.finish_reason, d.stop_reason)
    assert finished["big"][0] == "error" and "automaton states" in finished["big"][1]
    assert finished["free"][0] in ("stop", "length")


def test_a_new_grammar_is_built_beside_the_steps(smol, tok):
    """Guards the build thread: while a new constraint's token table is built, a request
    already decoding keeps getting tokens (before, the build ran on the engine's loop and
    every stream stalled for it: ~3 s here for JSON mode, ~0.9 s on the H200's host), the
    waiting request then starts from its grammar's start, and one aborted while its
    grammar is built ends at once and leaves nothing behind."""
    eng = smol.engine
    prompt = _chat(tok, "Count to one hundred.")
    eng.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    for _ in range(3):
        eng.step()
    # Not built before in this process, and big enough to take a while.
    spec = StructuredOutputs(json={
        "type": "object", "required": ["note"],
        "properties": {"note": {"type": "string", "maxLength": 80}},
    })  # fmt: skip
    eng.add_request("gone", prompt, SamplingParams(max_tokens=8, structured_outputs=spec))
    assert eng.abort("gone")
    eng.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=30,
                                                structured_outputs=spec))  # fmt: skip
    with pytest.raises(ValueError, match="already in use"):  # its id is taken while it waits
        eng.add_request("s", prompt, SamplingParams(max_tokens=2))
    free_tokens, text, finished, started_after = 0, "", {}, None
    while "s" not in finished:
        for d in eng.step():
            if d.request_id == "free":
                free_tokens += len(d.new_token_ids)
            elif d.request_id == "s":
                text += d.new_text
            if d.finished:
                finished[d.request_id] = d.finish_reason
        if "s" not in finished and not text:
            started_after = free_tokens
    assert finished.pop("gone") == "abort"
    assert started_after is not None and started_after >= 3, (
        f"the free request got {started_after} tokens while the grammar was built"
    )
    assert finished["s"] in ("stop", "length") and compile_spec(spec).walk(text.encode()) >= 0
    assert eng.abort("free")
    while eng.has_unfinished():
        eng.step()
    assert not eng._awaiting_grammar and eng.kv.num_free_blocks == eng.kv.num_blocks - 1
