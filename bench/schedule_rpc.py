"""`Schedule` over gRPC against a real registry and a real Redis, beside two baselines.

For fleets of 16, 256 and 4,096 workers (registered through the registry, a mix of
prefill, decode and both-stage pools with load reports), at concurrency 1 and 16, it
measures the p50 / p99 latency and throughput of:

* (E)   DiagnosticsService.Echo on the scheduler's own server: the transport alone;
* (E+R) DiagnosticsService.EchoRedis on the same server: transport + one EVALSHA;
* (S)   SchedulerService.Schedule: transport + planning + one EVALSHA (reservation,
        record head and idempotency key in one script).

All three are taken in the same run, against the same server and Redis. Targets: at 256
workers, Schedule p50 <= 1.25 x (E+R) p50 and throughput at concurrency 16 >= 0.8 x (E+R);
at 4,096 workers p50 within 1.5 x (E+R).

The servers (registry + scheduler, one asyncio process, as `hpd up` runs them) run in a
child process; this process is the client. Nothing reports outcomes: reservations lapse
after `RESERVATION_TTL_MS`, standing in for the releases a gateway would send. Every worker
sends a fresh load report before each timed `Schedule` phase. Redis is a private
redis-server on a free port.

    python bench/schedule_rpc.py [--quick] [--json] [--floor]

``--floor`` measures what the targets are up against: the server plans the first request
only and answers every later one with that plan (same reservation script, same record head
written, same reply), without planning or explanations. What remains is the RPC's own cost
beyond (E+R): the request and reply conversions, the larger messages, and the
reservation script with its arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import diagnostics_pb2 as d
from hetero_pd.v1 import diagnostics_pb2_grpc as d_grpc
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc

SIZES = (16, 256, 4096)
RESERVATION_TTL_MS = 2_000
"""The bench sends no ReportOutcome: reservations lapse after this instead (the reserve
script purges them), so the fleet reaches a steady state rather than filling up; with the
default 120 s, a full run's requests would fill the decode workers."""
CONCURRENCY = (1, 16)
SHAPES = (
    ("h100-prefill", (c.STAGE_PREFILL,), "H100-SXM", c.KV_LAYOUT_PAGED_NHD),
    ("h200-decode", (c.STAGE_DECODE,), "H200", c.KV_LAYOUT_PAGED_NHD),
    ("l40s-decode", (c.STAGE_DECODE,), "L40S", c.KV_LAYOUT_PAGED_HND),
    ("h100-both", (c.STAGE_PREFILL, c.STAGE_DECODE), "H100-SXM", c.KV_LAYOUT_PAGED_NHD),
)


# -- server side (child process) -------------------------------------------------------------


def plan_once() -> None:
    """``--floor``: `SchedulerService.schedule` plans its first request, then reserves and
    records that same plan (under each request's id) for every later one."""
    from hpd_scheduler import service as svc
    from hpd_scheduler.store import ReservationAsk

    planned = svc.SchedulerService.schedule
    first: dict[str, Any] = {}

    async def schedule(self: svc.SchedulerService, req: Any) -> svc.ScheduleResult:
        if not first:
            out = await planned(self, req)
            first.update(out.head)
            return out
        head = {**first, "request_id": req.request_id}
        plan = head["plan"]
        ask = ReservationAsk(
            plan["decode_worker_id"], plan["reserved_kv_bytes"], 2**62, -1,
            plan["prefill_worker_id"], plan["prefill_tokens"],
        )  # fmt: skip
        st = self.settings
        await self.store.reserve_and_record(
            req.request_id, head, head["decision"], ask, self.clock.now_ms(),
            st.reservation_ttl_ms, st.record_ttl_ms, st.record_index_cap,
        )  # fmt: skip
        return svc.ScheduleResult(head, False)

    svc.SchedulerService.schedule = schedule  # type: ignore[method-assign]


async def serve(redis_url: str, prefix: str, floor: bool = False) -> None:
    if floor:
        plan_once()
    from hpd_common import native, redis_conn
    from hpd_common.logging import configure_logging
    from hpd_common.server import run_until_signal
    from hpd_registry.__main__ import build_server as build_registry
    from hpd_registry.service import RegistrySettings
    from hpd_scheduler.__main__ import build_server as build_scheduler
    from hpd_scheduler.service import SchedulerSettings

    configure_logging("warning", json_logs=False)
    client = redis_conn.connect(redis_url)
    reg = build_registry(
        RegistrySettings(port=0, redis_url=redis_url, key_prefix=prefix, lease_ttl_ms=300_000),
        client,
    )
    await reg.start()
    sch = build_scheduler(
        SchedulerSettings(
            port=0,
            redis_url=redis_url,
            key_prefix=prefix,
            registry_target=f"127.0.0.1:{reg.port}",
            directive_interval_ms=0,
            reservation_ttl_ms=RESERVATION_TTL_MS,
            log_level="warning",
        ),
        client,
    )

    async def started() -> None:
        ports = {"registry": reg.port, "scheduler": sch.port}
        print(json.dumps({**ports, "compiled_modules": native.status().active}), flush=True)

    try:
        await run_until_signal([sch], on_started=started)
    finally:
        await reg.stop(0)


