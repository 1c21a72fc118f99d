"""What the router process may ask of the pools' controller actor, with timeouts.

The ops endpoints (cluster/ops_api.py) and the autoscaler (cluster/autoscale.py) reach
the controller through this one class: every call has a timeout, a ValueError raised in
the controller (a bad role, a count outside the bounds, an unknown worker) comes back as
a 400, and a dead or slow controller as a 503.
"""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError, RayTaskError

from pdserve.cluster.openai_api import ApiError

CALL_TIMEOUT_S = 30.0


class PoolControl:
    def __init__(self, controller) -> None:
        self.controller = controller  # the Controller actor's handle

    async def _call(self, method: str, *args):
        try:
            return await asyncio.wait_for(
                getattr(self.controller, method).remote(*args), CALL_TIMEOUT_S
            )
        except RayTaskError as e:
            if isinstance(e.cause, ValueError):
                raise ApiError(str(e.cause), 400) from None
            raise ApiError(f"the pool controller failed: {e.cause!r}", 500, "server_error") from e
        except (TimeoutError, asyncio.TimeoutError) as e:
            raise ApiError("the pool controller did not answer in time", 503, "server_error") from e
        except RayActorError as e:
            raise ApiError("the pool controller is gone", 503, "server_error") from e

    async def members(self) -> list[dict]:
        return await self._call("members")

    async def stats(self) -> dict:
        return await self._call("stats")

    async def scale(self, role: str, replicas: int) -> dict:
        return await self._call("scale", role, replicas)

    async def drain(self, worker_id: str) -> dict:
        return await self._call("start_drain", worker_id)
