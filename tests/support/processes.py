"""Service processes started by tests: wait until they serve, stop them whatever they do."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hpd_common.channels import CallIdentity, sync_channel


def wait_serving(
    addrs: Sequence[str],
    proc: subprocess.Popen[Any],
    timeout_s: float,
    what: str = "hpd up",
    identity: CallIdentity | None = None,
) -> None:
    """Until every address answers its gRPC health check SERVING; an error if ``proc``
    exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        ok = True
        for addr in addrs:
            with sync_channel(addr, identity) as ch:
                try:
                    resp = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=2
                    )
                    ok &= resp.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    ok = False
        if ok:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not serve in {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[Any], timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL when it has not exited within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def schedule_when_ready(stub: Any, request: Any, tries: int = 100) -> Any:
    """``stub.Schedule(request)`` once the scheduler's fleet view can plan it: UNAVAILABLE
    (view not synced) and FAILED_PRECONDITION (workers not in it yet) are retried every
    100 ms, ``tries`` times; the ScheduleResponse."""
    for _ in range(tries - 1):
        try:
            return stub.Schedule(request, timeout=5)
        except grpc.RpcError as exc:
            if exc.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.FAILED_PRECONDITION,
            ):
                raise
            time.sleep(0.1)
    return stub.Schedule(request, timeout=5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return sorted(out)


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")
