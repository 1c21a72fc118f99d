"""The router's routing policy as data (DESIGN §2): its knobs, its decision, its record.

`RouterConfig` holds the knobs; `prefer_cached` picks a prompt's decode worker;
`decide` says where one prompt prefills and why (the reason is what the router counts:
`remote_prefill`, `short_prompt`, `prefix_hit_on_decode`, ...); `Route` records where
one generation went. Nothing here
knows workers, handles or the event loop: the router (cluster/router.py) supplies the
cached prefix and the prefill pool's load it measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

W = TypeVar("W")


class Route(NamedTuple):
    """Where one generation went: `decision` is the router's reason (`remote_prefill`,
    `short_prompt`, `prefix_hit_on_decode`, ...); `prefill` is the worker that computed
    its prompt, None when the decode worker did."""

    choice: int
    request_id: str  # the workers' id for it (their logs and aborts use it)
    decision: str
    prefill: str | None
    decode: str


@dataclass(frozen=True)
class RouterConfig:
    mode: str = "pd"  # "pd" | "colocated"
    pd_min_prompt_tokens: int = 16  # shorter prompts (or uncached tails) prefill on D
    # When every prefill worker already has this many prompt tokens in flight, a new prompt
    # prefills on its decode worker instead ("prefill_busy"); 0 = never (always remote).
    pd_max_prefill_queue_tokens: int = 0
    block_size: int = 16  # the workers' KV block size: prefix hashes are per full block
    policy: str = "recompute"  # prefill failure: "recompute" | "fail"
    prefill_timeout_s: float = 120.0
    stream_idle_timeout_s: float = 300.0  # no token for this long -> the request errors
    # `--seed`: the seeds of unseeded requests come from a generator seeded with it, so a
    # restarted server given the same requests in the same order samples the same; None:
    # from the OS's randomness.
    seed: int | None = None
    # Slots per decode worker: the requests the router has on one at a time (prefilling
    # for it, running or waiting on it). More wait in the router, in arrival order, for the
    # first slot to free anywhere, a new worker's included (cluster/decode_admission.py);
    # a wait is bounded by stream_idle_timeout_s. 0: no limit, every request goes at once.
    decode_capacity: int = 0
    # A prompt goes to the decode worker holding most of it in its prefix cache among the
    # workers within this many requests in flight (or a quarter, if more) of the least
    # busy: a conversation's next turn finds its KV, and a hot prefix cannot pile load
    # on one worker past that band (`prefer_cached`).
    decode_prefix_slack: int = 8
    # The workers cache prefixes: False (`--no-enable-prefix-caching`) leaves no prefix hit
    # to route by, so every long prompt prefills remotely.
    prefix_caching: bool = True
    # A hybrid Mamba model's hits reach only where its recurrent state was saved: the end
    # of a prompt the worker prefilled itself, the last save point (every 64 tokens) a
    # reply it decoded passed (runner/state_snapshots.py). So a decode worker counts a pulled prompt (its
    # state came whole, saved nowhere) only as far as its reply reaches
    # (cluster/prefix_index.py's state points); the prefill workers count theirs.
    state_snapshots: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("pd", "colocated"):
            raise ValueError(f"mode must be 'pd' or 'colocated', got {self.mode!r}")
        if self.policy not in ("recompute", "fail"):
            raise ValueError(f"policy must be 'recompute' or 'fail', got {self.policy!r}")
        if self.pd_max_prefill_queue_tokens < 0:
            raise ValueError(
                f"pd_max_prefill_queue_tokens must be >= 0, got {self.pd_max_prefill_queue_tokens}"
            )
        if self.decode_capacity < 0:
            raise ValueError(f"decode_capacity must be >= 0, got {self.decode_capacity}")
        if self.decode_prefix_slack < 0:
            raise ValueError(f"decode_prefix_slack must be >= 0, got {self.decode_prefix_slack}")


def prefer_cached(
    workers: list[W],
    inflight: Callable[[W], int],
    hit_tokens: Callable[[W], int],
    usage: Callable[[W], float],
    slack: int,
) -> W:
    """The decode worker for a prompt: among those within `slack` requests in flight (or
    a quarter, if more) of the least busy, the one with the most of the prompt cached,
    then the least busy, then the most KV headroom."""
    least = min(inflight(w) for w in workers)
    band = least + max(slack, least // 4)
    return min(
        (w for w in workers if inflight(w) <= band),
        key=lambda w: (-hit_tokens(w), inflight(w), usage(w)),
    )


def decide(
    config: RouterConfig,
    num_prompt_tokens: int,
    decode_hit_tokens: int,
    prompt_logprobs: bool,
    prefill_queue_tokens: list[int],
) -> str:
    """Where a prompt prefills, as the reason the router counts. `decode_hit_tokens`: its
    leading tokens the decode worker probably has cached; `prefill_queue_tokens`: the
    prompt tokens in flight on each prefill worker (empty: there is none)."""
    if config.mode == "colocated":
        return "colocated"
    if prompt_logprobs:  # computed by the prefill's forward: the decode worker runs it
        return "prompt_logprobs"
    if num_prompt_tokens < config.pd_min_prompt_tokens:
        return "short_prompt"
    if num_prompt_tokens - decode_hit_tokens < config.pd_min_prompt_tokens:
        return "prefix_hit_on_decode"  # D has the prefix: only a short tail to compute
    if not prefill_queue_tokens:
        return "no_prefill_worker"
    cap = config.pd_max_prefill_queue_tokens
    if cap and min(prefill_queue_tokens) >= cap:
        return "prefill_busy"  # the prefill pool is backed up: D prefills this one
    return "remote_prefill"
