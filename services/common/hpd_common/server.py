"""gRPC server bootstrap shared by the three services.

One `GrpcServer` per service port: `grpc.aio` with `grpc.health.v1` (one status per
service name plus the overall ""), server reflection, DiagnosticsService, optional
TLS or mutual TLS, and a readiness loop that reports NOT_SERVING while Redis is
unreachable or the component says it is not ready (the scheduler's stale view).
`run_until_signal` stops everything gracefully on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from hetero_pd.v1 import diagnostics_pb2, diagnostics_pb2_grpc
from hpd_common import auth_interceptor, tracing, tracing_interceptor
from hpd_common.aio import cancel_and_wait
from hpd_common.channels import CallSettings
from hpd_common.diagnostics import DiagnosticsApi
from hpd_common.errors import InvalidArgument
from hpd_common.exposure import check_exposure
from hpd_common.logging import get_logger
from hpd_common.redis_conn import RedisHealthProbe

log = get_logger("server")

TRACING_HELP = (
    "OpenTelemetry traces of this service's RPCs, exported over OTLP as the standard OTEL_* "
    "variables say (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ...)"
)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class ServerSettings(CallSettings):
    """Settings every service has. Services subclass this and override the port default."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=0, metadata={"help": "gRPC port (0 = any free port)"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port (0 = off)"})
    redis_url: str = field(
        default="",
        metadata={"help": "Redis URL: redis://host:6379/0, or redis+sentinel://s1:26379,"
                  "s2:26379/<service>; ?wait_replicas=N makes each write wait for N replicas"},
    )  # fmt: skip
    redis_memory_limit_ratio: float = field(
        default=0.9,
        metadata={"help": "refuse new plans and KV sessions (RESOURCE_EXHAUSTED) once Redis "
                  "uses this share of its maxmemory (0 = never; no maxmemory = never)"},
    )  # fmt: skip
    tls_cert_file: str = field(
        default="", metadata={"help": "PEM server certificate (enables TLS)"}
    )
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of the certificate"})
    tls_client_ca_file: str = field(
        default="", metadata={"help": "PEM CA bundle; when set, clients must present a cert (mTLS)"}
    )
    auth_tokens_file: str = field(
        default="",
        metadata={"help": "YAML file of bearer tokens and their roles; enables auth (README: "
                  "Who may do what); unset, every caller may do everything"},
    )  # fmt: skip
    auth_open_reads: bool = field(
        default=False,
        metadata={"help": "with auth on, read-only RPCs need no token (default: any known "
                  "identity; the fleet's endpoints and route records are not for strangers)"},
    )  # fmt: skip
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    json_logs: bool | None = field(default=None, metadata={"help": "JSON logs (default: no TTY)"})
    tracing: bool = field(default=False, metadata={"help": TRACING_HELP})
    shutdown_grace_s: float = field(default=5.0, metadata={"help": "drain time on SIGTERM"})
    insecure: bool = field(
        default=False,
        metadata={"help": "listen beyond loopback without auth and TLS anyway (never in "
                  "production: anyone who reaches the port may register workers)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not 0 <= self.redis_memory_limit_ratio < 1:
            raise InvalidArgument("redis_memory_limit_ratio", "must be in [0, 1)")
        check_exposure(
            self.host,
            auth=bool(self.auth_tokens_file),
            tls=bool(self.tls_cert_file),
            insecure=self.insecure,
            what="this service",
        )


class Component(Protocol):
    """A service as the bootstrap sees it."""

    @property
    def service_names(self) -> Sequence[str]: ...

    def add_to_server(self, server: grpc.aio.Server) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> bool: ...

    def watch_readiness(self, notify: Callable[[], None]) -> None:
        """Calls `notify` whenever `ready()` may have changed (beside the periodic probe)."""

    def drain(self) -> None:
        """Ends the long-lived streams it serves (the server has stopped taking RPCs)."""


class ServiceComponent:
    """A service's use-case object as a Component: start, stop, always ready. Each service
    subclasses it to name its gRPC service and add its servicer (and, for the scheduler,
    to answer readiness from its fleet view's age)."""

    service_names: tuple[str, ...] = ()

    def __init__(self, service: Any) -> None:
        self.service = service

    def add_to_server(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        await self.service.stop()

    def ready(self) -> bool:
        return True

    def watch_readiness(self, notify: Callable[[], None]) -> None:
        """Always ready: nothing to tell."""

    def drain(self) -> None:
        """No stream that outlives its work: nothing to end."""


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    """TLS (cert + key) or mutual TLS (plus client CA) credentials, or None for plaintext."""
    if not settings.tls_cert_file and not settings.tls_key_file:
        if settings.tls_client_ca_file:
            raise InvalidArgument("tls_client_ca_file", "needs tls_cert_file and tls_key_file")
        return None
    if not (settings.tls_cert_file and settings.tls_key_file):
        raise InvalidArgument("tls_cert_file", "TLS needs both tls_cert_file and tls_key_file")

    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise InvalidArgument(name, f"cannot read {path}: {exc.strerror}") from exc

    cert = read("tls_cert_file", settings.tls_cert_file)
    key = read("tls_key_file", settings.tls_key_file)
    ca = (
        read("tls_client_ca_file", settings.tls_client_ca_file)
        if settings.tls_client_ca_file
        else None
    )
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


_grpc_aio_pinned = False


def pin_grpc_aio_runtime() -> None:
    """Keep gRPC's asyncio runtime alive for the rest of the process. Idempotent; call it
    with the event loop running (``GrpcServer.start`` does).

    ``grpc.aio`` starts its runtime (a completion-queue poller thread plus a socket pair that
    wakes the event loop) with the first channel or server and tears it down when the last
    one is freed. That teardown can deadlock in grpcio 1.76: the loop stops draining the
    wake-up socket before the poller thread has seen the shutdown, and a poller blocked on
    the full socket is then joined forever, from whatever frame freed the last object. A
    process that stops its last server or channel and later opens another (``hpd demo``,
    ``hpd up`` restarts, a test session) crosses that teardown each time. One extra
    reference taken here means it never runs while the process lives; at exit the poller is
    a daemon thread and the interpreter skips the teardown.
    """
    global _grpc_aio_pinned
    if not _grpc_aio_pinned:
        grpc.aio.init_grpc_aio()
        _grpc_aio_pinned = True


class GrpcServer:
    """Serves one component on one port with health, reflection and diagnostics."""

    def __init__(
        self,
        name: str,
        settings: ServerSettings,
        component: Component,
        redis: aioredis.Redis | None,
        probe_interval_s: float = 0.5,
        reuse_port: bool = False,
    ) -> None:
        self.name = name
        self.reuse_port = reuse_port
        """Bind with SO_REUSEPORT (several processes serving one port); else a port
        already in use is an error."""
        self.settings = settings
        self.component = component
        self.redis = redis
        self.health = HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._probe: RedisHealthProbe | None = None
        self._probe_interval_s = probe_interval_s
        self._ready_task: asyncio.Task[None] | None = None
        self._serving: bool | None = None
        self._recheck = asyncio.Event()  # the component's readiness may have changed

    async def start(self) -> int:
        """Binds, starts the component and the server; returns the bound port."""
        pin_grpc_aio_runtime()
        interceptors = auth_interceptor.interceptors_for(
            self.settings.auth_tokens_file, self.settings.auth_open_reads
        )
        if not interceptors:
            log.info("auth_off", service=self.name, detail="every caller may do everything")
        options = [
            ("grpc.so_reuseport", 1) if k == "grpc.so_reuseport" and self.reuse_port else (k, v)
            for k, v in SERVER_OPTIONS
        ]
        # tracing outermost (its span covers the auth check); none while tracing is off
        server = grpc.aio.server(
            options=options,
            interceptors=[*tracing_interceptor.server_interceptors(), *interceptors],
        )
        self.component.add_to_server(server)
        diagnostics_pb2_grpc.add_DiagnosticsServiceServicer_to_server(
            DiagnosticsApi(self.redis), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [
            *self.component.service_names,
            diagnostics_pb2.DESCRIPTOR.services_by_name["DiagnosticsService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, server)
        address = f"{self.settings.host}:{self.settings.port}"
        creds = server_credentials(self.settings)
        self.port = (
            server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        )
        if not self.port:
            raise OSError(f"cannot listen on {address}")
        await self._set_serving(False)
        self.component.watch_readiness(self._recheck.set)
        await self.component.start()
        await server.start()
        self._server = server
        self._ready_task = asyncio.create_task(self._readiness_loop(), name=f"ready-{self.name}")
        log.info(
            "server_started",
            service=self.name,
            address=f"{self.settings.host}:{self.port}",
            tls=creds is not None,
            mtls=bool(self.settings.tls_client_ca_file),
            auth=bool(interceptors),
        )
        return self.port

    async def _set_serving(self, serving: bool) -> None:
        if serving == self._serving:
            return
        self._serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.component.service_names):
            await self.health.set(name, status)
        log.info("health_changed", service=self.name, serving=serving)

    async def _readiness_loop(self) -> None:
        redis_up = self.redis is None
        probe = None
        if self.redis is not None:

            async def changed(up: bool) -> None:
                nonlocal redis_up
                redis_up = up

            probe = RedisHealthProbe(self.redis, self.name, changed, self._probe_interval_s)
            self._probe = probe
        while True:
            self._recheck.clear()
            if probe is not None:
                await probe.check_once()
            await self._set_serving(redis_up and self.component.ready())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._probe_interval_s):
                    await self._recheck.wait()

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING first (so balancers move away), then drain RPCs, then stop the component."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        if self._ready_task:
            await cancel_and_wait([self._ready_task], timeout_s=2)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                await self.health.enter_graceful_shutdown()
        if self._server is not None:
            stopping = asyncio.ensure_future(self._server.stop(grace))
            await asyncio.sleep(0)  # new RPCs are refused from here on
            self.component.drain()  # streams that never end by themselves end now
            try:  # bounded: a connection stuck mid-handshake must not hold shutdown forever
                async with asyncio.timeout(grace + 5):
                    await stopping
            except TimeoutError:
                log.warning("server_stop_timed_out", service=self.name)
        try:
            async with asyncio.timeout(grace + 5):
                await self.component.stop()
        except TimeoutError:
            log.warning("component_stop_timed_out", service=self.name)
        log.info("server_stopped", service=self.name)


FREEZE_ENV = "HPD_GC_FREEZE"


def freeze_startup_heap() -> int:
    """Collect once, then move every object left to the collector's permanent generation
    (:func:`gc.freeze`): the modules, settings, compiled policy and channels a service
    builds at start-up live until it exits, and without this every full collection walks
    them again while the event loop waits (``hpd_gc_pause_seconds`` shows it). Later
    objects are collected as before. ``HPD_GC_FREEZE=0`` leaves the heap as it is. Returns
    the objects frozen (0 when left)."""
    import gc
    import os

    if os.environ.get(FREEZE_ENV, "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def run_until_signal(
    servers: Sequence[GrpcServer],
    on_started: Callable[[], Awaitable[None]] | None = None,
    stop_event: asyncio.Event | None = None,
) -> None:
    """Starts every server, waits for SIGTERM/SIGINT (or stop_event), stops them in reverse."""
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    started: list[GrpcServer] = []
    try:
        for server in servers:
            await server.start()
            started.append(server)
        if on_started is not None:
            await on_started()
        log.info("startup_heap_frozen", objects=freeze_startup_heap())
        await stop.wait()
        log.info("shutdown_requested")
    finally:
        for server in reversed(started):
            await server.stop()


def serve_main(
    argv: Sequence[str] | None,
    prog: str,
    description: str,
    settings_cls: type[Any],
    build: Callable[[Any], GrpcServer],
    prepare: Callable[[Any], Any] | None = None,
) -> int:
    """The `hpd <service>` entry point every service shares: flags, environment and YAML
    settings, logging, metrics, then the server built inside the running event loop (a
    grpc.aio channel or task made before it would belong to no loop) until SIGTERM/SIGINT.
    A bad setting prints one line naming it and exits 2. ``prepare`` (optional) sees the
    settings first and returns the settings to serve with, or an int: the exit code of a
    process that did its work another way (a supervisor of several servers)."""
    import argparse
    import sys

    from hpd_common.logging import configure_logging
    from hpd_common.metrics import serve_metrics
    from hpd_common.settings import add_arguments, load_settings

    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, settings_cls)
    args = parser.parse_args(argv)
    try:
        settings = load_settings(settings_cls, args)
        configure_logging(settings.log_level, settings.json_logs)
        if prepare is not None:
            prepared = prepare(settings)
            if isinstance(prepared, int):
                return prepared
            settings = prepared
    except (InvalidArgument, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        server = build(settings)
        await run_until_signal([server])

    try:
        serve_metrics(settings.metrics_port, settings.host)
        tracing.configure(settings.tracing, prog.replace(" ", "-"))
        asyncio.run(serve())
    except InvalidArgument as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()
    return 0
