"""`--enable-log-requests`' summary of a request's sampling settings (cluster/request_log.py)."""

from __future__ import annotations

from pdserve.cluster.request_log import sampling_summary
from pdserve.runner.sampling_params import SamplingParams


def test_the_summary_names_what_differs_and_counts_long_fields():
    """Guards the log line's size and the client's text: defaults are left out, and stop
    strings, bad words and the token ids of logit_bias / allowed_token_ids (thousands,
    for a client that restricts to a word list) are counted, never printed."""
    assert sampling_summary(SamplingParams()) == ""
    params = SamplingParams(
        temperature=0.0, max_tokens=8, stop=["a", "b"],
        logit_bias={t: -100 for t in range(3000)}, allowed_token_ids=list(range(5000)),
        bad_words=["secret", "words"],
    )  # fmt: skip
    assert sampling_summary(params) == (
        "max_tokens=8, temperature=0.0, stop=<2 string(s)>, "
        "logit_bias=<3000 token id(s)>, allowed_token_ids=<5000 token id(s)>, "
        "bad_words=<2 string(s)>"
    )
