"""`hpd up`: the whole control plane in one process, for one machine.

With no --redis-url it starts an embedded Redis (a private redis-server child with
append-only persistence under --state-dir) and stops it on exit; restarting
`hpd up` with the same --state-dir finds every registration again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Sequence
from pathlib import Path

from hpd_common.controlplane import ControlPlane, ControlPlaneSettings
from hpd_common.embedded_redis import EmbeddedRedis
from hpd_common.logging import configure_logging, get_logger
from hpd_common.metrics import serve_metrics

log = get_logger("up")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpd up",
        description="Run the hetero-pd control plane (registry, scheduler, KV broker) on this "
        "machine, in one process.",
        epilog="Then try: grpcurl -plaintext 127.0.0.1:50051 list",
    )
    p.add_argument("--redis-url", default="", help="use this Redis instead of an embedded one")
    p.add_argument("--state-dir", default=".hpd", help="embedded Redis data (AOF) directory")
    p.add_argument("--redis-port", type=int, default=0, help="embedded Redis port (0 = free port)")
    p.add_argument("--host", default="127.0.0.1", help="address the services listen on")
    p.add_argument("--registry-port", type=int, default=50051)
    p.add_argument("--scheduler-port", type=int, default=50052)
    p.add_argument("--kvbroker-port", type=int, default=50053)
    p.add_argument("--metrics-port", type=int, default=9451, help="Prometheus port (0 = off)")
    p.add_argument("--lease-ttl-ms", type=int, default=10_000, help="default worker lease")
    p.add_argument("--log-level", default="info")
    p.add_argument("--json-logs", action=argparse.BooleanOptionalAction, default=None)
    return p


async def _serve(args: argparse.Namespace, redis_url: str) -> None:
    from hpd_kvbroker.service import KvBrokerSettings
    from hpd_registry.service import RegistrySettings
    from hpd_scheduler.service import SchedulerSettings

    reg, kvb, sch = RegistrySettings(), KvBrokerSettings(), SchedulerSettings()
    cp = ControlPlane(
        ControlPlaneSettings(  # the services' own defaults: this is the long-lived setup
            redis_url=redis_url,
            host=args.host,
            registry_port=args.registry_port,
            scheduler_port=args.scheduler_port,
            kvbroker_port=args.kvbroker_port,
            key_prefix=reg.key_prefix,
            lease_ttl_ms=args.lease_ttl_ms,
            sweep_interval_ms=reg.sweep_interval_ms,
            bookmark_interval_ms=reg.bookmark_interval_ms,
            staleness_bound_ms=sch.staleness_bound_ms,
            session_lease_ttl_ms=kvb.lease_ttl_ms,
            session_deadline_ms=kvb.default_deadline_ms,
            profile=sch.profile,
            directive_interval_ms=sch.directive_interval_ms,
            informer_max_backoff_ms=sch.informer_max_backoff_ms,
            scheduler_id=sch.scheduler_id,
            log_level=args.log_level,
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await cp.start()
        for name, target in (
            ("registry", cp.registry_target),
            ("scheduler", cp.scheduler_target),
            ("kvbroker", cp.kvbroker_target),
        ):
            print(f"hpd: {name} listening on {target}", flush=True)
        print(f"hpd: state store {redis_url}; Ctrl-C to stop", flush=True)
        await stop.wait()
        log.info("shutdown_requested")
    finally:
        await cp.stop(grace_s=None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level, args.json_logs)
    serve_metrics(args.metrics_port, args.host)
    if args.redis_url:
        asyncio.run(_serve(args, args.redis_url))
        return 0
    state = Path(args.state_dir).resolve() / "redis"
    with EmbeddedRedis(state, port=args.redis_port, persist=True) as redis:
        print(f"hpd: embedded Redis on 127.0.0.1:{redis.port} (AOF in {state})", flush=True)
        asyncio.run(_serve(args, redis.url))
    return 0
