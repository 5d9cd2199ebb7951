"""`hpd gateway`: the OpenAI-compatible front door of a hetero-pd fleet.

Point OpenAI clients at it; every request is counted, scheduled and run on the engines
with their own KV hand-off (vLLM's NIXL protocol), with the plan's fallbacks. It plans in
its own process, as one more scheduler replica over the control plane's Redis (no hop
per request; ``hpd_gateway/embedded_client.py``), or at a scheduler service with ``--scheduler``:

    hpd gateway --port 8000 --redis-url redis://127.0.0.1:6379/0 \\
        --broker 127.0.0.1:50053 --registry 127.0.0.1:50051
    hpd gateway --port 8000 --scheduler 127.0.0.1:50052 --broker 127.0.0.1:50053 \\
        --registry 127.0.0.1:50051
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 16}'

Every setting is also HPD_<NAME> and a key of the YAML file given by ``--config``. The
gateway runs on uvloop; HPD_EVENT_LOOP=asyncio runs it on the standard library's loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import ssl
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry

from hpd_common import aio, tracing
from hpd_common.channels import CallSettings
from hpd_common.errors import InvalidArgument
from hpd_common.exposure import check_exposure
from hpd_common.logging import configure_logging, get_logger
from hpd_common.metrics import watch_gc
from hpd_common.processes import ProcessGroup, process_index
from hpd_common.server import freeze_startup_heap
from hpd_common.settings import load_settings, settings_parser, split_csv
from hpd_scheduler.settings import SchedulerSettings

from .api import build_app, build_metrics_app
from .control_client import ControlPlane
from .embedded_client import replica_settings
from .engine_client import EngineHttp
from .keys import ApiKeys, KeyFileError
from .metrics import GatewayMetrics
from .service import Gateway, GatewayConfig
from .tokens import LocalTokenizers

log = get_logger("gateway")


@dataclass(frozen=True)
class GatewaySettings(CallSettings):
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "HTTP port of the OpenAI API"})
    scheduler: str = field(
        default="",
        metadata={"help": "scheduler host:port to plan at (remote mode); empty: plan in this "
                  "process, a scheduler replica over --redis-url (embedded mode)"},
    )  # fmt: skip
    redis_url: str = field(
        default="",
        metadata={"help": "the control plane's Redis (embedded mode): reservations, route "
                  "records and learned figures are shared with every scheduler replica there"},
    )  # fmt: skip
    scheduler_config: str = field(
        default="",
        metadata={"help": "YAML of `hpd scheduler` settings for the embedded replica (profile, "
                  "tiers_file, key_prefix, its credentials with auth on, ...); the Redis URL, "
                  "registry and broker are this gateway's"},
    )  # fmt: skip
    broker: str = field(default="127.0.0.1:50053", metadata={"help": "KV broker host:port"})
    registry: str = field(default="127.0.0.1:50051", metadata={"help": "registry host:port"})
    gateway_token: str = field(
        default="", metadata={"help": "the KV broker's gateway token (if it has one)"}
    )
    prefix_routing: bool = field(
        default=True,
        metadata={
            "help": "send the prompt's block chain (its token ids keyed at the engines' KV"
            " block size) with every Schedule, so prefill goes where the prefix is cached"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "model=folder,... of tokenizer.json files: count prompt tokens here "
            "instead of asking an engine's /tokenize"
        },
    )
    default_tier: str = field(
        default="standard", metadata={"help": "tier of a request without a header (no keys)"}
    )
    api_keys: str = field(
        default="",
        metadata={"help": "YAML file of clients' API keys, each bound to a tenant, its tiers "
                  "and limits (hpd_gateway/keys.py; `hpd gateway-key` makes one): every "
                  "request then needs Authorization: Bearer <key>"},
    )  # fmt: skip
    tls_cert_file: str = field(default="", metadata={"help": "PEM certificate: serve HTTPS"})
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of the certificate"})
    insecure: bool = field(
        default=False,
        metadata={"help": "listen beyond loopback without API keys and TLS anyway (behind a "
                  "proxy that does both; never open to the internet)"},
    )  # fmt: skip
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "address of /metrics"})
    metrics_port: int = field(
        default=0,
        metadata={"help": "port of /metrics, a listener of its own (0 = a free port, printed "
                  "at start; -1 = off); the public port never shows engines' addresses"},
    )  # fmt: skip
    body_timeout_s: float = field(
        default=15.0, metadata={"help": "a request body must arrive within this; else 408"}
    )
    keepalive_timeout_s: float = field(
        default=15.0, metadata={"help": "an idle client connection is closed after this"}
    )
    max_connections: int = field(
        default=4096, metadata={"help": "open client connections; past it new ones are closed"}
    )
    default_output_tokens: int = field(
        default=256, metadata={"help": "expected output tokens when max_tokens is not given"}
    )
    max_body_bytes: int = field(default=4 << 20, metadata={"help": "larger bodies are 413"})
    max_concurrent: int = field(
        default=1024, metadata={"help": "requests in flight; past it 429 with Retry-After"}
    )
    schedule_stream: bool = field(
        default=True,
        metadata={
            "help": "plan every request over one ScheduleStream to the scheduler (false: a "
            "unary Schedule call per request)"
        },
    )
    scheduler_channels: int = field(
        default=1,
        metadata={
            "help": "connections to the scheduler, each with its own ScheduleStream, used in "
            "turn; set it to at least the scheduler's --processes so every process serves"
        },
    )
    rpc_timeout_ms: int = field(default=2000, metadata={"help": "deadline of control-plane RPCs"})
    connect_timeout_s: float = field(default=2.0, metadata={"help": "engine connect timeout"})
    read_timeout_s: float = field(
        default=300.0, metadata={"help": "longest silence of an engine before the step fails"}
    )
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    json_logs: bool | None = field(default=None, metadata={"help": "JSON logs (default: no TTY)"})
    workers: int = field(
        default=1,
        metadata={"help": "gateway processes serving this port (SO_REUSEPORT; the kernel "
                  "spreads connections), about one per core: each a whole gateway with its "
                  "own scheduler replica, sharing Redis; needs a fixed --port; metrics of "
                  "worker i on metrics_port + i"},
    )  # fmt: skip
    tracing: bool = field(
        default=False,
        metadata={"help": "OpenTelemetry traces of every request (a span per step, its "
                  "traceparent sent to the scheduler and the engines), exported over OTLP as "
                  "the standard OTEL_* variables say (OTEL_EXPORTER_OTLP_ENDPOINT, ...)"},
    )  # fmt: skip


def _pairs(text: str, name: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in split_csv(text):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InvalidArgument(name, f"{item!r} is not key=value")
        out.append((key, value))
    return tuple(out)


def _check(s: GatewaySettings) -> ApiKeys | None:
    """The settings' files and exposure (first: an unprotected listener is the error to
    name), checked before anything starts; the API keys."""
    if bool(s.tls_cert_file) != bool(s.tls_key_file):
        raise InvalidArgument("tls_key_file", "tls_cert_file and tls_key_file go together")
    keys = ApiKeys.load(s.api_keys) if s.api_keys else None
    check_exposure(
        s.host, auth=keys is not None, tls=bool(s.tls_cert_file), insecure=s.insecure,
        what="hpd gateway",
    )  # fmt: skip
    if s.scheduler and (s.redis_url or s.scheduler_config):
        raise InvalidArgument(
            "scheduler", "plan at a scheduler (--scheduler) or in this process (--redis-url, "
            "--scheduler-config), not both",
        )  # fmt: skip
    embedded_settings(s)  # a missing Redis URL or a bad replica setting, before anything starts
    for name in ("body_timeout_s", "keepalive_timeout_s"):
        if not getattr(s, name) > 0:
            raise InvalidArgument(name, "must be > 0")
    if s.max_connections < 1:
        raise InvalidArgument("max_connections", "must be >= 1")
    if s.workers < 1:
        raise InvalidArgument("workers", "must be >= 1")
    if s.workers > 1 and s.port == 0:
        raise InvalidArgument("workers", "more than one worker needs a fixed --port")
    return keys


def _cap_connections(server: web.Server, cap: int, metrics: GatewayMetrics) -> None:
    """Close a new connection past ``cap`` open ones at once (aiohttp has no such limit):
    slow or idle clients cannot take every socket the process may open."""
    made, lost = server.connection_made, server.connection_lost
    open_now = 0

    def connection_made(handler: Any, transport: Any) -> None:
        nonlocal open_now
        open_now += 1
        metrics.connections.set(open_now)
        made(handler, transport)
        if open_now > cap:
            metrics.refused.labels("connection_cap").inc()
            transport.close()

    def connection_lost(handler: Any, exc: BaseException | None) -> None:
        nonlocal open_now
        open_now -= 1
        metrics.connections.set(open_now)
        lost(handler, exc)

    server.connection_made = connection_made  # type: ignore[method-assign]
    server.connection_lost = connection_lost  # type: ignore[method-assign,assignment]


async def make_runner(
    app: web.Application, s: GatewaySettings, metrics: GatewayMetrics
) -> web.AppRunner:
    """The public port's runner, set up: handlers cancelled with their client, the keep-alive
    timeout and the connection cap of ``s``."""
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=3.0,
        keepalive_timeout=s.keepalive_timeout_s,
    )  # fmt: skip
    await runner.setup()
    assert runner.server is not None
    _cap_connections(runner.server, s.max_connections, metrics)
    return runner


def embedded_settings(s: GatewaySettings) -> SchedulerSettings | None:
    """The embedded scheduler replica's settings (None: remote mode, ``--scheduler``)."""
    if s.scheduler:
        return None
    return replica_settings(
        s.scheduler_config, s.redis_url, s.registry, s.broker, s.call_identity()
    )


