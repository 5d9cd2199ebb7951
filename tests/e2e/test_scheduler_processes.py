"""`hpd scheduler --processes 2`: two scheduler processes on one port, each with its own
metrics port; a dead one comes back; SIGTERM stops them all."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.support.fleet import load
from tests.support.processes import (
    alive,
    children,
    free_port,
    schedule_when_ready,
    stop,
    wait_for,
    wait_serving,
)
from tests.support.scheduler import register, sched
from tests.support.servers import RegistryHandle, external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="needs an isolated fleet"),
]

ROOT = Path(__file__).resolve().parents[2]


def metrics_hold(port: int, needle: bytes = b"hpd_scheduler_fleet_workers") -> bool:
    """A scheduler's /metrics answers on ``port`` with ``needle`` in it."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return needle in resp.read()
    except OSError:
        return False


# size: one end-to-end scenario whose steps build on each other, read in order
async def test_two_processes_serve_one_port_and_stop_together(
    redis_server: EmbeddedRedis, registry: RegistryHandle
) -> None:
    wid = f"{registry.prefix}-both"
    await register(
        registry, wid, load(free=900, total=1000), pool_id="both",
        stages=(c.STAGE_PREFILL, c.STAGE_DECODE), kv_gib=40,
    )  # fmt: skip
    port, metrics = free_port(), free_port()
    while metrics + 1 == port:
        metrics = free_port()
    sup = subprocess.Popen(  # noqa: ASYNC220
        [
            sys.executable, "-m", "hpd_scheduler", "--processes", "2", "--port", str(port),
            "--metrics-port", str(metrics), "--redis-url", redis_server.url,
            "--key-prefix", registry.prefix, "--registry-target", registry.target,
            "--directive-interval-ms", "0", "--scheduler-id", "multi", "--log-level", "warning",
            "--shutdown-grace-s", "0",
        ],
        cwd=ROOT,
        env={**os.environ},
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_serving, [f"127.0.0.1:{port}"], sup, 30, "hpd scheduler")
        kids = children(sup.pid)
        assert len(kids) == 2, kids
        await asyncio.to_thread(
            wait_for, lambda: metrics_hold(metrics) and metrics_hold(metrics + 1), 20, "metrics"
        )
        # each process times its garbage collections (the start-up heap's collection first)
        await asyncio.to_thread(
            wait_for,
            lambda: all(
                metrics_hold(m, b'hpd_gc_pause_seconds_count{generation="2"}')
                for m in (metrics, metrics + 1)
            ),
            20,
            "gc pauses in metrics",
        )
        # connections are spread by the kernel: many channels reach both processes
        seen: set[str] = set()
        for i in range(24):
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            ) as ch:
                stub = s_grpc.SchedulerServiceStub(ch)
                for _ in range(50):  # until this process's view holds the worker
                    try:
                        await stub.Schedule(sched(f"mp-{i}", prompt=200, output=20), timeout=5)
                        break
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in (
                            grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.FAILED_PRECONDITION,
                        ):
                            raise
                        await asyncio.sleep(0.1)
                rec = await stub.GetRouteRecord(s.GetRouteRecordRequest(request_id=f"mp-{i}"))
                seen.add(rec.record.scheduler_id)
        assert seen == {"multi-0", "multi-1"}, seen
        # the gateway's client with several channels: its streams reach both processes (16
        # connections, each to a process the kernel picks: all on one by chance 1 in 2^15)
        from hpd_gateway.control_client import ControlPlane

        cp = ControlPlane(f"127.0.0.1:{port}", "127.0.0.1:1", "127.0.0.1:1", scheduler_channels=16)
        try:
            plans = await asyncio.gather(
                *(cp.schedule(f"gwmp-{i}", "llama-3-8b", 200, 20, "standard") for i in range(32))
            )
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = s_grpc.SchedulerServiceStub(ch)
                by = {
                    (
                        await stub.GetRouteRecord(s.GetRouteRecordRequest(request_id=p.request_id))
                    ).record.scheduler_id
                    for p in plans
                }
            assert by == {"multi-0", "multi-1"}, by
        finally:
            await cp.close()
        # a process that dies is started again, on the same port and metrics port
        os.kill(kids[0], signal.SIGKILL)
        await asyncio.to_thread(
            wait_for,
            lambda: len(children(sup.pid)) == 2 and kids[0] not in children(sup.pid),
            20,
            "the killed process replaced",
        )
        await asyncio.to_thread(
            wait_for,
            lambda: metrics_hold(metrics) and metrics_hold(metrics + 1),
            20,
            "metrics back",
        )
        kids = children(sup.pid)
        # SIGTERM to the supervisor: every process stops, the port is free again
        sup.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(sup.wait, 20) == 0
        assert not [pid for pid in kids if alive(pid)]  # reaped by the supervisor
        with socket.socket() as sock:  # no process listens on it (TIME_WAIT may remain)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
    finally:
        if sup.poll() is None:
            await asyncio.to_thread(stop, sup)


