"""`hpd gateway --workers 2`: two gateway processes on one port (each with its own scheduler
replica and metrics port), connections spread over both, a dead one comes back, SIGTERM
stops them all."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.processes import alive, children, free_port, stop, wait_for
from tests.support.servers import RegistryHandle, external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="needs an isolated fleet"),
]

ROOT = Path(__file__).resolve().parents[2]


def requests_counted(metrics_port: int) -> float:
    """The gateway's ``hpd_gateway_requests_total`` summed over its labels (-1: no answer)."""
    try:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hpd_gateway_requests_total{")
    )


def post(port: int, body: dict[str, object]) -> int:
    """POST a completion on a connection of its own; the status."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Connection": "close"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


# size: one end-to-end scenario whose steps build on each other, read in order
def test_two_gateway_workers_serve_one_port_and_stop_together(
    redis_server: EmbeddedRedis, registry: RegistryHandle, tmp_path: Path
) -> None:
    config = tmp_path / "replica.yaml"
    config.write_text(f"key_prefix: {registry.prefix}\ndirective_interval_ms: 0\n")
    port, metrics = free_port(), free_port()
    while metrics + 1 == port:
        metrics = free_port()
    sup = subprocess.Popen(
        [
            sys.executable, "-m", "hpd_gateway", "--workers", "2", "--port", str(port),
            "--metrics-port", str(metrics), "--redis-url", redis_server.url,
            "--scheduler-config", str(config), "--registry", registry.target,
            "--broker", "127.0.0.1:1", "--log-level", "warning",
        ],
        cwd=ROOT,
        env={**os.environ},
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(
            lambda: requests_counted(metrics) >= 0 and requests_counted(metrics + 1) >= 0,
            30,
            "both workers' metrics",
        )
        kids = children(sup.pid)
        assert len(kids) == 1, kids  # this process is worker 0, its child worker 1
        # the kernel spreads new connections over both: each worker answers some (a model
        # without workers is a 404 from either; all on one by chance 1 in 2^31)
        statuses = {post(port, {"model": "nope", "prompt": "hi", "max_tokens": 2})
                    for _ in range(32)}  # fmt: skip
        assert statuses == {404}, statuses
        assert requests_counted(metrics) > 0 and requests_counted(metrics + 1) > 0
        # a worker that dies is started again, on the same port and metrics port
        os.kill(kids[0], signal.SIGKILL)
        wait_for(
            lambda: len(children(sup.pid)) == 1 and kids[0] not in children(sup.pid),
            20,
            "the killed worker replaced",
        )
        wait_for(lambda: requests_counted(metrics + 1) >= 0, 30, "its metrics back")
        kids = children(sup.pid)
        # SIGTERM to worker 0: every worker stops, the port is free again
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(20) == 0
        assert not [pid for pid in kids if alive(pid)]
        with socket.socket() as sock:  # no process listens on it (TIME_WAIT may remain)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
    finally:
        if sup.poll() is None:
            stop(sup)


def test_more_than_one_worker_needs_a_fixed_port() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hpd_gateway", "--workers", "2", "--port", "0", "--scheduler", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "workers" in out.stderr and "fixed --port" in out.stderr, out.stderr
