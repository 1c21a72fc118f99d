"""check_stop: EOS, stop token ids, stop strings, min_tokens, max_tokens, max_model_len."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pdserve.runner.detokenizer import IncrementalDetokenizer
from pdserve.runner.model_source import resolve_model_dir
from pdserve.runner.request import Request
from pdserve.runner.sampling_params import SamplingParams
from pdserve.runner.stop_checker import StopDecision, check_stop, find_stop_string

EOS = 2
PLAIN = 100  # any token that is neither EOS nor a stop token
MAX_MODEL_LEN = 1000


def make_request(prompt_len: int = 3, **params) -> Request:
    return Request(
        "r",
        list(range(10, 10 + prompt_len)),
        SamplingParams(**params),
        seed=0,
        eos_token_ids=(EOS,),
    )


def run(request: Request, steps: list[tuple[int, str]], max_model_len: int = MAX_MODEL_LEN):
    """Append (token, text) steps until one finishes; return (decision, step index, text)."""
    text = ""
    for i, (token_id, new_text) in enumerate(steps):
        request.append_output_token(token_id)
        decision = check_stop(request, [token_id], text, new_text, max_model_len)
        if decision is not None:
            return decision, i, (text + new_text)[: decision.text_len]
        text += new_text
    return None, len(steps), text


def plain(*texts: str) -> list[tuple[int, str]]:
    return [(PLAIN, t) for t in texts]


def test_stop_string_spanning_tokens():
    """Guards against searching only the newest token's text: "WORLD" arrives as "WO"+"RLD"."""
    decision, step, text = run(make_request(stop=["WORLD"]), plain("Hel", "lo WO", "RLD!", "x"))
    assert (decision, step, text) == (StopDecision("stop", "WORLD", 6), 2, "Hello ")


def test_stop_string_at_the_very_beginning():
    """Guards against an off-by-one in the window start that misses index 0 (empty output)."""
    decision, step, text = run(make_request(stop=["STOP"]), plain("STOP here"))
    assert (decision, step, text) == (StopDecision("stop", "STOP", 0), 0, "")


def test_include_stop_str_in_output():
    """Guards against ignoring include_stop_str_in_output: keep the text up to the stop's end."""
    request = make_request(stop=["WORLD"], include_stop_str_in_output=True)
    decision, _, text = run(request, plain("Hello WO", "RLD and more"))
    assert decision.stop_reason == "WORLD" and text == "Hello WORLD"


@pytest.mark.parametrize("stops", [["world", "lo"], ["lo", "world"]])
def test_earlier_occurrence_wins(stops):
    """Guards against list order deciding (vLLM returns the first listed stop that matches):
    the stop string that completes first in the text wins."""
    decision, _, text = run(make_request(stop=stops), plain("hello world"))
    assert decision.stop_reason == "lo" and text == "hel"


def test_old_occurrence_is_not_found_again():
    """Guards against the window reaching back past what new text can complete: a stop string
    already in text_before (e.g. seen under min_tokens) must not stop a later step."""
    assert find_stop_string("END of part one", " and two", ["END"]) is None
    # A longer stop widens the window for itself only, not for the short one.
    assert find_stop_string("the END.", "!", ["END", "a much longer stop"]) is None
    assert find_stop_string("the EN", "D", ["END"]) == ("END", 4)


def _first_completion(text: str, stops: list[str]) -> tuple[str, int] | None:
    """Oracle: scan every prefix; the first that ends with a stop (longest on ties)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return stop, end - len(stop)
    return None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("ab c", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    stops=st.lists(st.text("ab c", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_strings_match_oracle_for_any_chunking(text, cuts, stops):
    """Guards against the answer depending on how text was split into steps (missed stops
    across steps, wrong window, wrong winner) by comparing with a whole-text oracle."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    decision, _, kept = run(make_request(stop=stops, max_tokens=100), plain(*chunks))
    expected = _first_completion(text, stops)
    if expected is None:
        assert decision is None
    else:
        assert decision.stop_reason == expected[0] and kept == text[: expected[1]]
        assert not any(stop in kept for stop in stops)


def test_eos_and_stop_token_ids():
    """Guards against confusing EOS (stop_reason None) with stop ids (stop_reason = the id)
    and against keeping the stop token's own text, e.g. "<|im_end|>" when not skipped."""
    decision, step, text = run(make_request(), plain("a", "b") + [(EOS, "<|im_end|>")])
    assert (decision, step, text) == (StopDecision("stop", None, 2), 2, "ab")
    decision, _, text = run(make_request(stop_token_ids=[7]), plain("a") + [(7, "\n")])
    assert (decision.finish_reason, decision.stop_reason, text) == ("stop", 7, "a")
    request = make_request(stop_token_ids=[7], include_stop_str_in_output=True)
    assert run(request, plain("a") + [(7, "\n")])[2] == "a\n"


