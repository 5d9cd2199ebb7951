"""Servers the tests start and the addresses of ones run outside (the compose stage):
the helpers component, integration and e2e tests share (the fixtures that use them are in
``tests/conftest.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import grpc

from hpd_common import redis_conn
from hpd_common.server import GrpcServer


@dataclass
class RegistryHandle:
    target: str
    channel: grpc.aio.Channel
    stub: Any
    server: GrpcServer | None
    prefix: str


def external(name: str) -> str | None:
    """The address of an externally run service (compose suite), if one is configured."""
    return os.environ.get(f"HPD_{name.upper()}_ADDR") or None


async def start_registry(redis_url: str, prefix: str, **overrides: Any) -> GrpcServer:
    from hpd_registry.__main__ import build_server
    from hpd_registry.settings import RegistrySettings

    settings = RegistrySettings(
        port=0,
        redis_url=redis_url,
        key_prefix=prefix,
        lease_ttl_ms=overrides.pop("lease_ttl_ms", 3_000),
        sweep_interval_ms=overrides.pop("sweep_interval_ms", 100),
        bookmark_interval_ms=overrides.pop("bookmark_interval_ms", 200),
        min_lease_ttl_ms=overrides.pop("min_lease_ttl_ms", 100),
        **overrides,
    )
    server = build_server(settings, redis_conn.connect(redis_url))
    server._probe_interval_s = 0.1
    await server.start()
    return server


async def stop_server(server: GrpcServer) -> None:
    """Stop a server a test started (no grace) and close the Redis client it was built with."""
    await server.stop(0)
    if server.redis is not None:
        await server.redis.aclose()
