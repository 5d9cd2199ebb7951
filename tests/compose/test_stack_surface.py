"""What an operator sees of the running stack: grpcurl, health checks, metrics, Redis AOF."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.compose.stack import HPD_SERVICES, Stack, wait_serving

# The gRPC service each command serves besides health, reflection and diagnostics.
OWN_SERVICE = {
    "registry": "hetero_pd.v1.RegistryService",
    "scheduler": "hetero_pd.v1.SchedulerService",
    "kvbroker": "hetero_pd.v1.KvBrokerService",
}
COMMON_SERVICES = {
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "hetero_pd.v1.DiagnosticsService",
}


def grpcurl() -> str:
    local = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "grpcurl"
    found = str(local) if local.exists() else shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl not found: run scripts/bootstrap.sh")
    return found


def run_grpcurl(*args: str) -> str:
    done = subprocess.run(
        [grpcurl(), "-plaintext", "-max-time", "5", *args],
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )
    assert done.returncode == 0, f"grpcurl {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def started(stack: Stack, service: str) -> None:
    if service not in stack.services:
        pytest.skip(f"`hpd {service}` is not in this image yet")


@pytest.mark.parametrize("service", HPD_SERVICES)
def test_grpcurl_lists_services_through_reflection(stack: Stack, service: str) -> None:
    started(stack, service)
    listed = set(run_grpcurl(stack.addr(service), "list").split())
    assert listed >= COMMON_SERVICES, listed
    own = {name for name in listed if name.startswith("hetero_pd.v1.")} - COMMON_SERVICES
    assert own, f"{service} serves no hetero_pd.v1 service of its own: {listed}"
    if service == "registry":
        assert OWN_SERVICE["registry"] in own
        described = run_grpcurl(stack.addr(service), "describe", OWN_SERVICE["registry"])
        assert "rpc RegisterWorker" in described


@pytest.mark.parametrize("service", HPD_SERVICES)
def test_grpcurl_health_check_answers_serving(stack: Stack, service: str) -> None:
    started(stack, service)
    # earlier tests restart Redis, kill the registry and cut the network: every service
    # must be back to SERVING by itself, within a bound
    wait_serving(stack.addr(service), timeout_s=30)
    listed = run_grpcurl(stack.addr(service), "list").split()
    own = sorted(n for n in listed if n.startswith("hetero_pd.v1.") and n not in COMMON_SERVICES)
    names = ["", *own]
    for name in names:
        reply = run_grpcurl(
            "-d", json.dumps({"service": name}), stack.addr(service), "grpc.health.v1.Health/Check"
        )
        assert json.loads(reply) == {"status": "SERVING"}, (name, reply)


@pytest.mark.parametrize("service", ("redis", *HPD_SERVICES))
def test_container_health_check_passes(stack: Stack, service: str) -> None:
    """The health check compose.yaml declares, run inside the container by the engine."""
    if service != "redis":
        started(stack, service)
        wait_serving(stack.addr(service), timeout_s=30)
    container = stack.container(service)
    if stack.engine == "podman":
        # podman without systemd schedules no checks, but runs one on request.
        done = stack.run("healthcheck", "run", container, timeout_s=30)
        assert done.returncode == 0, f"{service}: {done.stdout.strip()} {done.stderr.strip()}"
    else:
        state = stack.inspect(container)["State"]
        assert state["Health"]["Status"] == "healthy", state["Health"]


@pytest.mark.parametrize("service", HPD_SERVICES)
def test_metrics_endpoint_is_published(stack: Stack, service: str) -> None:
    started(stack, service)
    port = os.environ.get(f"HPD_{service.upper()}_METRICS_PORT")
    if not port:
        pytest.skip("metrics port not published by the runner")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    assert reply.status == 200
    assert "# TYPE" in body


def test_redis_appends_to_a_named_volume(stack: Stack) -> None:
    assert stack.exec("redis", "redis-cli", "CONFIG", "GET", "appendonly").split() == [
        "appendonly",
        "yes",
    ]
    data = [m for m in stack.mounts("redis") if m.get("Destination") == "/data"]
    assert len(data) == 1 and data[0].get("Type") == "volume", stack.mounts("redis")
    assert str(data[0].get("Name", "")).endswith("redis-data")
    listing = stack.exec("redis", "ls", "/data/appendonlydir")
    assert ".incr.aof" in listing, listing
