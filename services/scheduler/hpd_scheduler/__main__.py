"""`hpd scheduler`: run the scheduler service alone."""

from __future__ import annotations

import random
from collections.abc import Sequence

import redis.asyncio as aioredis

from hpd_common import redis_conn
from hpd_common.clock import Clock, SystemClock
from hpd_common.errors import InvalidArgument
from hpd_common.server import GrpcServer, serve_main
from hpd_scheduler import processes
from hpd_scheduler.api import SchedulerComponent
from hpd_scheduler.broker_client import KvSessionOpener, session_opener
from hpd_scheduler.service import SchedulerService
from hpd_scheduler.settings import SchedulerSettings


def build_server(
    settings: SchedulerSettings,
    client: aioredis.Redis | None = None,
    clock: Clock | None = None,
    rng: random.Random | None = None,
    opener: KvSessionOpener | None = None,
) -> GrpcServer:
    """A scheduler server on settings.port over `client` (or a new client for redis_url).
    With `broker_target` set and no `opener` given, sessions are opened at that broker."""
    if client is None:
        if not settings.redis_url:
            raise InvalidArgument("redis_url", "is required (or run `hpd up` for an embedded one)")
        client = redis_conn.connect(settings.redis_url)
    if opener is None:
        opener = session_opener(settings)
    service = SchedulerService(settings, client, clock or SystemClock(), rng, opener)
    return GrpcServer(
        "scheduler", settings, SchedulerComponent(service), client,
        reuse_port=settings.processes > 1,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    return serve_main(
        argv,
        "hpd scheduler",
        "Run the scheduler: request placement over a live fleet view, shared "
        "reservations, route records, closed-loop estimates, directives.",
        SchedulerSettings,
        build_server,
        prepare=processes.prepare,
    )


if __name__ == "__main__":
    raise SystemExit(main())
