"""What a sampled token becomes in a delta: the text to hand out now and the logprob dicts.

Pure functions of a request's output-side state (`engine_state.Track`) and the tokenizer;
the engine calls them per token. Text is streamed minus a held-back tail that a stop
string may still start in, and copied O(new text) per token.
"""

from __future__ import annotations

from typing import Any

from pdserve.runner.detokenizer import decode_token
from pdserve.runner.engine_state import Track
from pdserve.runner.outputs import Logprob, LogprobDict
from pdserve.runner.request import Request
from pdserve.runner.runner_output import TopLogprobs
from pdserve.runner.stop_checker import StopDecision, check_stop


def next_text(
    req: Request, track: Track, token: int, max_model_len: int
) -> tuple[StopDecision | None, str]:
    """Feed `token` to the request's detokenizer -> the stop decision and the text to hand
    out now (all new text but the held-back tail a stop string may still start in)."""
    detok = track.detok
    text_before = detok.output_text
    new_text = detok.add_tokens([token])
    decision = check_stop(req, [token], text_before, new_text, max_model_len)
    full_len = len(text_before) + len(new_text)
    if decision is None:
        visible = max(track.emitted, full_len - track.hold_back)
    elif decision.text_len == full_len:
        new_text += detok.flush()  # nothing was cut: release held-back bytes too
        visible = len(text_before) + len(new_text)
    else:
        visible = decision.text_len
    tail = (
        text_before[track.emitted :] + new_text
        if track.emitted < len(text_before)
        else new_text[track.emitted - len(text_before) :]
    )
    piece = tail[: visible - track.emitted]
    track.emitted = visible
    return decision, piece


def logprob_dict(tokenizer: Any | None, lp: TopLogprobs) -> LogprobDict:
    """One position's logprobs as the API returns them: the top-k by rank, and the sampled
    token with its own rank (text None without a tokenizer)."""

    def text(tok: int) -> str | None:
        return decode_token(tokenizer, tok) if tokenizer is not None else None

    out: LogprobDict = {}
    for rank, (tok, val) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), start=1):
        out[tok] = Logprob(val, rank, text(tok))
    out.setdefault(lp.token_ids[0], Logprob(lp.logprobs[0], lp.rank, text(lp.token_ids[0])))
    return out
