"""The router's token subscriber binds its endpoint again right after a subscriber on it
closed (zmq releases the port in its I/O thread, a moment later: a router started again
on the same endpoint, or one test after another), and still refuses a port another live
socket holds, after its bounded wait."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from ray_controller import free_endpoint

from pdserve.cluster.token_stream import TokenSubscriber


def test_an_endpoint_closed_a_moment_ago_binds_again():
    async def scenario() -> None:
        endpoint = free_endpoint()
        for _ in range(30):  # without the wait this failed within a few rounds
            sub = TokenSubscriber(endpoint, lambda w, d: None)
            sub.start()
            await sub.close()

    asyncio.run(scenario())


def test_a_port_held_by_a_live_socket_is_refused_after_the_wait():
    async def scenario() -> None:
        endpoint = free_endpoint()
        holder = TokenSubscriber(endpoint, lambda w, d: None)
        start = time.monotonic()
        with pytest.raises(zmq.ZMQError) as err:
            TokenSubscriber(endpoint, lambda w, d: None, bind_timeout_s=0.2)
        assert err.value.errno == zmq.EADDRINUSE
        assert 0.2 <= time.monotonic() - start < 2.0
        await holder.close()

    asyncio.run(scenario())
