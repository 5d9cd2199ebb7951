"""A Sentinel failover under load, shared by its test and its benchmark.

Real processes throughout: a primary and a replica `redis-server`, a `redis-server
--sentinel`, and `hpd up --redis-url redis+sentinel://...?wait_replicas=1`. Three workers
register and keep heartbeating; clients send `Schedule` calls without pause (a gateway's
behaviour: an UNAVAILABLE is retried with the same request id), each pausing ``pace_s``
between requests, and report an outcome for
every other plan. The primary is SIGKILLed mid-run; the sentinel promotes the replica. Then
everything that was acknowledged is read back: each worker still holds the registration
it was given, each acknowledged plan has its route record (and its reported outcome), each
KV session a plan named exists, and every request that was sent got a plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import kvbroker_pb2_grpc as k_grpc
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_scheduler.keys import SchedulerKeys
from hpd_tools.embedded_redis import EmbeddedRedis, EmbeddedSentinel, free_port
from tests.support.fleet import capability, load
from tests.support.processes import stop, wait_serving
from tests.support.replication import plain, start_pair, wait_synced

HPD = Path(sys.executable).parent / "hpd"
RETRY = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # saturated: a gateway queues and tries again
)
WORKERS = (
    ("fo-p1", "fo-prefill", c.STAGE_PREFILL),
    ("fo-d1", "fo-decode", c.STAGE_DECODE),
    ("fo-d2", "fo-decode", c.STAGE_DECODE),
)


@dataclass
class FailoverResult:
    sent: int = 0
    acked: dict[str, s.RoutePlan] = field(default_factory=dict)
    outcomes_acked: set[str] = field(default_factory=set)
    retries: int = 0
    unavailable_after_kill: int = 0  # calls refused UNAVAILABLE once the primary was killed
    errors: list[str] = field(default_factory=list)  # answers that were not retryable
    kill_at: float = 0.0
    first_ack_after_kill: float = 0.0
    promoted_at: float = 0.0  # when the sentinel first named the replica as the primary
    heartbeat_failures: int = 0
    lost_registrations: list[str] = field(default_factory=list)
    missing_records: list[str] = field(default_factory=list)
    missing_outcomes: list[str] = field(default_factory=list)
    missing_sessions: list[str] = field(default_factory=list)
    missing_reservations: list[str] = field(default_factory=list)  # held, not found
    unreleased: list[str] = field(default_factory=list)  # released, still held
    promoted: bool = False
    degraded_logs: int = 0  # warnings that writes were acknowledged unreplicated

    @property
    def serve_again_s(self) -> float:
        return self.first_ack_after_kill - self.kill_at if self.first_ack_after_kill else -1.0

    @property
    def promotion_s(self) -> float:
        """Sentinel's own part: from the kill until the sentinel names the replica as the
        primary, which is the earliest any Sentinel client can find it (the baseline)."""
        return self.promoted_at - self.kill_at if self.promoted_at else -1.0

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "acked": len(self.acked),
            "outcomes_acked": len(self.outcomes_acked),
            "retries": self.retries,
            "unavailable_after_kill": self.unavailable_after_kill,
            "errors": len(self.errors),
            "time_to_serve_again_s": round(self.serve_again_s, 3),
            "sentinel_promotion_s": round(self.promotion_s, 3),
            "lost_registrations": len(self.lost_registrations),
            "missing_records": len(self.missing_records),
            "missing_outcomes": len(self.missing_outcomes),
            "missing_sessions": len(self.missing_sessions),
            "missing_reservations": len(self.missing_reservations),
            "unreleased": len(self.unreleased),
            "promoted": self.promoted,
            "degraded_logs": self.degraded_logs,
        }


async def _retrying(call: Any, request: Any, result: FailoverResult, until: float) -> Any:
    """``call(request)`` until it answers or ``until`` passes; UNAVAILABLE and deadline
    answers are retried (the same request: every call here is idempotent)."""
    while True:
        try:
            return await call(request, timeout=2)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRY or time.monotonic() > until:
                raise
            result.retries += 1
            if result.kill_at and exc.code() == grpc.StatusCode.UNAVAILABLE:
                result.unavailable_after_kill += 1
            await asyncio.sleep(0.05)


async def run_failover(
    tmp: Path,
    *,
    seconds: float = 8.0,
    kill_at_s: float = 3.0,
    concurrency: int = 8,
    pace_s: float = 0.02,
) -> FailoverResult:
    """Runs the scenario in ``tmp`` and returns what it saw (see the module docstring)."""
    primary, replica = start_pair(tmp, persist=True)
    sentinel = EmbeddedSentinel(tmp / "sentinel", primary.port, down_after_ms=500).start()
    ports = [free_port() for _ in range(3)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    log = (tmp / "up.log").open("ab")
    proc: subprocess.Popen[bytes] | None = None
    result = FailoverResult()
    try:
        await wait_synced(primary.port, replica.port)
        url = f"{sentinel.url}?wait_replicas=1&wait_timeout_ms=250"
        proc = await asyncio.to_thread(_start_up, url, ports, log)
        await asyncio.to_thread(wait_serving, addrs, proc, 60)
        await _drive(
            addrs, primary, replica, sentinel.port, result, seconds, kill_at_s, concurrency, pace_s
        )
    finally:
        if proc is not None:
            stop(proc)
        log.close()
        with contextlib.suppress(OSError):
            log_text = (tmp / "up.log").read_text()
            result.degraded_logs = log_text.count("redis_write_unreplicated")
        for server in (sentinel, replica, primary):
            server.stop()
    return result


# size: the failover scenario's driver, its phases in the order they happen
async def _drive(
    addrs: list[str],
    primary: EmbeddedRedis,
    replica: EmbeddedRedis,
    sentinel_port: int,
    result: FailoverResult,
    seconds: float,
    kill_at_s: float,
    concurrency: int,
    pace_s: float,
) -> None:
    async with (
        grpc.aio.insecure_channel(addrs[0]) as reg_ch,
        grpc.aio.insecure_channel(addrs[1]) as sch_ch,
        grpc.aio.insecure_channel(addrs[2]) as kvb_ch,
    ):
        reg = r_grpc.RegistryServiceStub(reg_ch)
        sched = s_grpc.SchedulerServiceStub(sch_ch)
        broker = k_grpc.KvBrokerServiceStub(kvb_ch)
        start = time.monotonic()
        end = start + seconds
        grace = end + 30  # retries of calls sent before the end may run past it
        creds: dict[str, str] = {}
        for wid, pool, stage in WORKERS:
            reply = await _retrying(
                reg.RegisterWorker,
                r.RegisterWorkerRequest(capability=capability(wid, pool_id=pool, stages=(stage,))),
                result,
                grace,
            )
            creds[wid] = reply.credential

        done = asyncio.Event()

        async def heartbeats() -> None:
            while not done.is_set():
                for wid, cred in creds.items():
                    try:
                        await reg.Heartbeat(
                            r.HeartbeatRequest(worker_id=wid, credential=cred, load=load()),
                            timeout=1,
                        )
                    except grpc.aio.AioRpcError as exc:
                        result.heartbeat_failures += 1
                        if exc.code() not in RETRY:
                            result.errors.append(f"heartbeat {wid}: {exc.code().name}")
                await asyncio.sleep(0.2)

        # the first plan needs the scheduler's view of the fleet: wait for it
        while True:
            try:
                await sched.Schedule(_request("fo-warm"), timeout=2)
                break
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > start + 30:
                    raise
                if exc.code() not in (*RETRY, grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                await asyncio.sleep(0.1)

        counter = iter(range(10**9))

        async def client() -> None:
            while time.monotonic() < end:
                rid = f"fo-{next(counter)}"
                sent_at = time.monotonic()
                result.sent += 1
                try:
                    reply = await _retrying(sched.Schedule, _request(rid), result, grace)
                except grpc.aio.AioRpcError as exc:
                    result.errors.append(f"schedule {rid}: {exc.code().name} {exc.details()}")
                    continue
                result.acked[rid] = reply.plan
                if result.kill_at and sent_at > result.kill_at and not result.first_ack_after_kill:
                    result.first_ack_after_kill = time.monotonic()
                if int(rid[3:]) % 50 != 49:  # one in 50 keeps its reservation
                    outcome = s.ReportOutcomeRequest(
                        request_id=rid, success=True, ttft_ms=100.0, tpot_ms=20.0,
                        mode_used=reply.plan.mode, output_tokens=40,
                    )  # fmt: skip
                    try:
                        await _retrying(sched.ReportOutcome, outcome, result, grace)
                        result.outcomes_acked.add(rid)
                    except grpc.aio.AioRpcError as exc:
                        result.errors.append(f"outcome {rid}: {exc.code().name}")
                await asyncio.sleep(pace_s)

        async def killer() -> None:
            await asyncio.sleep(max(0.0, start + kill_at_s - time.monotonic()))
            result.kill_at = time.monotonic()
            primary.kill()
            async with plain(sentinel_port) as watch:
                while time.monotonic() < grace:
                    addr = await watch.execute_command("SENTINEL", "get-master-addr-by-name", "hpd")
                    if addr and int(addr[1]) == replica.port:
                        result.promoted_at = time.monotonic()
                        return
                    await asyncio.sleep(0.01)

        beating = asyncio.create_task(heartbeats())
        await asyncio.gather(killer(), *(client() for _ in range(concurrency)))
        try:
            await _read_back(reg, sched, broker, creds, result, grace)
        finally:
            done.set()
            await beating
        result.promoted = await _promoted(replica.port)
        await _reservations(replica.port, result)


def _start_up(url: str, ports: list[int], log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            str(HPD), "up", "--redis-url", url, "--metrics-port", "0",
            "--registry-port", str(ports[0]), "--scheduler-port", str(ports[1]),
            "--kvbroker-port", str(ports[2]),
        ],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HPD_JSON_LOGS": "0"},
    )  # fmt: skip


def _request(rid: str) -> s.ScheduleRequest:
    return s.ScheduleRequest(
        request_id=rid, model_id="llama-3-8b", prompt_tokens=800, expected_output_tokens=40
    )


async def _read_back(
    reg: r_grpc.RegistryServiceStub,
    sched: s_grpc.SchedulerServiceStub,
    broker: k_grpc.KvBrokerServiceStub,
    creds: dict[str, str],
    result: FailoverResult,
    until: float,
) -> None:
    for wid, cred in creds.items():
        try:
            await _retrying(
                reg.Heartbeat, r.HeartbeatRequest(worker_id=wid, credential=cred), result, until
            )
        except grpc.aio.AioRpcError as exc:
            result.lost_registrations.append(f"{wid}: {exc.code().name}")
    for rid, plan in result.acked.items():
        try:
            got = await _retrying(
                sched.GetRouteRecord, s.GetRouteRecordRequest(request_id=rid), result, until
            )
        except grpc.aio.AioRpcError as exc:
            result.missing_records.append(f"{rid}: {exc.code().name}")
            continue
        if got.record.plan.decode_worker_id != plan.decode_worker_id:
            result.missing_records.append(f"{rid}: another plan")
        if rid in result.outcomes_acked and not got.record.HasField("outcome"):
            result.missing_outcomes.append(rid)
        if plan.kv_session_id:
            try:
                await _retrying(
                    broker.GetSession,
                    k.GetSessionRequest(session_id=plan.kv_session_id),
                    result,
                    until,
                )
            except grpc.aio.AioRpcError as exc:
                result.missing_sessions.append(f"{rid}: {exc.code().name}")


async def _reservations(port: int, result: FailoverResult) -> None:
    """The scheduler's reservation table, read on the promoted replica (key names from
    `hpd_scheduler.keys`, default prefix): plans without an outcome still hold theirs,
    plans whose outcome was acknowledged do not."""
    async with plain(port) as client:
        held = {k.decode() for k in await client.hkeys(SchedulerKeys().reservations)}
    for rid, plan in result.acked.items():
        if plan.decision == s.ROUTE_DECISION_REJECT:
            continue
        if rid in result.outcomes_acked:
            if rid in held:
                result.unreleased.append(rid)
        elif rid not in held:
            result.missing_reservations.append(rid)


async def _promoted(replica_port: int) -> bool:
    async with plain(replica_port) as client:
        return bool((await client.info("replication")).get("role") == "master")


def log_tail(tmp: Path, chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return (tmp / "up.log").read_text()[-chars:]
    return ""
