"""Registry heartbeat throughput: streamed load reports vs a unary echo baseline.

Starts a private redis-server and a registry process, then a separate load-generator
process that (1) measures unary DiagnosticsService/Echo calls per second against the
same registry (the baseline), and (2) registers N emulated workers and streams load
reports from all of them (StreamHeartbeats), measuring sustained reports per second.
Meanwhile this process watches WatchWorkers and measures report-to-visible latency:
each report carries its send time (reported_at_unix_ms) and the LOAD event's arrival
is compared with it. Latency is reported twice: under saturation (queueing delay of a
flood, the throughput phase) and in a paced phase (every worker reporting --rate-hz
times a second, the steady state a fleet runs in), which is the figure that matters.

    python bench/registry_heartbeats.py [--quick] [--json] [--workers 1000] [--seconds 10]

Target (issue: registry): reports/s >= 2 x echo calls/s; printed as
`reports_per_s_vs_echo`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetero_pd.v1 import diagnostics_pb2 as d  # noqa: E402
from hetero_pd.v1 import diagnostics_pb2_grpc as d_grpc  # noqa: E402
from hetero_pd.v1 import registry_pb2 as r  # noqa: E402
from hetero_pd.v1 import registry_pb2_grpc as r_grpc  # noqa: E402
from hpd_tools.embedded_redis import EmbeddedRedis, free_port  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- load generator (child process) ---------------------------------------------------------


async def echo_phase(target: str, seconds: float, concurrency: int) -> float:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = d_grpc.DiagnosticsServiceStub(ch)
        req = d.EchoRequest(payload=b"x" * 64)
        count = 0
        stop = time.monotonic() + seconds

        async def loop() -> None:
            nonlocal count
            while time.monotonic() < stop:
                await stub.Echo(req, timeout=10)
                count += 1

        start = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return count / (time.monotonic() - start)


async def stream_phase(
    target: str, workers: int, seconds: float, prefix: str, rate_hz: float
) -> dict[str, Any]:
    """rate_hz 0: every worker sends as fast as the server takes reports (throughput);
    rate_hz > 0: each worker sends that many reports per second (latency at a steady load)."""
    from tests.support.fleet import capability, load

    channels = [grpc.aio.insecure_channel(target) for _ in range(4)]
    stubs = [r_grpc.RegistryServiceStub(ch) for ch in channels]
    creds: dict[str, str] = {}
    ids = [f"{prefix}-{i:05d}" for i in range(workers)]
    sem = asyncio.Semaphore(64)

    async def reg(i: int, wid: str) -> None:
        async with sem:
            resp = await stubs[i % 4].RegisterWorker(
                r.RegisterWorkerRequest(capability=capability(wid), lease_ttl_ms=120_000),
                timeout=30,
            )
            creds[wid] = resp.credential

    await asyncio.gather(*(reg(i, w) for i, w in enumerate(ids)))
    sent = 0
    stop_at = time.monotonic() + seconds
    started = asyncio.Event()

    async def one(i: int, wid: str) -> None:
        nonlocal sent
        call = stubs[i % 4].StreamHeartbeats()
        await call.write(r.StreamHeartbeatsRequest(worker_id=wid, credential=creds[wid]))
        await call.read()  # the lease ack
        await started.wait()
        if rate_hz:
            await asyncio.sleep((i / workers) / rate_hz)  # spread the workers over a period
        q = 0
        while time.monotonic() < stop_at:
            if rate_hz:
                await asyncio.sleep(1 / rate_hz)
            q += 1
            rep = load(queue=q % 50)
            rep.reported_at_unix_ms = time.time_ns() // 1_000_000
            await call.write(r.StreamHeartbeatsRequest(load=rep))
            sent += 1
            if q % 8 == 0:
                await asyncio.sleep(0)
        await call.done_writing()
        await call.code()  # the server has processed (committed) everything this stream sent

    tasks = [asyncio.create_task(one(i, w)) for i, w in enumerate(ids)]
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    t0_wall = time.time()
    started.set()
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - t0
    for ch in channels:
        await ch.close()
    return {"sent": sent, "elapsed_s": elapsed, "t0_wall": t0_wall}


def loadgen(args: argparse.Namespace) -> None:
    async def run() -> dict[str, Any]:
        if args.phase == "echo":
            return {"echo_per_s": await echo_phase(args.target, args.seconds, args.concurrency)}
        return await stream_phase(
            args.target, args.workers, args.seconds, args.prefix, args.rate_hz
        )

    print(json.dumps(asyncio.run(run())), flush=True)


# -- orchestrator ---------------------------------------------------------------------------


async def watch_latency(target: str, stop: asyncio.Event) -> dict[str, Any]:
    lat: list[float] = []
    count = 0.0
    first = last = 0.0
    async with grpc.aio.insecure_channel(target) as ch:
        stub = r_grpc.RegistryServiceStub(ch)
        call = stub.WatchWorkers(r.WatchWorkersRequest())
        reader = asyncio.ensure_future(_drain(call, lat))
        await stop.wait()
        call.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        count, first, last = (
            reader_stats.get("count", 0),
            reader_stats.get("first", 0.0),
            reader_stats.get("last", 0.0),
        )
    return {"latencies_ms": lat, "events": count, "span_s": max(1e-9, last - first)}


reader_stats: dict[str, float] = {}


async def _drain(call: Any, lat: list[float]) -> None:
    async for msg in call:
        now_ms = time.time_ns() / 1e6
        for ev in msg.events:
            if ev.type == r.WATCH_EVENT_TYPE_LOAD:
                lat.append(now_ms - ev.worker.load.reported_at_unix_ms)
                reader_stats["count"] = reader_stats.get("count", 0) + 1
                t = time.monotonic()
                reader_stats.setdefault("first", t)
                reader_stats["last"] = t


def run_child(script_args: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--loadgen", *script_args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# size: a benchmark's procedure, read top to bottom (bench/README.md)
async def orchestrate(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), persist=False) as redis:
        port = free_port()
        env = {
            **os.environ,
            "HPD_REDIS_URL": redis.url,
            "HPD_PORT": str(port),
            "HPD_LOG_LEVEL": "warning",
            "HPD_LEASE_TTL_MS": "120000",
        }
        reg = subprocess.Popen([sys.executable, "-m", "hpd_registry"], env=env, cwd=ROOT)  # noqa: ASYNC220
        target = f"127.0.0.1:{port}"
        try:
            await _wait_up(target)
            progress(args, "echo baseline")
            echo = await asyncio.to_thread(
                run_child,
                [
                    "--phase",
                    "echo",
                    "--target",
                    target,
                    "--seconds",
                    str(args.seconds),
                    "--concurrency",
                    str(args.concurrency),
                ],
            )
            progress(args, f"streaming reports from {args.workers} workers")
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_latency(target, stop))
            await asyncio.sleep(0.3)
            rev0 = await _revision(target)
            streamed = await asyncio.to_thread(
                run_child,
                [
                    "--phase",
                    "stream",
                    "--target",
                    target,
                    "--seconds",
                    str(args.seconds),
                    "--workers",
                    str(args.workers),
                    "--prefix",
                    "bench",
                    "--rate-hz",
                    "0",
                ],
            )
            rev1, t_end = await _settled_revision(target)
            await asyncio.sleep(0.3)
            stop.set()
            seen = await watcher
            progress(args, f"paced: {args.workers} workers x {args.rate_hz} reports/s")
            reader_stats.clear()
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch_latency(target, stop))
            await asyncio.sleep(0.3)
            paced = await asyncio.to_thread(
                run_child,
                [
                    "--phase",
                    "stream",
                    "--target",
                    target,
                    "--seconds",
                    str(args.seconds),
                    "--workers",
                    str(args.workers),
                    "--prefix",
                    "paced",
                    "--rate-hz",
                    str(args.rate_hz),
                ],
            )
            await _settled_revision(target)
            stop.set()
            paced_seen = await watcher
        finally:
            reg.terminate()
            reg.wait(timeout=10)
    committed = rev1 - rev0 - args.workers  # each registration is one revision too
    reports_per_s = committed / (t_end - streamed["t0_wall"])
    lat = seen["latencies_ms"]
    plat = paced_seen["latencies_ms"]
    return {
        "workers": args.workers,
        "seconds": args.seconds,
        "echo_calls_per_s": round(echo["echo_per_s"], 1),
        "echo_concurrency": args.concurrency,
        "reports_sent": streamed["sent"],
        "reports_committed": committed,
        "reports_per_s": round(reports_per_s, 1),
        "reports_visible_on_watch": seen["events"],
        "saturated_report_to_watch_p50_ms": round(percentile(lat, 0.5), 2),
        "saturated_report_to_watch_p99_ms": round(percentile(lat, 0.99), 2),
        "paced_reports_per_s": round(paced["sent"] / paced["elapsed_s"], 1),
        "paced_reports_visible_on_watch": paced_seen["events"],
        "report_to_watch_p50_ms": round(percentile(plat, 0.5), 2),
        "report_to_watch_p99_ms": round(percentile(plat, 0.99), 2),
        "report_to_watch_mean_ms": round(statistics.fmean(plat), 2) if plat else None,
        "reports_per_s_vs_echo": round(reports_per_s / echo["echo_per_s"], 3),
        "target_reports_per_s_vs_echo": 2.0,
    }


async def _revision(target: str) -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await r_grpc.RegistryServiceStub(ch).ListWorkers(
            r.ListWorkersRequest(page_size=1), timeout=10
        )
        return int(resp.revision)


async def _settled_revision(target: str) -> tuple[int, float]:
    """The revision once it stops moving (every sent report committed), and when it last moved."""
    last, when = await _revision(target), time.time()
    while True:
        await asyncio.sleep(0.2)
        rev = await _revision(target)
        if rev == last:
            return last, when
        last, when = rev, time.time()


async def _wait_up(target: str) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(300):
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("registry did not start")


def progress(args: argparse.Namespace, what: str) -> None:
    if not args.json:
        print(f"... {what}", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short phases (about 20 s in all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    p.add_argument("--concurrency", type=int, default=64, help="echo calls in flight")
    p.add_argument(
        "--rate-hz",
        type=float,
        default=2.0,
        help="reports per second per worker in the paced (latency) phase",
    )
    p.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default="", help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    p.add_argument("--prefix", default="bench", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.loadgen:
        loadgen(args)
        return
    if args.quick:
        args.seconds = min(args.seconds, 4.0)
    result = asyncio.run(orchestrate(args))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32} {v}")


if __name__ == "__main__":
    main()