def test_min_tokens_blocks_eos_stop_ids_and_stop_strings():
    """Guards against ending a request before min_tokens outputs exist if the sampler ever
    lets EOS, a stop id or a stop string through (the first allowed stop is output 4)."""
    for stop_step in ([(EOS, "")], [(7, "")], plain("STOP")):
        request = make_request(min_tokens=3, stop=["STOP"], stop_token_ids=[7])
        decision, step, _ = run(request, stop_step * 5)
        assert decision is not None and decision.finish_reason == "stop"
        assert step == 3


def test_a_restricted_request_ends_on_a_stop_before_min_tokens():
    """Guards the yield: under a grammar or allowed_token_ids the sampler lets EOS through
    before min_tokens only where nothing else is allowed, and the request then ends on it
    (an unrestricted one still goes on)."""
    for restriction in ({"structured_outputs": {"choice": ["a"]}}, {"allowed_token_ids": [EOS]}):
        request = make_request(min_tokens=5, **restriction)
        decision, step, _ = run(request, [(PLAIN, "a"), (EOS, "")] * 3)
        assert decision is not None and decision.finish_reason == "stop" and step == 1
    decision, step, _ = run(make_request(min_tokens=5), [(PLAIN, "a"), (EOS, "")] * 3)
    assert decision.finish_reason == "stop" and step == 5


def test_ignore_eos():
    """Guards against EOS ending a request that asked to ignore it; stop ids still count."""
    request = make_request(ignore_eos=True, max_tokens=5, stop_token_ids=[7])
    assert run(request, [(EOS, "")] * 3 + [(7, "")])[:2] == (StopDecision("stop", 7, 0), 3)
    decision, step, _ = run(make_request(ignore_eos=True, max_tokens=5), [(EOS, "")] * 9)
    assert (decision.finish_reason, step) == ("length", 4)


def test_max_tokens():
    """Guards against off-by-one: exactly max_tokens outputs, all text kept."""
    decision, step, text = run(make_request(max_tokens=3), plain("a", "b", "c", "d"))
    assert (decision, step, text) == (StopDecision("length", None, 3), 2, "abc")


def test_max_model_len():
    """Guards against growing past the model's context: prompt 10 + 2 outputs = 12."""
    request = make_request(prompt_len=10, max_tokens=100)
    decision, step, _ = run(request, plain(*"abcdef"), max_model_len=12)
    assert (decision.finish_reason, step) == ("length", 1)


def test_priority_on_the_same_token():
    """Guards against the wrong winner when several conditions hold on one token: EOS beats
    length (the answer was complete), a stop string beats length."""
    decision, _, _ = run(make_request(max_tokens=2), plain("a") + [(EOS, "")])
    assert decision.finish_reason == "stop" and decision.stop_reason is None
    decision, _, text = run(make_request(max_tokens=2, stop=["ab"]), plain("a", "b"))
    assert (decision.stop_reason, text) == ("ab", "")


def test_stop_token_after_the_last_position_is_rejected():
    """Guards against silently keeping tokens appended after a stop token in one step."""
    request = make_request()
    request.output_token_ids.extend([PLAIN, EOS, PLAIN])
    with pytest.raises(AssertionError):
        check_stop(request, [PLAIN, EOS, PLAIN], "", "ab", MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None)[0])


def test_real_tokens_stop_string_spanning_tokens(tok):
    """Guards against the detokenizer/stop-checker pipeline missing a stop string that the
    real tokenizer splits over several tokens."""
    ids = tok.encode("The answer is 42.\nAnything after the marker ###END### is dropped.")
    stop = "###END###"
    assert not any(stop in tok.decode([i]) for i in ids), "the stop must span tokens"
    request = make_request(stop=[stop], max_tokens=100)
    detok = IncrementalDetokenizer(tok, request.prompt_token_ids)
    for token_id in ids:
        request.append_output_token(token_id)
        text_before = detok.output_text
        decision = check_stop(
            request, [token_id], text_before, detok.add_tokens([token_id]), MAX_MODEL_LEN
        )
        if decision is not None:
            break
    assert decision is not None and decision.stop_reason == stop
    assert detok.output_text[: decision.text_len] == "The answer is 42.\nAnything after the marker "
