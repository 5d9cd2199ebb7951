"""`Schedule` over gRPC against a real registry and a real Redis, beside two baselines.

For fleets of 16, 256 and 4,096 workers (registered through the registry, a mix of
prefill, decode and both-stage pools with load reports), it measures the p50 / p99 latency
and throughput of:

* (E)   DiagnosticsService.Echo on the scheduler's own server: the transport alone;
* (E+R) DiagnosticsService.EchoRedis on the same server: transport + one EVALSHA;
* (S)   SchedulerService.Schedule, unary, at concurrency 1 and 16: transport + planning +
        the reservation script (group-committed: the reservations of calls in flight
        together are one script call);
* (SS)  SchedulerService.ScheduleStream: one stream with 16 requests in flight.

At 256 workers, in the same run, a second server in ``floor`` mode answers Schedule without
planning (it plans the first request only and reserves and records that same plan under
every later request id: same conversions, same group-committed script, same reply, no
explanation): what remains is the RPC's own cost, and ``p50_vs_floor_256`` is what planning
adds to it. Then the scaling figure: ``hpd scheduler --processes 1`` and ``--processes 2``
on one port, driven by a client in this process over 8 connections, one ScheduleStream each
with 8 requests in flight: decisions per second.

`--json` fields with targets (issue "Schedule at gateway scale"):
``throughput_vs_echo_redis_256_c16`` (S c16 / E+R c16, >= 1.0),
``stream_throughput_vs_echo_redis_256_c16`` (SS / E+R c16, >= 1.5), ``p50_vs_floor_256``
(S c1 p50 / floor c1 p50, <= 1.10). Reported without targets: ``p50_vs_echo_redis_256``,
``p50_vs_echo_redis_4096``, ``decisions_per_s_processes`` and ``scaling_2_vs_1``.

The servers (registry + scheduler, one asyncio process, as `hpd up` runs them) run in a
child process; this process is the client. Nothing reports outcomes: reservations lapse
after `RESERVATION_TTL_MS`, standing in for the releases a gateway would send, and the
profile is the default one with admission off (a fleet of lapsing reservations is not one
whose overload should be refused: this benchmark measures the decision's cost). Every
worker sends a fresh load report before each timed `Schedule` phase. Redis is a private
redis-server on a free port.

    python bench/schedule_rpc.py [--quick] [--json] [--no-scaling]
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
from collections.abc import AsyncIterator, Awaitable, Callable
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

# size: a benchmark's procedure, read top to bottom (bench/README.md): its servers, fleet,
# baselines and measured modes in the order a run takes them
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


GROUP_COMMIT_ENV = "HPD_BENCH_GROUP_COMMIT"
"""``max_batch,wait_us`` for the servers of this run (``--group-commit``)."""


def group_commit_settings() -> dict[str, Any]:
    raw = os.environ.get(GROUP_COMMIT_ENV, "")
    if not raw:
        return {}
    batch, wait = (int(x) for x in raw.split(","))
    return {"group_commit_max_batch": batch, "group_commit_wait_us": wait}


def bench_profile(folder: str) -> str:
    """The default profile with admission off, as a file (module docstring)."""
    import yaml

    from hpd_scheduler.settings import profile_document

    doc = yaml.safe_load(profile_document("default"))
    doc.setdefault("slo_objective", {})["admit_ttft_factor"] = 0.0
    path = Path(folder) / "bench-profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def plan_once() -> None:
    """``floor`` mode: `SchedulerService.schedule` plans its first request, then reserves and
    records that same plan (under each request's id) for every later one."""
    from hpd_scheduler import service as svc
    from hpd_scheduler.answers import ScheduleResult
    from hpd_scheduler.store import ReservationAsk, ReserveEntry

    planned = svc.SchedulerService.schedule
    first: dict[str, Any] = {}

    async def schedule(self: svc.SchedulerService, req: Any) -> ScheduleResult:
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
        await self.commits.reserve(ReserveEntry(
            req.request_id, head, head["decision"], ask, self.clock.now_ms(),
            st.reservation_ttl_ms, st.record_ttl_ms,
        ))  # fmt: skip
        return ScheduleResult(head, False)

    svc.SchedulerService.schedule = schedule  # type: ignore[method-assign]


async def serve(redis_url: str, prefix: str, mode: str) -> None:
    """``mode``: ``plan`` (registry + scheduler), ``floor`` (the scheduler answers without
    planning) or ``registry`` (the registry alone: schedulers run as processes of their
    own)."""
    if mode == "floor":
        plan_once()
    from hpd_common import native, redis_conn
    from hpd_common.logging import configure_logging
    from hpd_common.server import run_until_signal
    from hpd_registry.__main__ import build_server as build_registry
    from hpd_registry.settings import RegistrySettings
    from hpd_scheduler.__main__ import build_server as build_scheduler
    from hpd_scheduler.settings import SchedulerSettings

    configure_logging("warning", json_logs=False)
    client = redis_conn.connect(redis_url)
    reg = build_registry(
        RegistrySettings(port=0, redis_url=redis_url, key_prefix=prefix, lease_ttl_ms=300_000),
        client,
    )
    await reg.start()
    with tempfile.TemporaryDirectory() as folder:
        sch = build_scheduler(
            SchedulerSettings(
                port=0,
                redis_url=redis_url,
                key_prefix=prefix,
                registry_target=f"127.0.0.1:{reg.port}",
                directive_interval_ms=0,
                reservation_ttl_ms=RESERVATION_TTL_MS,
                profile=bench_profile(folder),
                log_level="warning",
                **group_commit_settings(),
            ),
            client,
        )
        serving = [sch] if mode != "registry" else []

        async def started() -> None:
            ports = {"registry": reg.port, "scheduler": sch.port if mode != "registry" else 0}
            print(json.dumps({**ports, "compiled_modules": native.status().active}), flush=True)

        try:
            await run_until_signal(serving, on_started=started)
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


def summary_of(lat: list[float], wall: float, refused: int = 0) -> dict[str, float]:
    lat.sort()
    return {
        "p50_us": lat[len(lat) // 2] * 1e6,
        "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
        "per_s": len(lat) / wall,
        "refused": refused,
    }


async def measure(
    call: Callable[[int], Awaitable[Any]], total: int, concurrency: int
) -> dict[str, float]:
    """``total`` calls by ``concurrency`` callers, each waiting for its answer."""
    lat: list[float] = []
    refused = 0
    counter = iter(range(total))

    async def worker() -> None:
        nonlocal refused
        for i in counter:
            t0 = time.perf_counter()
            try:
                await call(i)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                refused += 1  # a refusal is an answer too (counted, and reported)
            lat.append(time.perf_counter() - t0)

    for i in range(min(50, total)):  # warm-up (not counted)
        await call(-1 - i)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summary_of(lat, time.perf_counter() - start, refused)


def schedule_request(rid: str, i: int) -> s.ScheduleRequest:
    return s.ScheduleRequest(
        request_id=rid, model_id="llama-3-8b", prompt_tokens=600 + (i * 131) % 3000,
        expected_output_tokens=50 + (i * 17) % 500,
    )  # fmt: skip


async def measure_streams(
    stubs: list[s_grpc.SchedulerServiceStub], run: str, total: int, in_flight: int
) -> dict[str, float]:
    """``total`` requests over one ScheduleStream per stub, ``in_flight`` outstanding on
    each; latency is send to answer."""
    lat: list[float] = []
    refused = 0
    counter = iter(range(total))

    async def one_stream(stub: s_grpc.SchedulerServiceStub) -> None:
        nonlocal refused
        room = asyncio.Semaphore(in_flight)
        sent: dict[str, float] = {}

        async def requests() -> AsyncIterator[s.ScheduleRequest]:
            for i in counter:
                await room.acquire()
                rid = f"{run}-{i}"
                sent[rid] = time.perf_counter()
                yield schedule_request(rid, i)

        async for answer in stub.ScheduleStream(requests()):
            lat.append(time.perf_counter() - sent.pop(answer.request_id))
            if answer.WhichOneof("result") == "error":
                if answer.error.code != grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                    raise RuntimeError(f"{answer.request_id}: {answer.error.message}")
                refused += 1
            room.release()

    start = time.perf_counter()
    await asyncio.gather(*(one_stream(stub) for stub in stubs))
    return summary_of(lat, time.perf_counter() - start, refused)


def start_child(
    redis_url: str, prefix: str, mode: str
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    here = Path(__file__).resolve()
    child = subprocess.Popen(
        [sys.executable, str(here), "--serve", redis_url, prefix, mode], stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


async def wait_for_fleet(
    stubs: list[s_grpc.SchedulerServiceStub], n: int, timeout_s: float = 60
) -> None:
    """Until every stub's scheduler process holds the fleet (a plan succeeds and it knows
    the load of every decode-capable worker)."""
    deadline = time.monotonic() + timeout_s
    decode = sum(1 for i in range(n) if (i // 8) % len(SHAPES) != 0)
    for stub in stubs:
        while True:
            try:
                await stub.Schedule(schedule_request(f"probe-{time.monotonic_ns()}", 0), timeout=5)
                recs = await stub.GetRecommendations(s.GetRecommendationsRequest())
                if len([w for w in recs.workers if w.load >= 0]) >= decode:
                    break
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler never saw the fleet")
            await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # one more rebuild after the last load reports


async def bench_size(
    redis_url: str, n: int, total: int, mode: str = "plan", runs: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One server (``mode`` plan or floor) over a fleet of ``n``; the ``runs`` named (all
    by default): echo / echo_redis / schedule at c1 and c16, stream_c16."""
    prefix = f"bench{n}{mode}x{os.getpid()}"
    child, ports = await asyncio.to_thread(start_child, redis_url, prefix, mode)
    try:
        registry = f"127.0.0.1:{ports['registry']}"
        creds = await register_fleet(registry, n)
        target = f"127.0.0.1:{ports['scheduler']}"
        async with grpc.aio.insecure_channel(target) as ch:
            sched = s_grpc.SchedulerServiceStub(ch)
            diag = d_grpc.DiagnosticsServiceStub(ch)
            await wait_for_fleet([sched], n)
            payload = b"x" * 64
            out: dict[str, Any] = {"workers": n, "compiled_modules": ports["compiled_modules"]}
            wanted = set(runs) or {
                f"{k}_c{c}" for k in ("echo", "echo_redis", "schedule") for c in CONCURRENCY
            } | {"stream_c16"}
            for conc in CONCURRENCY:
                run = f"c{conc}"

                async def echo(i: int) -> Any:
                    return await diag.Echo(d.EchoRequest(payload=payload))

                async def echo_redis(i: int) -> Any:
                    return await diag.EchoRedis(d.EchoRequest(payload=payload))

                async def schedule(i: int, run: str = run) -> Any:
                    return await sched.Schedule(schedule_request(f"{mode}{run}-{i}", i))

                for key, call in (("echo", echo), ("echo_redis", echo_redis)):
                    if f"{key}_{run}" in wanted:
                        out[f"{key}_{run}"] = await measure(call, total, conc)
                if f"schedule_{run}" in wanted:
                    await report_loads(registry, creds)
                    await asyncio.sleep(0.5)  # the scheduler's next rebuild takes them in
                    out[f"schedule_{run}"] = await measure(schedule, total, conc)
            if "stream_c16" in wanted:
                await report_loads(registry, creds)
                await asyncio.sleep(0.5)
                out["stream_c16"] = await measure_streams([sched], f"{mode}s16", total, 16)
            return out
    finally:
        child.terminate()
        await asyncio.to_thread(child.wait, 15)


async def bench_processes(
    redis_url: str, n: int, total: int, processes: int, channels: int = 8, in_flight: int = 8
) -> dict[str, Any]:
    """``hpd scheduler --processes N`` on one port (the registry in a child process, the
    client here over ``channels`` connections with a ScheduleStream each)."""
    from hpd_tools.embedded_redis import free_port

    prefix = f"benchp{processes}x{os.getpid()}"
    child, ports = await asyncio.to_thread(start_child, redis_url, prefix, "registry")
    port = free_port()
    registry = f"127.0.0.1:{ports['registry']}"
    with tempfile.TemporaryDirectory() as folder:
        sup = subprocess.Popen(  # noqa: ASYNC220
            [
                sys.executable, "-m", "hpd_scheduler", "--processes", str(processes),
                "--port", str(port), "--redis-url", redis_url, "--key-prefix", prefix,
                "--registry-target", registry, "--directive-interval-ms", "0",
                "--reservation-ttl-ms", str(RESERVATION_TTL_MS),
                "--profile", bench_profile(folder), "--log-level", "warning",
                "--shutdown-grace-s", "0",
            ]
        )  # fmt: skip
        chans = [
            grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            )
            for _ in range(channels)
        ]
        try:
            creds = await register_fleet(registry, n)
            stubs = [s_grpc.SchedulerServiceStub(ch) for ch in chans]
            await wait_for_fleet(stubs, n)
            await report_loads(registry, creds)
            await asyncio.sleep(0.5)
            out = await measure_streams(stubs, f"p{processes}", total, in_flight)
            return {"processes": processes, "channels": channels, "in_flight": in_flight, **out}
        finally:
            for ch in chans:
                await ch.close()
            sup.terminate()
            await asyncio.to_thread(sup.wait, 20)
            child.terminate()
            await asyncio.to_thread(child.wait, 15)


async def main_async(quick: bool, scaling: bool, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    from hpd_tools.embedded_redis import EmbeddedRedis

    total = 1500 if quick else 4000
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), persist=False) as red:
        for n in sorted({*sizes, 256}):
            results[str(n)] = await bench_size(red.url, n, total)
        floor = await bench_size(red.url, 256, total, "floor", ("schedule_c1", "schedule_c16"))
        procs: dict[str, Any] = {}
        if scaling:
            for count in (1, 2):
                procs[str(count)] = await bench_processes(red.url, 256, 2 * total, count)
    r256 = results["256"]
    er16 = r256["echo_redis_c16"]["per_s"]
    summary: dict[str, Any] = {
        "throughput_vs_echo_redis_256_c16": r256["schedule_c16"]["per_s"] / er16,
        "stream_throughput_vs_echo_redis_256_c16": r256["stream_c16"]["per_s"] / er16,
        "p50_vs_floor_256": r256["schedule_c1"]["p50_us"] / floor["schedule_c1"]["p50_us"],
        "p50_vs_echo_redis_256": r256["schedule_c1"]["p50_us"] / r256["echo_redis_c1"]["p50_us"],
        "floor_throughput_vs_echo_redis_256_c16": floor["schedule_c16"]["per_s"] / er16,
    }
    if "4096" in results:
        r4096 = results["4096"]
        summary["p50_vs_echo_redis_4096"] = (
            r4096["schedule_c1"]["p50_us"] / r4096["echo_redis_c1"]["p50_us"]
        )
    if procs:
        summary["decisions_per_s_processes"] = {k: v["per_s"] for k, v in procs.items()}
        summary["scaling_2_vs_1"] = procs["2"]["per_s"] / procs["1"]["per_s"]
    compiled = all(r["compiled_modules"] for r in results.values())
    return {
        **summary,
        "compiled_modules": compiled,
        "cores": os.cpu_count(),
        "requests_per_run": total,
        "group_commit": os.environ.get(GROUP_COMMIT_ENV, "defaults"),
        "sizes": results,
        "floor_256": floor,
        "processes": procs,
    }


TARGETS = {
    "throughput_vs_echo_redis_256_c16": (">=", 1.0),
    "stream_throughput_vs_echo_redis_256_c16": (">=", 1.5),
    "p50_vs_floor_256": ("<=", 1.10),
}


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        asyncio.run(serve(sys.argv[2], sys.argv[3], sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer requests (a few minutes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--no-scaling", action="store_true", help="skip the 1- and 2-process scaling runs"
    )
    p.add_argument(
        "--sizes", default=",".join(map(str, SIZES)), help="fleet sizes (256 always runs)"
    )
    p.add_argument(
        "--group-commit",
        default="",
        metavar="MAX_BATCH,WAIT_US",
        help="the scheduler's group commit settings for this run (default: its defaults; "
        "1,0 = off)",
    )
    args = p.parse_args()
    if args.group_commit:
        os.environ[GROUP_COMMIT_ENV] = args.group_commit
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    out = asyncio.run(main_async(args.quick, not args.no_scaling, sizes))
    if args.json:
        print(json.dumps(out))
        return 0
    for n, res in out["sizes"].items():
        print(f"fleet {n} workers")
        for key in ("echo_redis_c1", "echo_redis_c16", "schedule_c1", "schedule_c16", "stream_c16"):
            m = res[key]
            print(
                f"  {key:<15} p50 {m['p50_us']:8.0f} us   p99 {m['p99_us']:8.0f} us"
                f"   {m['per_s']:8.0f} /s   refused {m['refused']:.0f}"
            )
    fl = out["floor_256"]
    for key in ("schedule_c1", "schedule_c16"):
        m = fl[key]
        print(f"floor 256 {key:<13} p50 {m['p50_us']:8.0f} us   {m['per_s']:8.0f} /s")
    for name, (op, target) in TARGETS.items():
        print(f"{name:<42} {out[name]:.2f}  (target {op} {target})")
    for k, v in out.get("decisions_per_s_processes", {}).items():
        print(f"decisions/s with {k} scheduler process(es): {v:,.0f}")
    if "scaling_2_vs_1" in out:
        print(f"scaling 2 vs 1 process:                    {out['scaling_2_vs_1']:.2f}")
    print(f"compiled policy core: {out['compiled_modules']}  (hpd native status)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
