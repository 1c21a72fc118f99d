"""One HTTP request's generations as one stream: the `n` completions of each of its
prompts (a completion request may carry a batch of prompts), numbered as OpenAI numbers
choices, `prompt index * n + i`, each choice's first delta with its `echo`.

Each prompt runs as its own `Router.generate` in a task feeding one queue; whatever ends
the consumer (the last choice finished, an error, a client gone) cancels and awaits them
all. The router's own idle timeout bounds every wait on the queue.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import NamedTuple

from pdserve.cluster.openai_api import ApiError, ParsedRequest
from pdserve.cluster.route_policy import Route
from pdserve.cluster.token_stream import StreamDelta

_END = object()


class Echo(NamedTuple):
    """What goes before a choice's own output: the prompt's text, and with logprobs its
    tokens and their rows (the first None). Not counted as completion tokens."""

    text: str
    token_ids: list[int]
    logprobs: list | None


async def merged(
    router, reqs: list[ParsedRequest], on_route: Callable[[Route], None] | None = None
) -> AsyncIterator[tuple[int, StreamDelta, Echo | None]]:
    """(choice index, delta, echo) for every generation of `reqs`, in arrival order; the
    echo only with a choice's first delta, and only when its request asked for one.
    `on_route` hears each generation's route, with its choice index. An `echo_only`
    request's deltas carry no output (its echo is the whole choice)."""
    n = reqs[0].params.n
    started: set[int] = set()
    async for c, d in _all(router, reqs, n, on_route):
        echo = None
        if c not in started:
            started.add(c)
            echo = echo_of(reqs[c // n], d)
        if reqs[c // n].echo_only:  # the prompt alone: the one generated token left out
            d = replace(d, token_ids=[], text="", logprobs=None if d.logprobs is None else [])
        yield c, d, echo


async def _all(router, reqs: list[ParsedRequest], n: int, on_route):
    if len(reqs) == 1:  # the common case: no tasks of our own
        async for i, d in router.generate(reqs[0], on_route):
            yield i, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    def routed(p: int):
        if on_route is None:
            return None
        return lambda r: on_route(r._replace(choice=p * n + r.choice))

    async def pump(p: int, req: ParsedRequest) -> None:
        try:
            async for i, d in router.generate(req, routed(p)):
                queue.put_nowait((p * n + i, d))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((p, e))
        finally:
            queue.put_nowait((p, _END))

    tasks = [asyncio.create_task(pump(p, req)) for p, req in enumerate(reqs)]
    ended = 0
    try:
        while ended < len(tasks):
            c, item = await queue.get()
            if item is _END:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def echo_of(req: ParsedRequest, first: StreamDelta) -> Echo | None:
    """The echo of a choice whose first delta is `first` (None without `echo`)."""
    if req.echo_text is None:
        return None
    if req.kind == "chat" or req.echo_logprobs is None or first.finish_reason == "error":
        return Echo(req.echo_text, [], None)  # a chat echo is text only, as in vLLM
    rows = first.prompt_logprobs
    if rows is None or len(rows) != len(req.prompt_token_ids):
        raise ApiError("the worker sent no logprobs for the echoed prompt", 500, "server_error")
    return Echo(req.echo_text, list(req.prompt_token_ids), rows)
