"""The whole control plane (registry, KV broker, scheduler) in this process, over one Redis.

The servers are the real ones (each service's ``build_server``), started in dependency
order so that a port of 0 works: the registry first (the others watch it), then the broker,
then the scheduler (which opens sessions at the broker). ``hpd up`` runs it with the
services' production timings; ``hpd demo`` and the end-to-end tests with shorter ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypedDict

from hpd_common import auth, redis_conn, tracing
from hpd_common.logging import get_logger
from hpd_common.server import GrpcServer
from hpd_tools.embedded_redis import free_port

__all__ = ["ControlPlane", "ControlPlaneSettings", "InProcessKvBroker"]

log = get_logger("controlplane")


@dataclass(frozen=True, slots=True)
class ControlPlaneSettings:
    """Ports (0 = any free port), the Redis, and the few timings a fast demo shortens.

    ``lease_ttl_ms`` is the registry's default worker lease; a killed worker is noticed when
    it lapses (plus one ``sweep_interval_ms``). ``staleness_bound_ms``: how old the
    scheduler's fleet view may get before Schedule answers UNAVAILABLE.
    """

    redis_url: str
    host: str = "127.0.0.1"
    registry_port: int = 0
    scheduler_port: int = 0
    kvbroker_port: int = 0
    key_prefix: str = "hpd"
    lease_ttl_ms: int = 3_000
    sweep_interval_ms: int = 200
    bookmark_interval_ms: int = 250
    staleness_bound_ms: int = 5_000
    session_lease_ttl_ms: int = 5_000
    session_deadline_ms: int = 30_000
    profile: str = "default"
    directive_interval_ms: int = 2_000
    informer_max_backoff_ms: int = 500
    scheduler_id: str = "demo"
    log_level: str = "warning"
    scheduler_extra: dict[str, object] = field(default_factory=dict)
    # scheduler processes on the scheduler port (hpd_scheduler.processes): this process
    # serves as process 0, the others are children; process i's metrics on
    # metrics_port + i (this process's own /metrics is the caller's to serve)
    scheduler_processes: int = 1
    metrics_port: int = 0
    # auth (hpd_common.auth): the tokens file every service checks callers against, and the
    # token the scheduler and the broker present to the others ('' = auth off)
    auth_tokens_file: str = ""
    auth_open_reads: bool = False
    service_token: str = ""
    # listen beyond loopback without auth and TLS anyway (hpd_common.exposure)
    insecure: bool = False
    # mutual TLS (hpd_tools.tlsgen makes a throwaway set): every server presents
    # server_cert and asks clients for a certificate of ca; every client trusts ca and
    # presents client_cert ('' = plaintext)
    tls_ca_file: str = ""
    tls_server_cert_file: str = ""
    tls_server_key_file: str = ""
    tls_client_cert_file: str = ""
    tls_client_key_file: str = ""
    # every service's --tracing (hpd_common.tracing; a scheduler process of its own sets
    # itself up from it, this process is set up by the caller)
    tracing: bool = False


class _TlsSettings(TypedDict, total=False):
    tls_cert_file: str
    tls_key_file: str
    tls_client_ca_file: str
    call_ca_file: str
    call_cert_file: str
    call_key_file: str


class _ServerCommon(_TlsSettings, total=False):
    """The settings every service of one control plane shares (`ControlPlane._common`)."""

    host: str
    redis_url: str
    key_prefix: str
    log_level: str
    auth_tokens_file: str
    auth_open_reads: bool
    insecure: bool
    tracing: bool


class InProcessKvBroker:
    """The scheduler's session opener when the broker runs in the same process (``hpd up``):
    the broker's own ``open`` and ``abort``, awaited directly, as the scheduler would be
    answered over gRPC (same caller, same deadline, same refusal reasons).

    Why: a gRPC call between two servers of one asyncio process goes out through gRPC's
    core and back into the same event loop. Measured in ``bench/gateway.py`` (real engines,
    timestamps inside ``Schedule``): opening the session took about 8 ms at p50 that way
    while the broker spent about 2.5 ms on average serving it; it was most of the gateway's
    own time.
    Services in processes of their own (compose, ``hpd scheduler --broker-target``) still
    use gRPC.
    """

    enabled = True

    def __init__(self, service: Any, scheduler_token: str, timeout_s: float) -> None:
        # imported here, not at module level: the launcher loads services only when it
        # starts them (hpd_common is imported by every service)
        from hpd_kvbroker.identity import Caller
        from hpd_kvbroker.service import OpenRequest
        from hpd_scheduler.broker_client import SessionRefused, refusal_for

        self._svc = service
        self._caller = Caller(scheduler_token=scheduler_token)
        self._timeout_s = timeout_s
        self._open_request = OpenRequest
        self._refused = SessionRefused
        self._refusal_for = refusal_for

    async def open(
        self, request_id: str, source_worker_id: str, destination_worker_id: str, kv_bytes: int
    ) -> str:
        req = self._open_request(
            request_id=request_id,
            source_worker_id=source_worker_id,
            destination_worker_id=destination_worker_id,
            expected_bytes=max(1, kv_bytes),
        )
        try:
            with (
                tracing.span(_OPEN_SPAN, attributes=_OPEN_ATTRIBUTES) as span,
                auth.acting_as(_SCHEDULER),
            ):
                span.set_attribute("hpd.request_id", request_id)
                async with asyncio.timeout(self._timeout_s):
                    session, _created = await self._svc.open(req, self._caller)
                span.set_attribute("hpd.session_id", session.session_id)
        except Exception as exc:
            reason = self._refusal_for(exc)
            if reason is None:
                raise  # a bug, not a refusal: the Schedule RPC reports it as one
            log.warning("kv_session_refused", target="in-process", reason=reason)
            raise self._refused(reason) from exc
        return str(session.session_id)

    async def abort(self, session_id: str, reason: str) -> None:
        if not session_id:
            return
        with contextlib.suppress(Exception), auth.acting_as(_SCHEDULER):
            async with asyncio.timeout(self._timeout_s):
                await self._svc.abort(session_id, self._caller, reason[:256])

    async def close(self) -> None:
        return None


_SCHEDULER = auth.Principal("scheduler (in-process)", auth.Role.SCHEDULER)
_OPEN_SPAN = "hetero_pd.v1.KvBrokerService/OpenSession"
"""The broker's span of a session opened in process: named as over gRPC (the trace reads
the same whichever way the scheduler reaches the broker)."""
_OPEN_ATTRIBUTES = {"rpc.system": "in_process", "rpc.service": "hetero_pd.v1.KvBrokerService",
                    "rpc.method": "OpenSession"}  # fmt: skip


class ControlPlane:
    """Start with :meth:`start`, stop with :meth:`stop`; targets are ``host:port``."""

    def __init__(self, settings: ControlPlaneSettings) -> None:
        self.settings = settings
        self.registry: GrpcServer | None = None
        self.kvbroker: GrpcServer | None = None
        self.scheduler: GrpcServer | None = None
        self.scheduler_children: Any = None  # hpd_scheduler.processes.SchedulerProcesses
        self._watchdog: asyncio.Task[None] | None = None

    @staticmethod
    async def _restart_dead(children: Any, period_s: float = 1.0) -> None:
        """A scheduler child that died is started again (as ``hpd scheduler --processes``'s
        supervisor does)."""
        while True:
            await asyncio.sleep(period_s)
            await asyncio.to_thread(children.restart_dead)

    def _target(self, server: GrpcServer | None) -> str:
        if server is None:
            raise RuntimeError("control plane not started")
        return f"{self.settings.host}:{server.port}"

    @property
    def registry_target(self) -> str:
        return self._target(self.registry)

    @property
    def kvbroker_target(self) -> str:
        return self._target(self.kvbroker)

    @property
    def scheduler_target(self) -> str:
        return self._target(self.scheduler)

    @property
    def servers(self) -> list[GrpcServer]:
        return [x for x in (self.registry, self.kvbroker, self.scheduler) if x is not None]

    def _tls(self) -> _TlsSettings:
        """Each service's TLS settings: serve with the server cert, ask for client certs,
        and call the others over TLS with the client cert."""
        s = self.settings
        if not s.tls_ca_file:
            return _TlsSettings()
        return _TlsSettings(
            tls_cert_file=s.tls_server_cert_file,
            tls_key_file=s.tls_server_key_file,
            tls_client_ca_file=s.tls_ca_file,
            call_ca_file=s.tls_ca_file,
            call_cert_file=s.tls_client_cert_file,
            call_key_file=s.tls_client_key_file,
        )

    def _common(self) -> _ServerCommon:
        """What each service's settings share: address, Redis, key prefix, log level, auth
        and TLS."""
        s = self.settings
        return _ServerCommon(
            host=s.host,
            redis_url=s.redis_url,
            key_prefix=s.key_prefix,
            log_level=s.log_level,
            auth_tokens_file=s.auth_tokens_file,
            auth_open_reads=s.auth_open_reads,
            insecure=s.insecure,
            tracing=s.tracing,
            **self._tls(),
        )

    async def start(self) -> None:
        """The registry, then the broker (which follows the registry), then the scheduler
        (one process, or N sharing the port with a watchdog that restarts the dead)."""
        await self._start_registry()
        await self._start_kvbroker()
        await self._start_scheduler()

    async def _start_registry(self) -> None:
        from hpd_registry.__main__ import build_server as build_registry
        from hpd_registry.settings import RegistrySettings

        s = self.settings
        self.registry = build_registry(
            RegistrySettings(
                port=s.registry_port,
                lease_ttl_ms=s.lease_ttl_ms,
                min_lease_ttl_ms=min(300, s.lease_ttl_ms),
                sweep_interval_ms=s.sweep_interval_ms,
                bookmark_interval_ms=s.bookmark_interval_ms,
                **self._common(),
            ),
            redis_conn.connect(s.redis_url),
        )
        await self.registry.start()

    async def _start_kvbroker(self) -> None:
        from hpd_kvbroker.__main__ import build_server as build_kvbroker
        from hpd_kvbroker.settings import KvBrokerSettings

        s = self.settings
        self.kvbroker = build_kvbroker(
            KvBrokerSettings(
                port=s.kvbroker_port,
                registry_key_prefix=s.key_prefix,
                registry_target=self.registry_target,
                lease_ttl_ms=s.session_lease_ttl_ms,
                default_deadline_ms=s.session_deadline_ms,
                sweep_interval_ms=s.sweep_interval_ms,
                **self._common(),
                call_token=s.service_token,
            ),
            redis_conn.connect(s.redis_url),
        )
        await self.kvbroker.start()

    async def _start_scheduler(self) -> None:
        from hpd_scheduler.__main__ import build_server as build_scheduler
        from hpd_scheduler.settings import SchedulerSettings

        s = self.settings
        assert self.kvbroker is not None
        many = s.scheduler_processes > 1
        sched_settings = SchedulerSettings(
            port=s.scheduler_port or (free_port() if many else 0),
            processes=s.scheduler_processes,
            metrics_port=s.metrics_port if many else 0,
            registry_target=self.registry_target,
            broker_target=self.kvbroker_target,
            staleness_bound_ms=s.staleness_bound_ms,
            profile=s.profile,
            directive_interval_ms=s.directive_interval_ms,
            informer_max_backoff_ms=s.informer_max_backoff_ms,
            scheduler_id=s.scheduler_id,
            **self._common(),
            call_token=s.service_token,
            **s.scheduler_extra,  # type: ignore[arg-type]
        )
        if many:
            from hpd_scheduler.processes import SchedulerProcesses, child_settings

            self.scheduler_children = SchedulerProcesses(sched_settings, first=1)
            await asyncio.to_thread(self.scheduler_children.start)
            self._watchdog = asyncio.create_task(
                self._restart_dead(self.scheduler_children), name="scheduler-processes"
            )
            sched_settings = dataclasses.replace(child_settings(sched_settings, 0), metrics_port=0)
        opener = InProcessKvBroker(
            self.kvbroker.component.service,  # type: ignore[attr-defined]
            sched_settings.broker_token,
            sched_settings.broker_timeout_ms / 1000,
        )
        self.scheduler = build_scheduler(
            sched_settings, redis_conn.connect(s.redis_url), opener=opener
        )
        await self.scheduler.start()

    async def stop(self, grace_s: float | None = 0) -> None:
        """Stops the servers in reverse order; grace_s None = each server's own grace."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        if self.scheduler_children is not None:
            await asyncio.to_thread(self.scheduler_children.stop)
            self.scheduler_children = None
        for server in reversed(self.servers):
            with contextlib.suppress(Exception):
                await server.stop(grace_s)
            if server.redis is not None:
                with contextlib.suppress(Exception):
                    await server.redis.aclose()
        self.registry = self.kvbroker = self.scheduler = None
