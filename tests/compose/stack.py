"""The compose stack as the compose tests see it: containers by service, networks, ports.

The e2e script (scripts/compose-e2e.sh) brings the stack up and tells the tests where
it is through the environment:

- HPD_COMPOSE=1                 the stack is up (otherwise every compose test skips);
- HPD_COMPOSE_ENGINE            podman or docker (the CLI that controls containers);
- HPD_COMPOSE_PROJECT           the compose project name (containers carry its label);
- HPD_COMPOSE_SERVICES          the hpd services started, space separated;
- HPD_<SERVICE>_ADDR            host:port of each started service's published gRPC port;
- HPD_<SERVICE>_METRICS_PORT    its published /metrics port;
- HPD_COMPOSE_TLS_DIR           the stack's certificates, when it runs as shipped (mutual
                                TLS); unset in the plaintext phase (compose.e2e.yaml).

Containers are found by the compose labels that both Docker Compose and podman-compose
set, so the tests do not depend on either tool's container naming.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common.channels import CallIdentity, sync_channel
from tests.support.fleet import capability

HPD_SERVICES = ("registry", "scheduler", "kvbroker")

# How a client of the stack should be configured, and how the tests' clients are:
# - keepalive pings every 6 s (the servers accept one per 5 s), dead after 3 s more: a
#   connection whose peer vanished (a partition drops packets, it sends no reset) is
#   noticed within about 9 s instead of the kernel's TCP timeout of many minutes;
# - reconnect backoff capped at 1 s: gRPC's default grows to 120 s, which would
#   measure the client's patience, not the stack's recovery.
CLIENT_OPTIONS = [
    ("grpc.keepalive_time_ms", 6_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 0),
]


def enabled() -> bool:
    return os.environ.get("HPD_COMPOSE") == "1"


@dataclass(frozen=True, slots=True)
class ContainerState:
    id: str
    running: bool
    pid: int
    started_at: str
    restart_count: int


@dataclass(frozen=True, slots=True)
class Stack:
    """CLI access to the running stack; every command has a timeout (no test can hang)."""

    engine: str
    project: str
    services: tuple[str, ...]

    @classmethod
    def from_env(cls) -> Stack:
        engine = os.environ.get("HPD_COMPOSE_ENGINE", "podman")
        project = os.environ.get("HPD_COMPOSE_PROJECT", "hpd-e2e")
        services = tuple(os.environ.get("HPD_COMPOSE_SERVICES", "registry").split())
        return cls(engine, project, services)

    def run(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.engine, *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )

    def cli(self, *args: str, timeout_s: float = 60.0, check: bool = True) -> str:
        done = self.run(*args, timeout_s=timeout_s)
        if check and done.returncode != 0:
            raise AssertionError(
                f"{self.engine} {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout

    def container(self, service: str) -> str:
        """The id of the service's container (running or not)."""
        out = self.cli(
            "ps",
            "-a",
            "-q",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
        ).split()
        assert len(out) == 1, f"expected one container for {service}, found {out}"
        return out[0]

    def inspect(self, container: str) -> dict[str, Any]:
        data = json.loads(self.cli("inspect", "--type", "container", container))
        assert isinstance(data, list) and data, f"no inspect data for {container}"
        first: dict[str, Any] = data[0]
        return first

    def state(self, service: str) -> ContainerState:
        info = self.inspect(self.container(service))
        st = info["State"]
        return ContainerState(
            id=str(info["Id"]),
            running=bool(st.get("Running")),
            pid=int(st.get("Pid") or 0),
            started_at=str(st.get("StartedAt", "")),
            restart_count=int(info.get("RestartCount") or st.get("RestartCount") or 0),
        )

    def networks(self, service: str) -> dict[str, list[str]]:
        """Network name -> aliases of the service's container."""
        nets = self.inspect(self.container(service))["NetworkSettings"]["Networks"] or {}
        return {name: list(cfg.get("Aliases") or []) for name, cfg in nets.items()}

    def mounts(self, service: str) -> list[dict[str, Any]]:
        mounts: list[dict[str, Any]] = self.inspect(self.container(service)).get("Mounts") or []
        return mounts

    def exec(self, service: str, *cmd: str, timeout_s: float = 30.0) -> str:
        return self.cli("exec", self.container(service), *cmd, timeout_s=timeout_s)

    def addr(self, service: str) -> str:
        value = os.environ.get(f"HPD_{service.upper()}_ADDR", "")
        assert value, f"HPD_{service.upper()}_ADDR is not set"
        return value


