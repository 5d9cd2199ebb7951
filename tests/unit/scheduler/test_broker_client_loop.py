"""The broker client is built before the server's event loop runs (as `hpd scheduler`
does): it must still work inside that loop."""

from __future__ import annotations

import asyncio

import pytest

from hpd_scheduler.broker_client import GrpcKvBroker, SessionRefused
from hpd_tools.embedded_redis import free_port


def test_client_made_outside_the_loop_works_inside_it() -> None:
    client = GrpcKvBroker(f"127.0.0.1:{free_port()}", timeout_s=0.5)  # nothing listens there

    async def use() -> str:
        try:
            with pytest.raises(SessionRefused) as err:
                await client.open("req-1", "p1", "d1", 1024)
            return err.value.reason
        finally:
            await client.close()

    assert asyncio.run(use()) == "broker_unreachable"
