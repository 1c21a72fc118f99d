"""The pools' and the KV tier's Ray actor classes: each builds its service
(cluster/services.py, cluster/tier_actor.py) in its own process and hands calls on to it.

Whoever starts a worker needs its actor class, and whoever holds an actor's handle loads
its class when the handle arrives. The services' modules import the engine or the tier,
and with them torch: ~2.6 s of CPU before the controller could start its first worker, in
a process that never runs a model. These classes import their service in `__init__`,
which runs in the actor's own process. Only the methods callers use through Ray are here.
"""

from __future__ import annotations

from typing import Any


class _WorkerActor:
    """What both pools' actors answer alike."""

    _service: Any

    def info(self) -> dict[str, Any]:
        return self._service.info()

    def health(self) -> dict[str, Any]:
        return self._service.health()

    async def abort(self, request_id: str) -> bool:
        return await self._service.abort(request_id)

    async def stats(self) -> dict[str, Any]:
        return await self._service.stats()

    async def reset_prefix_cache(self) -> bool:
        return await self._service.reset_prefix_cache()


class DecodeActor(_WorkerActor):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from pdserve.cluster.services import DecodeService

        self._service = DecodeService(*args, **kwargs)

    async def submit(self, payload: bytes) -> None:
        await self._service.submit(payload)

    async def first_token(self, payload: bytes) -> bool:
        return await self._service.first_token(payload)


class PrefillActor(_WorkerActor):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from pdserve.cluster.services import PrefillService

        self._service = PrefillService(*args, **kwargs)

    async def prefill(self, payload: bytes) -> bytes:
        return await self._service.prefill(payload)

    async def first_token(self, request_id: str) -> bytes:
        return await self._service.first_token(request_id)


class TierActor:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from pdserve.cluster.tier_actor import TierService

        self._service = TierService(*args, **kwargs)

    def put(self, layout_hash: str, block_hashes: list[int], blob: bytes, spec: list) -> int:
        return self._service.put(layout_hash, block_hashes, blob, spec)

    def lookup(self, layout_hash: str, block_hashes: list[int]) -> int:
        return self._service.lookup(layout_hash, block_hashes)

    def get(self, layout_hash: str, block_hashes: list[int]) -> tuple[bytes, list]:
        return self._service.get(layout_hash, block_hashes)

    def stats(self) -> dict:
        return self._service.stats()

    def clear(self) -> None:
        self._service.tier.clear()
