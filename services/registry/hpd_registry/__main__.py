"""`hpd registry`: run the registry service alone."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

import redis.asyncio as aioredis

from hpd_common import redis_conn
from hpd_common.clock import Clock, SystemClock
from hpd_common.errors import InvalidArgument
from hpd_common.logging import configure_logging
from hpd_common.metrics import serve_metrics
from hpd_common.server import GrpcServer, run_until_signal
from hpd_common.settings import add_arguments, load_settings
from hpd_registry.api import RegistryComponent
from hpd_registry.service import RegistryService, RegistrySettings


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpd registry",
        description="Run the registry: worker capability, leases, health, load, change feed.",
    )
    add_arguments(p, RegistrySettings)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    settings = load_settings(RegistrySettings, args)
    configure_logging(settings.log_level, settings.json_logs)
    serve_metrics(settings.metrics_port, settings.host)
    asyncio.run(run_until_signal([build_server(settings)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
