"""`--enable-log-requests` (vLLM's flag): a line when a request arrives, one per generation
when the router has placed it (which worker computed the prompt, which one decodes, and
why), and one when it ends, with its token counts and latencies.

Prompts and outputs are never written, only their token counts, so turning the log on
does not copy users' text into the server's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import fields

from pdserve.cluster.openai_api import ApiError, ParsedRequest
from pdserve.cluster.request_timing import RequestTiming
from pdserve.cluster.route_policy import Route
from pdserve.runner.sampling_params import SamplingParams

_DEFAULTS = {f.name: f.default for f in fields(SamplingParams) if f.init}


def sampling_summary(params: SamplingParams) -> str:
    """The fields that differ from SamplingParams' defaults, `name=value`, in field order;
    stop strings, bad words and the token ids of logit_bias / allowed_token_ids only
    counted."""
    out = []
    for name, default in _DEFAULTS.items():
        value = getattr(params, name)
        if value == default or (default is None and value in ([], ())):
            continue
        if name in ("stop", "bad_words"):  # the client's text: counted, not shown
            value = f"<{len([value] if isinstance(value, str) else value)} string(s)>"
        elif name in ("logit_bias", "allowed_token_ids"):  # may name thousands of ids
            value = f"<{len(value)} token id(s)>"
        out.append(f"{name}={value}")
    return ", ".join(out)


class RequestLog:
    """Writes the lines through `write` (the serve process prints them)."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write

    def received(self, api_id: str, reqs: list[ParsedRequest]) -> None:
        req = reqs[0]
        tokens = [len(r.prompt_token_ids) for r in reqs]
        prompts = f"{len(reqs)} prompts of {tokens} tokens" if len(reqs) > 1 else (
            f"{tokens[0]} prompt tokens"
        )  # fmt: skip
        params = sampling_summary(req.params)
        self.write(
            f"pdserve: request {api_id}: received {req.kind}, {prompts}"
            + (", stream" if req.stream else "")
            + (f"; {params}" if params else "")
        )

    def route(self, api_id: str, route: Route) -> None:
        prefill = f"prompt on {route.prefill}" if route.prefill else "prompt on the decode worker"
        self.write(
            f"pdserve: request {api_id} choice {route.choice} ({route.request_id}): "
            f"{route.decision}, {prefill}, decode on {route.decode}"
        )

    def finished(
        self,
        api_id: str,
        timing: RequestTiming,
        completion_tokens: int,
        reasons: list[str | None],
    ) -> None:
        """The request's end: how each choice ended, its tokens, its TTFT with the part
        of it spent queued, and its latency."""
        phases = timing.phases()
        ttft = "-"
        if timing.first_token is not None and phases is not None:
            ttft = f"{timing.first_token - timing.start:.3f} s (queued {phases['queue']:.3f} s)"
        self.write(
            f"pdserve: request {api_id}: finished ({', '.join(str(r) for r in reasons)}), "
            f"{completion_tokens} output tokens, TTFT {ttft}, "
            f"e2e {timing.now() - timing.start:.3f} s"
        )

    def ended(self, api_id: str, elapsed_s: float, why: str) -> None:
        self.write(f"pdserve: request {api_id}: {why} after {elapsed_s:.3f} s")

    @contextlib.contextmanager
    def watch(self, api_id: str, start: float) -> Iterator[None]:
        """Around a request's generation: an error or a client gone is its last line."""
        try:
            yield
        except ApiError as e:
            self.ended(api_id, time.monotonic() - start, f"failed ({e.status}: {e.message})")
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.ended(api_id, time.monotonic() - start, "cancelled (the client went away)")
            raise


def watched(log: RequestLog | None, api_id: str, start: float):
    """`log.watch(...)`, or nothing to watch with the log off."""
    return log.watch(api_id, start) if log is not None else contextlib.nullcontext()


def route_hook(log: RequestLog | None, api_id: str) -> Callable[[Route], None] | None:
    """What hears where each of the request's generations went: the log, when it is on."""
    return (lambda route: log.route(api_id, route)) if log is not None else None
