"""`wait_replicas`: a script call returns once a replica holds its write; with the replica
connected but stalled it fails as a retryable store outage; with no replica connected it
is acknowledged unreplicated (counted), as Redis's own asynchronous replication runs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from hpd_common import metrics
from hpd_common.embedded_redis import EmbeddedRedis
from hpd_common.redis_conn import STORE_DOWN, NotReplicated, connect

pytestmark = [pytest.mark.integration]

INCR = "redis.call('INCR', KEYS[1]); return redis.call('GET', KEYS[1])"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    primary = EmbeddedRedis(tmp_path / "p", persist=False).start()
    replica = EmbeddedRedis(
        tmp_path / "r",
        persist=False,
        extra_args=["--replicaof", "127.0.0.1", str(primary.port)],
    ).start()
    try:
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


@contextlib.asynccontextmanager
async def plain(port: int) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=port)
    try:
        yield client
    finally:
        await client.aclose()


async def synced(replica: EmbeddedRedis) -> None:
    async with plain(replica.port) as r:
        for _ in range(400):
            if (await r.info("replication")).get("master_link_status") == "up":
                return
            await asyncio.sleep(0.025)
    raise TimeoutError("replica did not sync")


def unreplicated() -> float:
    return metrics.REDIS_UNREPLICATED._value.get()  # type: ignore[no-any-return]


async def test_an_acknowledged_write_is_on_the_replica(
    pair: tuple[EmbeddedRedis, EmbeddedRedis],
) -> None:
    primary, replica = pair
    await synced(replica)
    client = connect(f"{primary.url}?wait_replicas=1&wait_timeout_ms=500")
    script = client.register_script(INCR)
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
    await synced(replica)
    client = connect(f"{primary.url}?wait_replicas=1&wait_timeout_ms=100")
    script = client.register_script(INCR)
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
    await synced(replica)
    replica.stop()
    client = connect(f"{primary.url}?wait_replicas=1&wait_timeout_ms=100")
    script = client.register_script(INCR)
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
