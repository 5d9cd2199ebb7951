"""`hpd registry`: run the registry service alone."""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from hpd_common import redis_conn
from hpd_common.clock import Clock, SystemClock
from hpd_common.errors import InvalidArgument
from hpd_common.server import GrpcServer, serve_main
from hpd_registry.api import RegistryComponent
from hpd_registry.service import RegistryService
from hpd_registry.settings import RegistrySettings


def build_server(
    settings: RegistrySettings, client: aioredis.Redis | None = None, clock: Clock | None = None
) -> GrpcServer:
    """A registry server on settings.port over `client` (or a new client for redis_url)."""
    if client is None:
        if not settings.redis_url:
            raise InvalidArgument("redis_url", "is required (or run `hpd up` for an embedded one)")
        client = redis_conn.connect(settings.redis_url)
    service = RegistryService(settings, client, clock or SystemClock())
    return GrpcServer("registry", settings, RegistryComponent(service), client)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(
        argv,
        "hpd registry",
        "Run the registry: worker capability, leases, health, load, change feed.",
        RegistrySettings,
        build_server,
    )


if __name__ == "__main__":
    raise SystemExit(main())