class GatewayServer:
    """``hpd gateway``'s whole assembly (control-plane clients, engine pool, the use case, the
    aiohttp app) started and stopped as one; ``hpd demo`` runs this same server in front of
    its emulated engines. ``clock`` times TTFT and TPOT (seconds; the demo passes its
    emulated clock); ``metrics_registry`` is where the gateway's metrics go (the process's
    default registry for ``hpd gateway``)."""

    def __init__(
        self,
        s: GatewaySettings,
        clock: Callable[[], float] | None = None,
        metrics_registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.settings = s
        self.keys = _check(s)
        self.control = ControlPlane(
            s.scheduler,
            s.broker,
            s.registry,
            s.gateway_token,
            timeout_s=s.rpc_timeout_ms / 1000,
            identity=s.call_identity(),
            stream=s.schedule_stream,
            scheduler_channels=s.scheduler_channels,
            embedded=embedded_settings(s),
        )
        self.engines = EngineHttp(s.connect_timeout_s, s.read_timeout_s)
        extra = {"clock": clock} if clock is not None else {}
        self.gateway = Gateway(
            self.control,
            self.engines,
            GatewayMetrics(metrics_registry),
            GatewayConfig(s.default_tier, s.default_output_tokens, s.prefix_routing),
            tokenizers=LocalTokenizers(dict(_pairs(s.tokenizer, "tokenizer"))),
            **extra,
        )
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.url = ""
        self.metrics_url = ""

    async def start(self, fleet_wait_s: float = 5.0) -> str:
        """Connect, listen, wait (at most ``fleet_wait_s``) for the first fleet view; returns
        the base URL (the port is the OS's choice when the settings say 0)."""
        s = self.settings
        await self.control.start()
        await self.engines.start()
        app = build_app(
            self.gateway, s.max_body_bytes, s.max_concurrent, keys=self.keys,
            body_timeout_s=s.body_timeout_s,
        )  # fmt: skip
        self._runner = await make_runner(app, s, self.gateway.metrics)
        ssl_ctx = None
        if s.tls_cert_file:
            ssl_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_ctx.load_cert_chain(s.tls_cert_file, s.tls_key_file)
        # several workers share the port (hpd_common.processes): each binds it with reuse
        shared = s.workers > 1 or process_index(WORKER_ENV) is not None
        site = web.TCPSite(self._runner, s.host, s.port, ssl_context=ssl_ctx, reuse_port=shared)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"{'https' if ssl_ctx else 'http'}://{host}:{port}"
        if s.metrics_port >= 0:
            self._metrics_runner = web.AppRunner(build_metrics_app(self.gateway), access_log=None)
            await self._metrics_runner.setup()
            await web.TCPSite(self._metrics_runner, s.metrics_host, s.metrics_port).start()
            mhost, mport = self._metrics_runner.addresses[0][:2]
            self.metrics_url = f"http://{mhost}:{mport}/metrics"
        await self.control.fleet.wait_synced(fleet_wait_s)
        return self.url

    async def stop(self, flush_s: float = 5.0) -> None:
        """Stop listening (requests in flight get the runner's shutdown grace), then give
        the outcome and session reports still on their way up to ``flush_s`` to land."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._metrics_runner is not None:
            mrunner, self._metrics_runner = self._metrics_runner, None
            await mrunner.cleanup()
        await self.gateway.flush(flush_s)
        await self.engines.close()
        await self.control.close()


WORKER_ENV = "HPD_GATEWAY_WORKER"
"""Set to the worker's index in every gateway process ``--workers N`` starts."""


def worker_settings(s: GatewaySettings) -> GatewaySettings:
    """A worker started by ``--workers``: its own metrics port (``metrics_port + i``)."""
    index = process_index(WORKER_ENV)
    if index is None or s.metrics_port <= 0:
        return s
    return dataclasses.replace(s, metrics_port=s.metrics_port + index)


async def _keep_workers(group: ProcessGroup) -> None:
    """Workers 1..N-1 of ``--workers N`` (this process is worker 0): one that dies is
    started again, as ``hpd scheduler --processes`` does."""
    while True:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(group.restart_dead)


async def serve(s: GatewaySettings, ready: asyncio.Event | None = None) -> None:
    server = GatewayServer(s)
    url = await server.start()
    group = None
    if s.workers > 1 and process_index(WORKER_ENV) is None:
        group = ProcessGroup("hpd_gateway", WORKER_ENV, s, s.workers, first=1)
        group.start()
        keeper = asyncio.ensure_future(_keep_workers(group))
        print(f"hpd: gateway: {s.workers} workers share the port", file=sys.stderr, flush=True)
    print(f"hpd: gateway listening on {url}", file=sys.stderr, flush=True)
    if server.metrics_url:
        print(f"hpd: gateway metrics on {server.metrics_url}", file=sys.stderr, flush=True)
    if server.keys is None:
        log.warning("api_keys_off", detail="any client may use any tier (no --api-keys)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    watch_gc()
    freeze_startup_heap()
    try:
        await stop.wait()
    finally:
        if group is not None:
            keeper.cancel()
            await asyncio.to_thread(group.stop)
        await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    prog = "hpd gateway"
    parser = settings_parser(prog, __doc__, GatewaySettings)
    args = parser.parse_args(argv)
    try:
        settings = worker_settings(load_settings(GatewaySettings, args))
        configure_logging(settings.log_level, settings.json_logs)
        _check(settings)
        LocalTokenizers(dict(_pairs(settings.tokenizer, "tokenizer")))  # fails fast
        aio.event_loop()  # an unknown HPD_EVENT_LOOP, before anything starts
    except (InvalidArgument, KeyFileError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    tracing.configure(settings.tracing, "hpd-gateway")
    try:
        aio.run(serve(settings))
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
