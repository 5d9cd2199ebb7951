"""`hpd kvbroker`: run the KV broker service alone."""

from __future__ import annotations

import random
from collections.abc import Sequence

import redis.asyncio as aioredis

from hpd_common import redis_conn
from hpd_common.clock import Clock, SystemClock
from hpd_common.errors import InvalidArgument
from hpd_common.server import GrpcServer, serve_main
from hpd_kvbroker.api import KvBrokerComponent
from hpd_kvbroker.service import KvBrokerService
from hpd_kvbroker.settings import KvBrokerSettings


def build_server(
    settings: KvBrokerSettings,
    client: aioredis.Redis | None = None,
    clock: Clock | None = None,
    rng: random.Random | None = None,
) -> GrpcServer:
    """A broker server on settings.port over `client` (or a new client for redis_url)."""
    if client is None:
        if not settings.redis_url:
            raise InvalidArgument("redis_url", "is required (or run `hpd up` for an embedded one)")
        client = redis_conn.connect(settings.redis_url)
    service = KvBrokerService(settings, client, clock or SystemClock(), rng)
    return GrpcServer("kvbroker", settings, KvBrokerComponent(service), client)


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(
        argv,
        "hpd kvbroker",
        "Run the KV broker: KV format negotiation, the prefill x decode "
        "compatibility matrix, KV transfer sessions.",
        KvBrokerSettings,
        build_server,
    )


if __name__ == "__main__":
    raise SystemExit(main())
