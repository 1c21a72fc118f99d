"""Pool autoscaling (DESIGN §5): prefill on its backlog, decode on KV occupancy and queues.

Each tick the router process turns what it already knows into one level per pool:
- decode: "high" when its ready workers' mean KV cache usage is over `decode_kv_high` or
  more than `decode_waiting_high` requests wait per worker (on the workers or in the
  router's queue for a decode slot); "low" when usage is under
  `decode_kv_low` and nothing waits;
- prefill: prompt tokens this router has sent for prefill and not had answered, per
  ready worker: "high" over `prefill_tokens_high`, "low" under `prefill_tokens_low`.
A pool grows by one worker once its level has stayed "high" for `up_after_s`, and
shrinks by one once "low" for `down_after_s`; never outside its bounds, never while one
of its workers is still starting (the last step has not been seen yet), and not within
`cooldown_s` of its last change. Scaling itself is the controller's (`scale`): new
workers start, surplus ones drain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    """The marks and timings. The defaults are first guesses, not tuned on a real load
    yet: override them with the config file's `autoscale_policy`."""

    interval_s: float = 5.0
    up_after_s: float = 20.0
    down_after_s: float = 300.0
    cooldown_s: float = 60.0
    decode_kv_high: float = 0.85
    decode_kv_low: float = 0.3
    decode_waiting_high: float = 2.0  # waiting requests per ready decode worker
    prefill_tokens_high: float = 16384.0  # prompt tokens in flight per ready prefill worker
    prefill_tokens_low: float = 1024.0


def autoscale_config(overrides: dict | None) -> AutoscaleConfig:
    """AutoscaleConfig with `overrides` (a config file's `autoscale_policy`); ValueError
    naming an unknown key or a value that is not a number >= 0."""
    overrides = overrides or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"autoscale_policy must be a mapping, got {overrides!r}")
    known = {f.name for f in fields(AutoscaleConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"autoscale_policy: unknown keys {unknown}; known: {sorted(known)}")
    for key, value in overrides.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        # the marks may be negative or above 1 on purpose ("always high" / "never low")
        if not number or (key.endswith("_s") and value < 0):
            raise ValueError(f"autoscale_policy.{key} must be a number (>= 0 for times)")
    cfg = AutoscaleConfig(**overrides)
    if cfg.interval_s <= 0:
        raise ValueError("autoscale_policy.interval_s must be > 0")
    return cfg


def decode_level(stats: list[dict], cfg: AutoscaleConfig, queued: int = 0) -> tuple[str, dict]:
    """The decode pool's level from its ready workers' last stats and the requests queued
    in the router for a decode slot."""
    usage = [s["kv_cache_usage_perc"] for s in stats if "kv_cache_usage_perc" in s]
    kv = sum(usage) / len(usage) if usage else 0.0
    waiting = queued + sum(s.get("num_requests_waiting", 0) for s in stats)
    waiting /= max(1, len(stats))
    if kv > cfg.decode_kv_high or waiting > cfg.decode_waiting_high:
        level = "high"
    elif kv < cfg.decode_kv_low and waiting == 0:
        level = "low"
    else:
        level = "ok"
    return level, {"kv_cache_usage_perc": kv, "waiting_per_worker": waiting}


def prefill_level(tokens_in_flight: list[int], cfg: AutoscaleConfig) -> tuple[str, dict]:
    """The prefill pool's level from the prompt tokens in flight on its ready workers."""
    per_worker = sum(tokens_in_flight) / max(1, len(tokens_in_flight))
    if per_worker > cfg.prefill_tokens_high:
        level = "high"
    elif per_worker < cfg.prefill_tokens_low:
        level = "low"
    else:
        level = "ok"
    return level, {"prompt_tokens_per_worker": per_worker}


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig, bounds: dict[str, tuple[int, int]]) -> None:
        self.cfg, self.bounds = cfg, bounds
        self._level: dict[str, tuple[str, float]] = {}  # role -> (level, since)
        self._last_change: dict[str, float] = {}
        self._last: dict[str, dict] = {}  # role -> the last tick's view, for the page
        self._changes: dict[str, dict] = {}  # role -> its last resize (wall time, target)

    def decide(self, role: str, level: str, total: int, starting: int, now: float) -> int | None:
        """The pool's new size, or None to leave it. `total`: its workers not draining
        (ready + starting)."""
        held_level, since = self._level.get(role, (None, now))
        if held_level != level:
            since = now
        self._level[role] = (level, since)
        lo, hi = self.bounds[role]
        if starting or now - self._last_change.get(role, -float("inf")) < self.cfg.cooldown_s:
            return None
        target = None
        if total < lo or total > hi:
            target = min(max(total, lo), hi)
        elif level == "high" and now - since >= self.cfg.up_after_s and total < hi:
            target = total + 1
        elif level == "low" and now - since >= self.cfg.down_after_s and total > lo:
            target = total - 1
        if target is not None:
            self._last_change[role] = now
            self._level[role] = (level, now)  # the next step needs the level held anew
        return target

    async def tick(self, control: Any, router: Any, now: float) -> dict[str, int]:
        """One round: read the pools, decide, ask the controller. Returns role -> target
        for the pools it resized."""
        members = await control.members()
        await router.poll_stats()
        changed = {}
        for role in ROLES:
            lo, hi = self.bounds[role]
            if hi == 0:
                continue  # colocated: no prefill pool
            pool = [m for m in members if m["role"] == role and not m["draining"]]
            ready = [m["worker_id"] for m in pool if m["state"] == "ready"]
            if role == "decode":
                level, detail = decode_level(
                    [router.worker_stats.get(w, {}) for w in ready], self.cfg, router.queued()
                )
            else:
                tokens = [router.load_of(w)["prompt_tokens_in_flight"] for w in ready]
                level, detail = prefill_level(tokens, self.cfg)
            starting = len(pool) - len(ready)
            target = self.decide(role, level, len(pool), starting, now)
            if target is not None:
                await control.scale(role, target)
                changed[role] = target
                self._changes[role] = {"time": time.time(), "from": len(pool), "to": target}
                logger.warning("autoscale: %s pool %d -> %d (%s)", role, len(pool), target, level)
            self._last[role] = {
                "level": level, "held_s": now - self._level[role][1], "workers": len(pool),
                "starting": starting, "last_change": self._changes.get(role), **detail,
            }  # fmt: skip
        return changed

    def view(self) -> dict:
        return {
            "enabled": True,
            "bounds": {r: list(b) for r, b in self.bounds.items()},
            "config": asdict(self.cfg),
            "pools": self._last,
        }


async def autoscale_loop(autoscaler: Autoscaler, control: Any, router: Any) -> None:
    """Tick every `interval_s` until cancelled; a failed tick is logged, not fatal."""
    while True:
        await asyncio.sleep(autoscaler.cfg.interval_s)
        try:
            await autoscaler.tick(control, router, time.monotonic())
        except Exception:
            logger.exception("autoscale tick failed")