def test_more_than_one_process_needs_a_fixed_port() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hpd_scheduler", "--processes", "2", "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "processes" in out.stderr and "fixed --port" in out.stderr, out.stderr


def test_hpd_up_runs_scheduler_processes_that_open_sessions_with_its_tokens(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """`hpd up --auth --scheduler-processes 2`: the child process reaches the registry and
    the broker with the services' token (its transfer plans have KV sessions), and stops
    with hpd up."""
    from hetero_pd.v1 import registry_pb2 as r
    from hetero_pd.v1 import registry_pb2_grpc as r_grpc
    from hpd_common.channels import CallIdentity, sync_channel
    from hpd_tools.embedded_redis import free_port as free
    from tests.support.fleet import capability

    hpd = Path(sys.executable).parent / "hpd"
    ports = [free(), free(), free()]
    proc = subprocess.Popen(
        [
            str(hpd), "up", "--auth", "--state-dir", str(tmp_path), "--metrics-port", "0",
            "--redis-url", redis_server.url, "--registry-port", str(ports[0]),
            "--scheduler-port", str(ports[1]), "--kvbroker-port", str(ports[2]),
            "--scheduler-processes", "2", "--log-level", "warning",
        ],
        stdout=(tmp_path / "up.log").open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        addrs = [f"127.0.0.1:{p}" for p in ports]
        wait_serving(addrs, proc, 60)
        kids = children(proc.pid)
        assert len(kids) == 1, kids  # process 0 is hpd up's own

        def token(role: str) -> str:
            out = subprocess.run(
                [str(hpd), "token", role, "--state-dir", str(tmp_path)],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            return out.stdout.strip()

        worker = CallIdentity(token=token("worker"))
        with sync_channel(addrs[0], worker) as ch:
            reg = r_grpc.RegistryServiceStub(ch)
            for wid, stages in (("mp-p", (c.STAGE_PREFILL,)), ("mp-d", (c.STAGE_DECODE,))):
                got = reg.RegisterWorker(
                    r.RegisterWorkerRequest(
                        capability=capability(wid, pool_id=f"pool-{wid}", stages=stages,
                                              kv_gib=40),
                        lease_ttl_ms=60_000,
                    ),
                    timeout=5,
                )  # fmt: skip
                reg.Heartbeat(
                    r.HeartbeatRequest(worker_id=wid, credential=got.credential, load=load()),
                    timeout=5,
                )
        gateway = CallIdentity(token=token("gateway"))
        seen: dict[str, int] = {}
        transfers: set[str] = set()  # processes that opened a KV session at the broker
        for i in range(24):
            with sync_channel(addrs[1], gateway, [("grpc.use_local_subchannel_pool", 1)]) as ch:
                stub = s_grpc.SchedulerServiceStub(ch)
                # until this process's view holds both workers
                plan = schedule_when_ready(stub, sched(f"up-{i}", prompt=4000, output=20))
                rec = stub.GetRouteRecord(s.GetRouteRecordRequest(request_id=f"up-{i}")).record
                seen[rec.scheduler_id] = seen.get(rec.scheduler_id, 0) + 1
                if plan.plan.mode == s.EXECUTION_MODE_TRANSFER:
                    assert plan.plan.kv_session_id, (rec.scheduler_id, plan.plan)
                    transfers.add(rec.scheduler_id)
                else:
                    assert not plan.plan.kv_session_id
        assert len(seen) == 2, seen
        assert transfers == set(seen), (transfers, seen)
        # hpd up starts a child that died again
        os.kill(kids[0], signal.SIGKILL)
        wait_for(
            lambda: len(children(proc.pid)) == 1 and kids[0] not in children(proc.pid),
            20,
            "hpd up's scheduler child replaced",
        )
        kids = children(proc.pid)
    finally:
        stop(proc)
    assert not [pid for pid in kids if alive(pid)]