def health_status(channel: grpc.Channel, service: str = "", timeout_s: float = 2.0) -> int:
    """One grpc.health.v1 Check; raises grpc.RpcError when the server does not answer."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    status: int = reply.status
    return status


def wait_until(
    what: str, probe: Callable[[], bool], timeout_s: float, every_s: float = 0.25
) -> float:
    """Polls `probe` until it is true; returns the seconds waited, fails after timeout_s."""
    start = time.monotonic()
    last: BaseException | None = None
    while time.monotonic() - start < timeout_s:
        try:
            if probe():
                return time.monotonic() - start
        except (grpc.RpcError, AssertionError, subprocess.SubprocessError) as exc:
            last = exc
        time.sleep(every_s)
    raise AssertionError(f"{what}: not reached within {timeout_s} s (last error: {last!r})")


def tls_dir() -> str:
    """The stack's certificates (HPD_COMPOSE_TLS_DIR) when it runs as shipped, on mutual
    TLS; empty for the plaintext phase."""
    return os.environ.get("HPD_COMPOSE_TLS_DIR", "")


def wait_serving(addr: str, timeout_s: float = 60.0) -> float:
    """Polls Health/Check on a fresh channel (mutual TLS with the plain client certificate
    when the stack runs on it) until SERVING; returns the seconds waited."""
    pki = tls_dir()
    ident = None
    if pki:
        ident = CallIdentity("", f"{pki}/ca.pem", f"{pki}/client.pem", f"{pki}/client.key")
    with sync_channel(addr, ident, options=CLIENT_OPTIONS) as channel:
        return wait_until(
            f"{addr} SERVING",
            lambda: health_status(channel, timeout_s=1.0) == health_pb2.HealthCheckResponse.SERVING,
            timeout_s,
        )


def register_workers(
    stub: r_grpc.RegistryServiceStub, pool: str, count: int, lease_ttl_ms: int = 120_000
) -> dict[str, str]:
    """Registers `count` workers in `pool` with a long lease; returns id -> credential.

    The lease outlasts the disruption each test causes, so a worker that is gone
    afterwards was lost, not expired.
    """
    creds: dict[str, str] = {}
    for i in range(count):
        worker_id = f"{pool}-w{i}"
        reply = stub.RegisterWorker(
            r.RegisterWorkerRequest(
                capability=capability(worker_id, pool_id=pool), lease_ttl_ms=lease_ttl_ms
            ),
            timeout=5.0,
        )
        assert reply.worker_id == worker_id
        creds[worker_id] = reply.credential
    return creds


def pool_members(stub: r_grpc.RegistryServiceStub, pool: str) -> set[str]:
    reply = stub.ListWorkers(r.ListWorkersRequest(pool_id=pool, page_size=1000), timeout=3.0)
    return {w.capability.worker_id for w in reply.workers}


def deregister(stub: r_grpc.RegistryServiceStub, creds: dict[str, str]) -> None:
    for worker_id, credential in creds.items():
        with contextlib.suppress(grpc.RpcError):
            stub.DeregisterWorker(
                r.DeregisterWorkerRequest(worker_id=worker_id, credential=credential), timeout=3.0
            )


def heartbeat(stub: r_grpc.RegistryServiceStub, worker_id: str, credential: str) -> Any:
    """One unary heartbeat with the worker's own credential; returns the response."""
    return stub.Heartbeat(
        r.HeartbeatRequest(worker_id=worker_id, credential=credential), timeout=3.0
    )
