"""Suite-wide fixtures.

`redis_server`: a private redis-server on a free port for the whole session (never
the machine's own Redis). `registry`: a registry on port 0 over that Redis, with
short leases, and a connected stub; or, when HPD_REGISTRY_ADDR is set (the compose
suite), the registry at that address.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common import redis_conn
from hpd_common.logging import configure_logging
from hpd_common.server import pin_grpc_aio_runtime
from hpd_tools.embedded_redis import EmbeddedRedis

# the `scheduler` fixture (defined with its harness) is every test's, like `registry` below
from tests.support.scheduler import scheduler as scheduler
from tests.support.servers import RegistryHandle, external, start_registry, stop_server

configure_logging("warning", json_logs=False)


TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "component", "integration", "e2e", "compose", "real_engine", "security")
"""One marker per kind of test, named after the folder the kind lives in (pyproject.toml
describes each): ``pytest -m component`` runs the component tests, ``-m "not e2e"`` skips
the process-starting ones."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    for item in items:
        parts = item.path.resolve().relative_to(TESTS).parts
        if parts and parts[0] in KINDS:
            item.add_marker(getattr(pytest.mark, parts[0]))


def pytest_configure(config: pytest.Config) -> None:
    """Pin gRPC's asyncio runtime for the session (see ``pin_grpc_aio_runtime``): tests free
    their servers and channels, and without the pin each would cross the runtime's teardown,
    which can deadlock."""
    del config

    async def pin() -> None:
        pin_grpc_aio_runtime()

    asyncio.run(pin())


_STUCK_AFTER_S = 90.0


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    print(f"=== a test has run {_STUCK_AFTER_S:g} s: every task's stack ===", file=sys.stderr)
    for task in asyncio.all_tasks(loop):
        try:
            task.print_stack(file=sys.stderr)
        except Exception:  # a frame without a line number (the running task): name it only
            print(f"{task!r}", file=sys.stderr)


@pytest.fixture(autouse=True)
async def _dump_tasks_when_stuck() -> AsyncIterator[None]:
    """A test (or its fixtures' teardown) still running after 90 s prints every asyncio
    task's stack, before the per-test timeout fails it: a hang then names the awaits it is
    stuck in, which the timeout's thread dump cannot show."""
    loop = asyncio.get_running_loop()
    handle = loop.call_later(_STUCK_AFTER_S, _dump_tasks, loop)
    yield
    handle.cancel()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("redis")), persist=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def key_prefix() -> str:
    """A fresh key prefix per test: tests share the Redis, never each other's keys."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
async def redis_client(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    client = redis_conn.connect(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def registry(redis_server: EmbeddedRedis, key_prefix: str) -> AsyncIterator[RegistryHandle]:
    addr = external("registry")
    server = None
    if addr is None:
        server = await start_registry(redis_server.url, key_prefix)
        addr = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(addr)
    try:
        yield RegistryHandle(addr, channel, r_grpc.RegistryServiceStub(channel), server, key_prefix)
    finally:
        await channel.close()
        if server is not None:
            await stop_server(server)