# -- client side ----------------------------------------------------------------------------


def capability(i: int) -> c.WorkerCapability:
    pool_no = i // 8
    name, stages, gpu, layout = SHAPES[pool_no % len(SHAPES)]
    wid = f"w{i:05d}"
    return c.WorkerCapability(
        worker_id=wid,
        pool_id=f"{name}-{pool_no}",
        endpoint=f"{wid}.local:8000",
        stages=list(stages),
        model_id="llama-3-8b",
        model_revision="rev-a",
        engine="vllm",
        engine_version="0.9.0",
        gpu_type=gpu,
        gpu_count=1,
        tp_size=1,
        pp_size=1,
        kv_memory_total_bytes=4096 * 2**30,  # ample: the run takes reservations, no outcomes
        max_batch_size=256,
        kv_format=c.KvFormat(
            dtype=c.KV_DTYPE_BF16,
            layout=layout,
            block_size_tokens=16,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            tp_size=1,
            attention_backend="flash_attn",
            model_revision="rev-a",
        ),
        network=c.NetworkLocation(
            zone=f"z{pool_no % 2}", rack=f"r{pool_no}", host=wid, nic_gbps=200
        ),
    )


def load_report(i: int) -> c.LoadReport:
    return c.LoadReport(
        gpu_util=0.4, memory_util=0.3, kv_blocks_free=700 + (i * 37) % 300,
        kv_blocks_total=1000, queue_depth=(i * 7) % 12, queue_max=0,
        batch_size=(i * 11) % 64, itl_p50_ms=20.0, itl_p99_ms=35.0,
    )  # fmt: skip


async def register_fleet(target: str, n: int) -> dict[str, tuple[int, str]]:
    """Registers the fleet with one load report each; returns each worker's (number,
    credential)."""
    creds: dict[str, tuple[int, str]] = {}
    async with grpc.aio.insecure_channel(target) as ch:
        stub = r_grpc.RegistryServiceStub(ch)
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            async with sem:
                reg = await stub.RegisterWorker(
                    r.RegisterWorkerRequest(capability=capability(i), lease_ttl_ms=300_000)
                )
                creds[reg.worker_id] = (i, reg.credential)

        await asyncio.gather(*(one(i) for i in range(n)))
    await report_loads(target, creds)
    return creds


