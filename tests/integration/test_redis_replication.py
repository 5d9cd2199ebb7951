"""`wait_replicas`: a script call returns once a replica holds its write; with the replica
connected but stalled it fails as a retryable store outage; with no replica connected it
is acknowledged unreplicated (counted), as Redis's own asynchronous replication runs."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hpd_common import metrics
from hpd_common.redis_conn import STORE_DOWN, HpdRedis, NotReplicated, connect
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.replication import plain, start_pair, wait_synced

INCR = "redis.call('INCR', KEYS[1]); return redis.call('GET', KEYS[1])"


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    """A primary and a replica that has finished its first sync."""
    primary, replica = start_pair(tmp_path, persist=False)
    try:
        await wait_synced(primary.port, replica.port)
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def acked_incr(primary: EmbeddedRedis, wait_timeout_ms: int) -> tuple[HpdRedis, Any]:
    """A client of ``primary`` waiting for one replica, and its INCR script."""
    client = connect(f"{primary.url}?wait_replicas=1&wait_timeout_ms={wait_timeout_ms}")
    return client, client.register_script(INCR)


def unreplicated() -> float:
    return metrics.REDIS_UNREPLICATED._value.get()  # type: ignore[no-any-return]


async def test_an_acknowledged_write_is_on_the_replica(
    pair: tuple[EmbeddedRedis, EmbeddedRedis],
) -> None:
    primary, replica = pair
    client, script = acked_incr(primary, 500)
    async with plain(replica.port) as r:
        for n in range(1, 21):
            assert await script(keys=["rep:k"]) == str(n).encode()
            # no sleep: the WAIT in the same round trip is what made it visible there
            assert await r.get("rep:k") == str(n).encode()
    await client.aclose()


async def test_a_stalled_replica_makes_the_write_retryable(
    pair: tuple[EmbeddedRedis, EmbeddedRedis],
) -> None:
    primary, replica = pair
    client, script = acked_incr(primary, 100)
    assert await script(keys=["rep:s"]) == b"1"
    assert replica.pid is not None
    os.kill(replica.pid, signal.SIGSTOP)  # connected, but acknowledges nothing
    try:
        with pytest.raises(NotReplicated) as err:
            await script(keys=["rep:s"])
        assert isinstance(err.value, STORE_DOWN)  # the store answers UNAVAILABLE
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    await client.aclose()


async def test_without_a_connected_replica_writes_go_on_unreplicated(
    pair: tuple[EmbeddedRedis, EmbeddedRedis],
) -> None:
    primary, replica = pair
    replica.stop()
    client, script = acked_incr(primary, 100)
    before = unreplicated()
    async with plain(primary.port) as p:
        for _ in range(100):  # the primary notices the replica's exit
            if int((await p.info("replication"))["connected_slaves"]) == 0:
                break
            await asyncio.sleep(0.02)
    assert await script(keys=["rep:u"]) == b"1"  # after one WAIT of 100 ms
    assert unreplicated() == before + 1
    # from then on no WAIT (it could only time out), every write still counted; a second
    # later the replica count is read again (INFO, not another 100 ms WAIT)
    loop = asyncio.get_running_loop()
    for n, pause in ((2, 0.0), (3, 1.05), (4, 0.0)):
        await asyncio.sleep(pause)
        t0 = loop.time()
        assert await script(keys=["rep:u"]) == str(n).encode()
        assert loop.time() - t0 < 0.09, n
    assert unreplicated() == before + 4
    await client.aclose()
