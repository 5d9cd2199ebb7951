"""KV transfer sessions: full lifecycles per second and per-RPC latency, beside the (E+R)
baseline (DiagnosticsService.EchoRedis: one gRPC round trip plus one EVALSHA) taken on the
same broker server and the same Redis in the same run.

A child process serves a registry and a KV broker (following the registry's feed, as under
`hpd up`) over a private redis-server this script starts; this process registers a prefill
and a decode worker and drives sessions through gRPC:

* latency: one call in flight; each round times EchoRedis, then a whole lifecycle
  (OpenSession, ReportProgress, CompleteSession) and a GetSession, so baseline and RPCs see
  the same conditions. p50 and p99 per RPC; the figure of merit is the worst RPC's p50 over
  the baseline's p50 (`rpc_p50_vs_echo_redis`, target <= 1.3).
* throughput: `--concurrency` clients run whole lifecycles for a fixed time
  (lifecycles/s), then the same clients call EchoRedis for the same time (calls/s).

    python bench/kv_sessions.py [--quick] [--json] [--concurrency N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
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
from hetero_pd.v1 import diagnostics_pb2 as dpb
from hetero_pd.v1 import diagnostics_pb2_grpc as d_grpc
from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import kvbroker_pb2_grpc as k_grpc
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_tools.embedded_redis import EmbeddedRedis

TARGET = 1.3
GIB = 1 << 30
RPCS = ("OpenSession", "ReportProgress", "CompleteSession", "GetSession")


# -- the server process ----------------------------------------------------------------------


async def _serve(redis_url: str) -> None:
    from hpd_common import redis_conn
    from hpd_common.logging import configure_logging
    from hpd_kvbroker.__main__ import build_server as build_broker
    from hpd_kvbroker.settings import KvBrokerSettings
    from hpd_registry.__main__ import build_server as build_registry
    from hpd_registry.settings import RegistrySettings

    configure_logging("warning", json_logs=True)
    client = redis_conn.connect(redis_url)
    registry = build_registry(RegistrySettings(port=0, redis_url=redis_url), client)
    await registry.start()
    broker = build_broker(
        KvBrokerSettings(port=0, redis_url=redis_url, registry_target=f"127.0.0.1:{registry.port}"),
        client,
    )
    await broker.start()
    print(f"PORTS {registry.port} {broker.port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await broker.stop(0)
    await registry.stop(0)
    await client.aclose()


# -- the client --------------------------------------------------------------------------------


def _capability(worker_id: str, stage: Any) -> c.WorkerCapability:
    return c.WorkerCapability(
        worker_id=worker_id,
        pool_id=f"pool-{worker_id}",
        endpoint=f"{worker_id}.local:8000",
        stages=[stage],
        model_id="llama-3-8b",
        model_revision="rev-a",
        engine="vllm",
        engine_version="0.9.0",
        gpu_type="H100-SXM",
        gpu_count=1,
        tp_size=1,
        pp_size=1,
        kv_memory_total_bytes=40 * GIB,
        max_batch_size=256,
        kv_format=c.KvFormat(
            dtype=c.KV_DTYPE_BF16,
            layout=c.KV_LAYOUT_PAGED_NHD,
            block_size_tokens=16,
            num_layers=32,
            num_kv_heads=8,
            head_dim=128,
            tp_size=1,
            attention_backend="flash_attn",
            model_revision="rev-a",
        ),
        network=c.NetworkLocation(zone="z1", rack="r1", host=worker_id, nic_gbps=200),
    )


class Client:
    def __init__(self, channel: grpc.aio.Channel, p1: str, d1: str) -> None:
        self.kv = k_grpc.KvBrokerServiceStub(channel)
        self.diag = d_grpc.DiagnosticsServiceStub(channel)
        self.p1 = k.SessionCaller(worker_id="p1", credential=p1)
        self.d1 = k.SessionCaller(worker_id="d1", credential=d1)
        self._ids = itertools.count()
        self._tag = os.urandom(4).hex()

    async def echo_redis(self) -> None:
        await self.diag.EchoRedis(dpb.EchoRequest(payload=b"x" * 64), timeout=5)

    async def lifecycle(self, timed: Callable[[str, float], None] | None = None) -> None:
        rid = f"bench-{self._tag}-{next(self._ids)}"
        steps: list[tuple[str, Callable[[str], Awaitable[Any]]]] = [
            ("OpenSession", self._open),
            ("ReportProgress", self._progress),
            ("CompleteSession", self._complete),
            ("GetSession", self._get),
        ]
        sid = rid
        for name, fn in steps if timed else steps[:3]:
            t = time.perf_counter()
            out = await fn(sid)
            if timed is not None:
                timed(name, time.perf_counter() - t)
            if name == "OpenSession":
                sid = out.session.session_id

    async def _open(self, rid: str) -> Any:
        return await self.kv.OpenSession(
            k.OpenSessionRequest(
                request_id=rid,
                source_worker_id="p1",
                destination_worker_id="d1",
                expected_bytes=GIB,
                caller=self.p1,
            ),
            timeout=5,
        )

    async def _progress(self, sid: str) -> Any:
        return await self.kv.ReportProgress(
            k.ReportProgressRequest(session_id=sid, caller=self.p1, bytes_done=GIB // 2),
            timeout=5,
        )

    async def _complete(self, sid: str) -> Any:
        return await self.kv.CompleteSession(
            k.CompleteSessionRequest(session_id=sid, caller=self.d1), timeout=5
        )

    async def _get(self, sid: str) -> Any:
        return await self.kv.GetSession(k.GetSessionRequest(session_id=sid), timeout=5)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def _throughput(fn: Callable[[], Awaitable[None]], workers: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await fn()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return done / (time.perf_counter() - t0)


async def _measure(reg_port: int, broker_port: int, rounds: int, seconds: float, conc: int) -> Any:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{reg_port}") as reg_channel:
        reg = r_grpc.RegistryServiceStub(reg_channel)
        creds = {}
        for wid, stage in (("p1", c.STAGE_PREFILL), ("d1", c.STAGE_DECODE)):
            resp = await reg.RegisterWorker(
                r.RegisterWorkerRequest(capability=_capability(wid, stage), lease_ttl_ms=300_000),
                timeout=5,
            )
            creds[wid] = resp.credential
    async with grpc.aio.insecure_channel(f"127.0.0.1:{broker_port}") as channel:
        client = Client(channel, creds["p1"], creds["d1"])
        for _ in range(max(50, rounds // 10)):  # warm up connections, scripts, the informer
            await client.echo_redis()
            await client.lifecycle()
        samples: dict[str, list[float]] = {name: [] for name in ("EchoRedis", *RPCS)}

        def timed(name: str, seconds_: float) -> None:
            samples[name].append(seconds_)

        for _ in range(rounds):
            t = time.perf_counter()
            await client.echo_redis()
            timed("EchoRedis", time.perf_counter() - t)
            await client.lifecycle(timed)
        lifecycles_per_s = await _throughput(client.lifecycle, conc, seconds)
        echo_per_s = await _throughput(client.echo_redis, conc, seconds)
    return samples, lifecycles_per_s, echo_per_s


def run(quick: bool, concurrency: int) -> dict[str, Any]:
    rounds = 500 if quick else 3000
    seconds = 3.0 if quick else 10.0
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), persist=False) as redis:
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", redis.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline().split()
            if not line or line[0] != "PORTS":
                raise SystemExit("the server process did not start")
            reg_port, broker_port = int(line[1]), int(line[2])
            samples, lifecycles, echo_per_s = asyncio.run(
                _measure(reg_port, broker_port, rounds, seconds, concurrency)
            )
        finally:
            if server.stdin is not None:
                server.stdin.close()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
    echo_p50 = _pct(samples["EchoRedis"], 0.5)
    per_rpc = {
        name: {
            "p50_ms": round(_pct(v, 0.5), 4),
            "p99_ms": round(_pct(v, 0.99), 4),
            "p50_vs_echo_redis": round(_pct(v, 0.5) / echo_p50, 3),
        }
        for name, v in samples.items()
    }
    worst = max(RPCS, key=lambda n: per_rpc[n]["p50_vs_echo_redis"])
    return {
        "rounds": rounds,
        "concurrency": concurrency,
        "lifecycles_per_s": round(lifecycles, 1),
        "echo_redis_calls_per_s": round(echo_per_s, 1),
        "lifecycle_rpcs_per_s_vs_echo_redis": round(3 * lifecycles / echo_per_s, 3),
        "rpcs": per_rpc,
        "worst_rpc": worst,
        "rpc_p50_vs_echo_redis": per_rpc[worst]["p50_vs_echo_redis"],
        "target_rpc_p50_vs_echo_redis": TARGET,
        "meets_target": per_rpc[worst]["p50_vs_echo_redis"] <= TARGET,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="fewer rounds, shorter (under a minute)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--concurrency", type=int, default=16, help="clients in the throughput phase")
    p.add_argument("--serve", metavar="REDIS_URL", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    out = run(args.quick, args.concurrency)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'rpc':<16} {'p50 ms':>8} {'p99 ms':>8} {'p50/E+R':>8}")
    for name, fig in out["rpcs"].items():
        print(
            f"{name:<16} {fig['p50_ms']:>8.3f} {fig['p99_ms']:>8.3f} "
            f"{fig['p50_vs_echo_redis']:>8.2f}"
        )
    print(
        f"lifecycles/s {out['lifecycles_per_s']:.0f} at concurrency {out['concurrency']} "
        f"(EchoRedis {out['echo_redis_calls_per_s']:.0f} calls/s)"
    )
    verdict = "meets" if out["meets_target"] else "misses"
    print(
        f"worst RPC {out['worst_rpc']}: p50 {out['rpc_p50_vs_echo_redis']:.2f} x (E+R); "
        f"{verdict} the target {TARGET}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
