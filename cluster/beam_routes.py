"""`use_beam_search` over HTTP, as vLLM's server takes it: `n` beams (the beam width),
`max_tokens`, `length_penalty`, `ignore_eos`, `include_stop_str_in_output`, `temperature`.

Each prompt's search (runner/beam_search.py) advances a token at a time: every live beam
of every prompt asks the router for one token with the top `2 * n` logprobs of its next
position, all of a step's asks at once, as ordinary requests (so they are routed, PD
included, and their prompts are prefix-cache hits but for the last token). The answer
comes whole, the `n` best beams of each prompt as its choices, best first.

Fields beam search would not carry out are refused by name rather than ignored: a
stream, logprobs, echo, structured output or tools, stop strings and tokens, penalties,
biases and the other per-token filters, and tools that constrain the reply (required,
named). A chat beam is read as a sampled reply is: its reasoning split off
(`--reasoning-parser`), tool calls read under `tool_choice: auto`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from pdserve.cluster.batch_stream import merged
from pdserve.cluster.completion_choices import chat_reply, choice
from pdserve.cluster.http_app import AppState
from pdserve.cluster.openai_api import ApiError, ParsedRequest, typed
from pdserve.cluster.request_log import watched
from pdserve.cluster.request_timing import RequestTiming
from pdserve.cluster.response_shapes import now, usage
from pdserve.cluster.structured_api import structured_param
from pdserve.runner.beam_search import BeamSearch, BeamSearchParams, advance_all, pending
from pdserve.runner.sampling_params import SamplingParams

# SamplingParams fields a beam search does not use, at the value that means "off".
_UNUSED = {
    "stop": None, "stop_token_ids": None, "min_tokens": 0, "logprobs": None,
    "prompt_logprobs": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "logit_bias": None,
    "allowed_token_ids": None, "bad_words": None, "structured_outputs": None,
}  # fmt: skip


def beam_params(body: dict, params: SamplingParams, stream: bool) -> BeamSearchParams | None:
    """The request's beam search (None without `use_beam_search`), or a 400 naming a
    field it cannot take."""
    if not typed(body, "use_beam_search", (bool,), False):
        if body.get("length_penalty") is not None:
            raise ApiError("'length_penalty' needs 'use_beam_search': true",
                           param="length_penalty")  # fmt: skip
        return None
    if stream:
        raise ApiError("'stream' is not available with use_beam_search (the beams are "
                       "ranked when the search ends)", param="stream")  # fmt: skip
    if typed(body, "echo", (bool,), False):
        raise ApiError("'echo' is not available with use_beam_search", param="echo")
    for name, off in _UNUSED.items():
        value = getattr(params, name)
        if value not in (off, [], {}):
            field = name
            if name == "structured_outputs":  # the client's constraint, or its tools'
                field = "tool_choice" if body.get("tools") else structured_param(body)
            raise ApiError(f"'{field}' is not carried out by beam search; leave it out",
                           param=field)  # fmt: skip
    try:
        return BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            length_penalty=float(typed(body, "length_penalty", (int, float), 1.0)),
            include_stop_str_in_output=params.include_stop_str_in_output,
        )  # fmt: skip
    except ValueError as e:
        field = "n" if str(e).startswith("beam_width") else str(e).split(" ", 1)[0]
        raise ApiError(f"use_beam_search: {e} ('n' is the beam width)", param=field) from e


async def beam_reply(state: AppState, reqs: list[ParsedRequest], cid: str, start: float) -> dict:
    """The whole response: each prompt's `n` best beams."""
    req = reqs[0]
    if not state.eos_token_ids:
        raise ApiError("beam search needs the model's EOS token ids, which this server "
                       "does not know", 500, "server_error")  # fmt: skip
    eos = frozenset(state.eos_token_ids)
    searches = [BeamSearch(r.prompt_token_ids, r.beam, eos, state.max_model_len) for r in reqs]
    # The asks keep what routes and isolates the request: its seed, priority and cache salt.
    sp = req.params
    step = dataclasses.replace(req.beam.step_params(), seed=sp.seed, priority=sp.priority,
                               cache_salt=sp.cache_salt)  # fmt: skip

    async def ask(token_lists: list[list[int]]) -> list[list[tuple[int, float, int]]]:
        subs = [_one_token(req, ids, step) for ids in token_lists]
        rows: list[Any] = [None] * len(subs)
        # aclosing: an error here cancels and awaits the step's other asks at once
        async with contextlib.aclosing(merged(state.router, subs)) as answers:
            async for c, d, _ in answers:
                if d.logprobs:
                    rows[c] = [tuple(r) for r in d.logprobs[0]]
                if d.finish_reason == "error":
                    raise ApiError(f"the request failed in a worker: {d.stop_reason}", 500,
                                   "server_error")  # fmt: skip
        missing = [i for i, r in enumerate(rows) if r is None]
        if missing:
            raise ApiError(f"a beam's next token came back without logprobs ({len(missing)} "
                           "of the step's asks)", 500, "server_error")  # fmt: skip
        return rows

    with watched(state.request_log, cid, start):
        await _run_async(searches, ask)
    skip = not req.beam.include_stop_str_in_output
    answers = [s.answer(lambda ids: state.tokenizer.decode(ids, skip_special_tokens=skip))
               for s in searches]  # fmt: skip
    width = req.beam.beam_width
    choices, finish, completion_tokens = [], [], 0
    for p, out in enumerate(answers):
        for i, seq in enumerate(out.sequences):
            toks = seq.output_token_ids
            completion_tokens += len(toks)
            finish.append(seq.finish_reason)
            # (`str` names logprobs' tokens: there are none)
            body = choice(req, p * width + i, seq.text, toks, None, seq.finish_reason, None,
                          False, str)  # fmt: skip
            if req.kind == "chat" and (req.tool_choice is not None or req.reasoning is not None):
                body = chat_reply(req, body, "", seq.text)  # as a sampled reply's
            choices.append(body)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    timing = RequestTiming(start, len(choices))
    state.metrics.finish(req, timing, completion_tokens, prompt_tokens, finish)
    if state.request_log is not None:
        state.request_log.finished(cid, timing, completion_tokens, finish)
    return {
        "id": cid,
        "object": "chat.completion" if req.kind == "chat" else "text_completion",
        "created": now(),
        "model": req.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, 0, req.prompt_details),
    }


def _one_token(req: ParsedRequest, ids: list[int], step: SamplingParams) -> ParsedRequest:
    """An ask: the beam's tokens as the prompt, one token with its position's logprobs."""
    return dataclasses.replace(
        req, prompt_token_ids=ids, params=step, stream=False, include_usage=False,
        continuous_usage=False, echo_logprobs=step.logprobs, echo_text=None,
        show_prompt_logprobs=False, tool_choice=None, reasoning=None, return_token_ids=False,
        request_id=None, beam=None,
    )  # fmt: skip


async def _run_async(searches: list[BeamSearch], ask) -> None:
    """runner/beam_search.py's `run_searches`, with an awaitable `ask`."""
    while True:
        live, asks = pending(searches)
        if not live:
            return
        advance_all(live, await ask(asks))
