"""The router's side of structured output (cluster/structured_api.py): a constraint's byte
DFA is compiled off the event loop, and one that cannot be built is a 400 naming its
field."""

from __future__ import annotations

import pytest
from loop_ticks import ticks_while

from pdserve.cluster.openai_api import ApiError
from pdserve.cluster.structured_api import compile_checked, parse_structured, structured_param

# Parses at once, then needs more than the 20,000 automaton states allowed (~0.5-1 s here).
TOO_BIG = "[ab]*a[ab]{15}"


def test_the_loop_keeps_running_while_a_constraint_compiles():
    """Guards the event loop: a 10 ms ticker on the loop keeps ticking while a pattern
    that takes ~1 s to fail compiles (compiled on the loop, it ticked 0 times), and the
    failure is a 400 naming the field it came from."""
    body = {"guided_regex": TOO_BIG}
    spec = parse_structured(body)  # parsing alone is fine

    async def attempt() -> ApiError | None:
        try:
            await compile_checked(spec, structured_param(body))
        except ApiError as e:
            return e
        return None

    ticks, error = ticks_while(attempt)
    assert ticks >= 5, f"the loop ticked {ticks} times during the compile"
    assert error is not None and error.param == "guided_regex"
    assert "20000 automaton states" in str(error)


def test_a_constraint_that_does_not_parse_is_refused_as_it_is_read():
    with pytest.raises(ApiError, match="multipleOf") as e:
        parse_structured({"structured_outputs": {"json": {"type": "integer", "multipleOf": 2}}})
    assert e.value.param == "structured_outputs"
    assert structured_param({"response_format": {"type": "json_object"}}) == "response_format"
