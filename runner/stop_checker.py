"""Decide, after a request appended tokens, whether it finished and how much text it keeps.

A pure function of the request and its text: it reads `request` and changes nothing, so the
caller applies the decision (status, stop_reason, text truncation) in one place. The caller
feeds the step's tokens to the request's `IncrementalDetokenizer` first:

    text_before = detok.output_text
    new_text = detok.add_tokens(new_token_ids)
    decision = check_stop(request, new_token_ids, text_before, new_text, max_model_len)

Priority when several conditions hold on the same token follows vLLM's V0 StopChecker:
EOS, then stop token ids, then stop strings, then length. (vLLM V1 checks length first in
its scheduler and then lets a stop string override it; EOS on the max_tokens-th token is
"length" there and "stop" here, which also tells a client the answer was complete.)

What it does not know: the tokenizer (text arrives decoded) or the sampler, which already
suppresses EOS and stop ids before `min_tokens`; the check here is a defensive second line.
Except for a restricted row (a grammar or allowed_token_ids): the sampler lets its stop
through before `min_tokens` only when nothing else is allowed, and then the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.runner.request import Request


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS and length
    # Characters of text_before + new_text the output keeps (a stop string cuts it short).
    text_len: int


def check_stop(
    request: Request, new_token_ids: list[int], text_before: str, new_text: str, max_model_len: int
) -> StopDecision | None:
    """Return how `request` finished on this step, or None if it goes on.

    `new_token_ids` are the tokens this step appended (already the tail of
    `request.output_token_ids`; usually one). `text_before` is the output text before them and
    `new_text` the text they made stable. A step that appends several tokens (speculative
    decoding) must stop appending at a stop token, as vLLM's scheduler does: a stop token
    before the last new token is an error of the caller, since the text after it cannot be
    taken back here.

    Text kept: a stop string cuts the text right before it (right after it with
    `include_stop_str_in_output`). A stop token drops this step's new text unless
    `include_stop_str_in_output`, as vLLM V0 does: it is the stop token's own text, e.g.
    "<|im_end|>" with skip_special_tokens=False. Length keeps all text.
    """
    params = request.params
    num_output = request.num_output_tokens
    full_len = len(text_before) + len(new_text)
    assert request.output_token_ids[-1] == new_token_ids[-1], (
        "new_token_ids must be the tail of request.output_token_ids"
    )
    # Token stops exist only with EOS honoured or stop ids given; a request with neither
    # (ignore_eos benchmarks) skips the per-token loop, ~0.15 us of every step's check.
    token_stops = (request.eos_token_ids and not params.ignore_eos) or params.stop_token_ids
    if token_stops:
        # A restricted row (a grammar, allowed_token_ids) samples a stop before min_tokens
        # only where the sampler found no other token allowed: min_tokens yields there.
        restricted = params.structured_outputs is not None or params.allowed_token_ids is not None
        for i, token_id in enumerate(new_token_ids):
            # min_tokens counts outputs before the stop, as the sampler does: a stop can be
            # output number min_tokens + 1 at the earliest.
            if num_output - len(new_token_ids) + i < params.min_tokens and not restricted:
                continue
            if token_id in request.eos_token_ids and not params.ignore_eos:
                stop_reason = None
            elif token_id in params.stop_token_ids:
                stop_reason = token_id
            else:
                continue
            assert i == len(new_token_ids) - 1, (
                f"tokens were appended after stop token {token_id}; append up to a stop only"
            )
            kept = full_len if params.include_stop_str_in_output else len(text_before)
            return StopDecision("stop", stop_reason, kept)

    # The same min_tokens rule for stop strings (as vLLM); one completed while blocked is in
    # text_before from then on and is not looked for again.
    if params.stop_strings and new_text and num_output > params.min_tokens:
        found = find_stop_string(text_before, new_text, params.stop_strings)
        if found is not None:
            stop, start = found
            kept = start + len(stop) if params.include_stop_str_in_output else start
            return StopDecision("stop", stop, kept)

    if num_output >= params.max_tokens or request.num_prompt_tokens + num_output >= max_model_len:
        return StopDecision("length", None, full_len)
    return None


def find_stop_string(
    text_before: str, new_text: str, stop_strings: list[str]
) -> tuple[str, int] | None:
    """The stop string that `new_text` completed first, and where it starts in the output.

    Only occurrences that end inside `new_text` are new (older ones would have stopped an
    earlier step), so the search covers `new_text` plus the last len(stop) - 1 characters of
    `text_before`: O(len(new_text) + longest stop) per step, not O(output).

    "First" means the occurrence that ends first: the request stops at the first character
    that completes any stop string, whatever the token boundaries; among occurrences that
    end at the same character the longer one wins. So the answer does not depend on how
    the text was split into steps.
    """
    longest = max(len(s) for s in stop_strings)
    tail_len = min(len(text_before), longest - 1)
    window = text_before[len(text_before) - tail_len :] + new_text
    offset = len(text_before) - tail_len  # window index 0 is this output index
    best: tuple[int, int, str] | None = None  # (end, -len, stop): smaller is better
    for stop in stop_strings:
        start = window.find(stop, max(0, tail_len - (len(stop) - 1)))
        if start == -1:
            continue
        candidate = (start + len(stop), -len(stop), stop)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    end, neg_len, stop = best
    return stop, offset + end + neg_len
