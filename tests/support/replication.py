"""A Redis primary with a replica, as the replication and failover tests start them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import redis.asyncio as aioredis

from hpd_tools.embedded_redis import EmbeddedRedis


def start_pair(folder: Path, persist: bool) -> tuple[EmbeddedRedis, EmbeddedRedis]:
    """A primary and a replica of it (each stopped by the caller)."""
    primary = EmbeddedRedis(folder / "primary", persist=persist).start()
    try:
        replica = EmbeddedRedis(
            folder / "replica",
            persist=persist,
            extra_args=["--replicaof", "127.0.0.1", str(primary.port)],
        ).start()
    except BaseException:
        primary.stop()
        raise
    return primary, replica


@contextlib.asynccontextmanager
async def plain(port: int) -> AsyncIterator[aioredis.Redis]:
    """A bare redis-py client of 127.0.0.1:``port``, to look at a server from outside."""
    client = aioredis.Redis(port=port)
    try:
        yield client
    finally:
        await client.aclose()


async def wait_synced(primary_port: int, replica_port: int, timeout_s: float = 20.0) -> None:
    """Until the replica's first sync is done and the primary counts its acknowledgements
    (a write followed by ``WAIT 1`` comes back acknowledged): the replica reporting its link
    up is not enough, the primary may not count it yet."""
    deadline = time.monotonic() + timeout_s
    async with plain(replica_port) as replica, plain(primary_port) as primary:
        while time.monotonic() < deadline:
            if (await replica.info("replication")).get("master_link_status") == "up":
                await primary.set("hpd:test:synced", "1")
                if int(await primary.execute_command("WAIT", 1, 100)) >= 1:
                    return
            await asyncio.sleep(0.025)
    raise TimeoutError("the replica did not sync with the primary")
