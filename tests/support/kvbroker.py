"""Helpers shared by the KV broker's tests: a broker on port 0, registered workers, calls.

Component and integration tests start a broker over the suite's private Redis, beside
the `registry` fixture's registry (same key prefix), and talk to both through stubs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import kvbroker_pb2_grpc as k_grpc
from hetero_pd.v1 import registry_pb2 as r
from hpd_common import redis_conn
from hpd_common.clock import Clock
from hpd_common.server import GrpcServer
from hpd_kvbroker.__main__ import build_server
from hpd_kvbroker.api import KvBrokerComponent
from hpd_kvbroker.service import KvBrokerService
from hpd_kvbroker.settings import KvBrokerSettings
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import capability
from tests.support.servers import RegistryHandle, stop_server

GIB = 1 << 30


@dataclass
class BrokerHandle:
    server: GrpcServer
    channel: grpc.aio.Channel
    stub: Any
    service: KvBrokerService

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def close(self) -> None:
        await self.channel.close()
        await stop_server(self.server)


def broker_settings(redis_url: str, prefix: str, **overrides: Any) -> KvBrokerSettings:
    values: dict[str, Any] = {
        "port": 0,
        "redis_url": redis_url,
        "key_prefix": prefix,
        "registry_key_prefix": prefix,
        "sweep_interval_ms": 50,
        "watch_poll_ms": 300,
        "retention_ms": 60_000,
    }
    values.update(overrides)
    return KvBrokerSettings(**values)


async def start_broker(
    redis_url: str, prefix: str, clock: Clock | None = None, **overrides: Any
) -> BrokerHandle:
    """A broker server on port 0 with its own Redis client (as a separate replica has)."""
    server = build_server(
        broker_settings(redis_url, prefix, **overrides), redis_conn.connect(redis_url), clock
    )
    server._probe_interval_s = 0.1
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    component = server.component
    assert isinstance(component, KvBrokerComponent)
    return BrokerHandle(server, channel, k_grpc.KvBrokerServiceStub(channel), component.service)


async def register(registry_stub: Any, worker_id: str, lease_ttl_ms: int = 0, **cap: Any) -> str:
    """Registers a worker with the registry; returns its credential."""
    resp = await registry_stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(worker_id, **cap), lease_ttl_ms=lease_ttl_ms),
        timeout=5,
    )
    return str(resp.credential)


def caller(worker_id: str, credential: str) -> k.SessionCaller:
    return k.SessionCaller(worker_id=worker_id, credential=credential)


def open_request(
    request_id: str,
    src: str = "p1",
    dst: str = "d1",
    who: k.SessionCaller | None = None,
    expected: int = GIB,
    deadline_ms: int = 10_000,
    lease_ttl_ms: int = 5_000,
) -> k.OpenSessionRequest:
    return k.OpenSessionRequest(
        request_id=request_id,
        source_worker_id=src,
        destination_worker_id=dst,
        expected_bytes=expected,
        deadline_ms=deadline_ms,
        lease_ttl_ms=lease_ttl_ms,
        caller=who,
    )


# the component tests' broker beside a registry with four registered workers
TOKEN = "sched-secret"
GATEWAY_TOKEN = "gateway-secret"
SCHED = k.SessionCaller(scheduler_token=TOKEN)
GATEWAY = k.SessionCaller(gateway_token=GATEWAY_TOKEN)
V = k.CompatibilityVerdict


@dataclass
class Env:
    broker: BrokerHandle
    registry: RegistryHandle
    creds: dict[str, str]

    @property
    def stub(self) -> Any:
        return self.broker.stub

    def as_(self, worker_id: str) -> k.SessionCaller:
        return caller(worker_id, self.creds[worker_id])


@pytest.fixture
async def env(
    redis_server: EmbeddedRedis, registry: RegistryHandle, key_prefix: str
) -> AsyncIterator[Env]:
    creds = {
        "p1": await register(registry.stub, "p1", lease_ttl_ms=30_000),
        "d1": await register(
            registry.stub,
            "d1",
            lease_ttl_ms=30_000,
            pool_id="a100-decode",
            stages=(c.STAGE_DECODE,),
            gpu="A100-80G",
            block=32,
        ),
        "d2": await register(
            registry.stub,
            "d2",
            lease_ttl_ms=30_000,
            pool_id="l40s-decode",
            stages=(c.STAGE_DECODE,),
            gpu="L40S",
            dtype=c.KV_DTYPE_FP8_E4M3,
        ),
        "x1": await register(registry.stub, "x1", lease_ttl_ms=30_000),
    }
    broker = await start_broker(
        redis_server.url,
        key_prefix,
        registry_target=registry.target,
        scheduler_token=TOKEN,
        gateway_token=GATEWAY_TOKEN,
    )
    assert broker.service.informer is not None
    assert await broker.service.informer.wait_synced(5)
    yield Env(broker, registry, creds)
    await broker.close()


async def code_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def eventually(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    """Waits until ``check()`` holds (polled every 20 ms), failing after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)
