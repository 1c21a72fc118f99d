"""The router's choice of a decode worker (cluster/route_policy.py `prefer_cached`): the
worker holding most of the prompt wins among those near the least busy; past that band
load wins. Workers are names with counts, as the router passes its own."""

from __future__ import annotations

import pytest

from pdserve.cluster.route_policy import RouterConfig, prefer_cached


def _pick(inflight: dict[str, int], hits: dict[str, int], slack: int = 8, usage=None) -> str:
    usage = usage or {}
    return prefer_cached(
        list(inflight), inflight.__getitem__, lambda w: hits.get(w, 0),
        lambda w: usage.get(w, 0.0), slack,
    )  # fmt: skip


def test_the_worker_with_the_prompt_wins_within_the_band():
    # A conversation's next turn: d1 holds 480 of its tokens and is a little busier.
    assert _pick({"d0": 2, "d1": 5}, {"d1": 480}) == "d1"
    # The longest cached prefix wins among several.
    assert _pick({"d0": 0, "d1": 0, "d2": 1}, {"d0": 32, "d2": 64}) == "d2"


def test_past_the_band_load_wins():
    assert _pick({"d0": 2, "d1": 11}, {"d1": 480}) == "d0"  # 11 > 2 + 8
    # The band is a quarter of the least busy when that is more than the slack.
    assert _pick({"d0": 100, "d1": 124}, {"d1": 480}) == "d1"
    assert _pick({"d0": 100, "d1": 126}, {"d1": 480}) == "d0"
    assert _pick({"d0": 2, "d1": 3}, {"d1": 480}, slack=0) == "d0"


def test_without_hits_the_least_busy_then_the_most_headroom():
    assert _pick({"d0": 3, "d1": 1, "d2": 1}, {}, usage={"d1": 0.5, "d2": 0.2}) == "d2"
    assert _pick({"d0": 0}, {}) == "d0"


def test_a_negative_slack_is_refused():
    with pytest.raises(ValueError, match="decode_prefix_slack must be >= 0"):
        RouterConfig(decode_prefix_slack=-1)


class _Handle:
    """What the router's pick reads of a worker: its id (nothing is called on it)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


def test_a_requests_choices_follow_its_first_to_one_worker():
    """In PD mode a choice's prompt is remembered on its decode worker only once pulled,
    so the router's index cannot keep a request's n choices together: the first choice's
    worker counts as holding the whole prompt for the others (while in the band), and
    there the prompt is pulled once for all (runner/prefix_sharing.py)."""
    from pdserve.cluster.router import Router

    d0, d1 = _Handle("d0"), _Handle("d1")
    router = Router(RouterConfig(), [d0, d1], [])
    hashes = router.prefix_index.hashes(list(range(100)))
    first = router._grant_decode(hashes)
    assert first is d0
    assert router._grant_decode(hashes, sibling="d0") is d0  # not d1, the idler one
    assert router._grant_decode(hashes) is d1  # another request: by load
    router._inflight["d0"] += 9  # d0 past the band: the choice goes by load
    assert router._grant_decode(hashes, sibling="d0") is d1


def test_a_replys_hashes_extend_its_prompts():
    """The router hashes a reply's blocks only (`PrefixIndex.extended`), and gets the
    chain the workers compute for the whole sequence, salted or not."""
    from pdserve.cluster.prefix_index import PrefixIndex

    index = PrefixIndex(16)
    prompt, seq = list(range(3, 40)), list(range(3, 90))
    for salt in (None, "tenant-a"):
        assert index.extended(index.hashes(prompt, salt), seq, salt) == index.hashes(seq, salt)
    assert index.hashes(seq, "tenant-a") != index.hashes(seq)