async def report_loads(target: str, creds: dict[str, tuple[int, str]]) -> None:
    """A fresh load report from every worker. The scheduler trusts a report fully for 2 s
    and not at all after 10 s, so the bench sends one before each timed `Schedule` phase
    (outside its timing) instead of heartbeating through it."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = r_grpc.RegistryServiceStub(ch)
        sem = asyncio.Semaphore(32)

        async def one(i: int, wid: str, cred: str) -> None:
            async with sem:
                await stub.Heartbeat(
                    r.HeartbeatRequest(worker_id=wid, credential=cred, load=load_report(i))
                )

        await asyncio.gather(*(one(i, w, cr) for w, (i, cr) in creds.items()))


async def measure(
    call: Callable[[int], Awaitable[Any]], total: int, concurrency: int
) -> dict[str, float]:
    lat: list[float] = []
    counter = iter(range(total))

    async def worker() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await call(i)
            lat.append(time.perf_counter() - t0)

    for i in range(min(50, total)):  # warm-up (not counted)
        await call(-1 - i)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    lat.sort()
    return {
        "p50_us": lat[len(lat) // 2] * 1e6,
        "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
        "per_s": len(lat) / wall,
    }


async def bench_size(redis_url: str, n: int, total: int, floor: bool) -> dict[str, Any]:
    prefix = f"bench{n}x{os.getpid()}"
    here = Path(__file__).resolve()  # noqa: ASYNC240
    child = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, str(here), "--serve", redis_url, prefix, *(["--floor"] if floor else [])],
        stdout=subprocess.PIPE,
        env={**os.environ},
    )
    assert child.stdout is not None
    line = await asyncio.to_thread(child.stdout.readline)
    ports = json.loads(line)
    try:
        registry = f"127.0.0.1:{ports['registry']}"
        creds = await register_fleet(registry, n)
        target = f"127.0.0.1:{ports['scheduler']}"
        async with grpc.aio.insecure_channel(target) as ch:
            sched = s_grpc.SchedulerServiceStub(ch)
            diag = d_grpc.DiagnosticsServiceStub(ch)
            deadline = time.monotonic() + 60
            while True:  # until the view holds the fleet (a decode-heavy plan succeeds)
                try:
                    await sched.Schedule(
                        s.ScheduleRequest(request_id=f"probe-{time.monotonic_ns()}",
                                          model_id="llama-3-8b", prompt_tokens=100,
                                          expected_output_tokens=10),
                        timeout=5,
                    )  # fmt: skip
                    recs = await sched.GetRecommendations(s.GetRecommendationsRequest())
                    decode = sum(1 for i in range(n) if (i // 8) % len(SHAPES) != 0)
                    if len([w for w in recs.workers if w.load >= 0]) >= decode:
                        break
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the scheduler never saw the fleet")
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # one more rebuild after the last load reports
            payload = b"x" * 64
            out: dict[str, Any] = {"workers": n, "compiled_modules": ports["compiled_modules"]}
            for conc in CONCURRENCY:
                run = f"c{conc}"

                async def echo(i: int) -> Any:
                    return await diag.Echo(d.EchoRequest(payload=payload))

                async def echo_redis(i: int) -> Any:
                    return await diag.EchoRedis(d.EchoRequest(payload=payload))

                async def schedule(i: int, run: str = run) -> Any:
                    return await sched.Schedule(
                        s.ScheduleRequest(
                            request_id=f"{run}-{i}", model_id="llama-3-8b",
                            prompt_tokens=600 + (i * 131) % 3000,
                            expected_output_tokens=50 + (i * 17) % 500,
                        )
                    )  # fmt: skip

                out[f"echo_{run}"] = await measure(echo, total, conc)
                out[f"echo_redis_{run}"] = await measure(echo_redis, total, conc)
                await report_loads(registry, creds)
                await asyncio.sleep(0.5)  # the scheduler's next rebuild takes them in
                out[f"schedule_{run}"] = await measure(schedule, total, conc)
            return out
    finally:
        child.terminate()
        await asyncio.to_thread(child.wait, 15)


async def main_async(quick: bool, floor: bool) -> dict[str, Any]:
    from hpd_common.embedded_redis import EmbeddedRedis

    total = 1500 if quick else 4000
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), persist=False) as red:
        for n in SIZES:
            results[str(n)] = await bench_size(red.url, n, total, floor)
    r256, r4096 = results["256"], results["4096"]
    summary = {
        "p50_vs_echo_redis_256": r256["schedule_c1"]["p50_us"] / r256["echo_redis_c1"]["p50_us"],
        "throughput_vs_echo_redis_256_c16": r256["schedule_c16"]["per_s"]
        / r256["echo_redis_c16"]["per_s"],
        "p50_vs_echo_redis_4096": r4096["schedule_c1"]["p50_us"] / r4096["echo_redis_c1"]["p50_us"],
    }
    compiled = all(r["compiled_modules"] for r in results.values())
    return {
        **summary,
        "floor": floor,
        "compiled_modules": compiled,
        "requests_per_run": total,
        "sizes": results,
    }


def main() -> int:
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--serve":
        asyncio.run(serve(sys.argv[2], sys.argv[3], floor=sys.argv[4:] == ["--floor"]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (under a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--floor",
        action="store_true",
        help="plan the first request only and replay its plan (the RPC's cost without planning)",
    )
    args = p.parse_args()
    out = asyncio.run(main_async(args.quick, args.floor))
    if args.json:
        print(json.dumps(out))
        return 0
    for n, res in out["sizes"].items():
        print(f"fleet {n} workers")
        for key in ("echo", "echo_redis", "schedule"):
            for conc in CONCURRENCY:
                m = res[f"{key}_c{conc}"]
                print(
                    f"  {key:<11} c={conc:<3} p50 {m['p50_us']:8.0f} us   p99 {m['p99_us']:8.0f} us"
                    f"   {m['per_s']:8.0f} /s"
                )
    print(f"p50 vs E+R at 256:               {out['p50_vs_echo_redis_256']:.2f}  (target <= 1.25)")
    print(
        f"throughput vs E+R at 256, c16:   {out['throughput_vs_echo_redis_256_c16']:.2f}"
        "  (target >= 0.8)"
    )
    print(f"p50 vs E+R at 4096:              {out['p50_vs_echo_redis_4096']:.2f}  (target <= 1.5)")
    print(f"compiled policy core:            {out['compiled_modules']}  (hpd native status)")
    if out["floor"]:
        print("(--floor: planned once, that plan replayed: the RPC without planning)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
