"""`hpd demo`: the control plane, an emulated heterogeneous fleet and a trace replay, in one
command, on a machine without GPUs.

It starts an embedded Redis (a private ``redis-server`` with an append-only file in a fresh
state directory; ``--redis-url`` uses yours instead), the registry, KV broker and scheduler
in this process, the fleet of ``--cluster`` (default: the package's ``demo_cluster.yaml``),
then replays ``--duration`` seconds of ``--trace`` (default: the Azure conversation trace)
at ``--rate-scale`` x its rate. In real time every request goes as an OpenAI client sends
it, over HTTP through ``hpd gateway`` (started as a process of its own) to the emulated
engines' HTTP servers (``hpd_fleet.engine_http``: vLLM's routes, metrics and KV hand-off),
the path real engines take; ``--time-scale`` x faster than real time (or ``--in-process``,
or ``--attach``), plans are executed in this process (``hpd_fleet.gateway``). It shows a live
progress bar and per-pool table, prints a report per tier, cross-checks the report against
the route records in Redis (``ListRouteRecords``), writes ``report.json`` (and PNG plots when
matplotlib is installed) under ``--out``, and keeps the services up for grpcurl until Ctrl-C
(``--no-serve``: exit after the report).

Exit status: 0 when every request was accounted for (completed, or rejected / failed with a
reason; none lost, none twice) and the route records agree; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_agent.worker_client import ClientTiming
from hpd_common.clock import SystemClock
from hpd_common.logging import configure_logging, get_logger
from hpd_gateway.service import REPLAN_SUFFIX
from hpd_sim.cluster import ClusterSpec, load_cluster
from hpd_sim.metrics import Slo
from hpd_sim.traces import Trace, load_trace, reshape
from hpd_tools.controlplane import ControlPlane, ControlPlaneSettings
from hpd_tools.embedded_redis import EmbeddedRedis

from .engine import EmuTime
from .engine_http import FleetHttp
from .faults import Fault, FaultInjector, parse_fault
from .fleet import Fleet, default_cluster_path
from .gateway import Gateway
from .live import LiveView
from .real_processes import AgentProcess, pick_port, wait_http
from .replay import HttpReplay
from .replay_common import DECISION_NAMES, GatewayConfig, Replay, RequestRecord
from .report import build_report, format_report, plot_report, write_report

__all__ = ["DemoOptions", "DemoResult", "main", "parser", "reconcile", "run_demo"]

log = get_logger("demo")


def default_trace_path() -> Path:
    """``data/traces/azure_llm_2023_conv.csv`` of the source tree (from this file, then the
    working directory)."""
    rel = Path("data") / "traces" / "azure_llm_2023_conv.csv"
    for parent in Path(__file__).resolve().parents:
        if (parent / rel).is_file():
            return parent / rel
    return Path.cwd() / rel


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """Everything a demo run needs besides the Redis (see :func:`parser` for meanings)."""

    trace: Path
    cluster: Path
    rate_scale: float = 1.0
    duration_s: float = 30.0
    # a ramp: the rate rises linearly from rate_scale to this over the replay
    rate_scale_end: float | None = None
    time_scale: float = 1.0
    max_requests: int | None = None
    seed: int = 7
    out: Path | None = None
    serve: bool = False
    live: bool = True
    host: str = "127.0.0.1"
    registry_port: int = 0
    scheduler_port: int = 0
    kvbroker_port: int = 0
    key_prefix: str = "hpd"
    lease_ttl_ms: int = 3_000
    report_interval_s: float = 0.25
    faults: tuple[Fault, ...] = ()
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    log_level: str = "warning"
    # registry, scheduler, kvbroker addresses of a running control plane: attach the fleet
    # and the replay to it instead of starting one (the compose `fleet` profile does this)
    attach: tuple[str, str, str] | None = None
    # replay through `hpd gateway` over the emulated engines' HTTP (the real front door and
    # the engines' protocol) instead of executing plans in this process
    via_gateway: bool = False
    gateway_port: int = 0


@dataclass(frozen=True, slots=True)
class DemoResult:
    """What a run produced: the report dict, the request records, the exit status."""

    report: dict[str, Any]
    records: list[RequestRecord]
    status: int
    route: list[s.RouteRecord] = field(default_factory=list)
    sessions: dict[str, list[kb.KvSession]] = field(default_factory=dict)
    """The broker's sessions of each killed worker, as they ended."""


async def list_route_records(
    stub: s_grpc.SchedulerServiceStub, since_ms: int, prefix: str
) -> list[s.RouteRecord]:
    """Every route record created since ``since_ms`` whose request id starts with ``prefix``."""
    out: list[s.RouteRecord] = []
    token = ""
    while True:
        resp = await stub.ListRouteRecords(
            s.ListRouteRecordsRequest(since_unix_ms=since_ms, page_size=1000, page_token=token),
            timeout=10,
        )
        out += [r for r in resp.records if r.request_id.startswith(prefix)]
        token = resp.next_page_token
        if not token:
            return out


def reconcile(records: Sequence[RequestRecord], route: Sequence[s.RouteRecord]) -> dict[str, Any]:
    """Compare the gateway's records with the scheduler's route records, request by request.

    Expected: a request that was planned (completed or failed) has a PRIMARY or REROUTE
    record carrying an outcome with the same success; a request the scheduler refused
    (reason other than ``unavailable``) has a REJECT record; a request rejected as
    ``unavailable`` has none; and no route record names a request the gateway never sent.
    """
    by_id = {r.request_id: r for r in route}
    mismatches: list[str] = []
    for rec in records:
        # a plan whose fallback chain ran out is re-planned once by `hpd gateway` under
        # ``<id>:replan``: that record carries the request's final outcome
        rr = by_id.get(f"{rec.request_id}{REPLAN_SUFFIX}") or by_id.get(rec.request_id)
        decision = DECISION_NAMES.get(rr.decision, "") if rr is not None else ""
        if rec.status in ("completed", "failed"):
            if rr is None or decision not in ("primary", "reroute"):
                mismatches.append(f"{rec.request_id}: {rec.status} but record {decision or 'none'}")
            elif not rr.HasField("outcome"):
                mismatches.append(f"{rec.request_id}: {rec.status} but no outcome on the record")
            elif rr.outcome.success != (rec.status == "completed"):
                mismatches.append(f"{rec.request_id}: outcome success {rr.outcome.success}")
        elif rec.reason == "unavailable":
            if rr is not None and decision != "reject":
                mismatches.append(f"{rec.request_id}: unavailable but planned ({decision})")
        elif rr is None or decision != "reject":
            mismatches.append(f"{rec.request_id}: rejected but record {decision or 'none'}")
    known = {r.request_id for r in records}
    strays = [rid for rid in by_id if rid.removesuffix(REPLAN_SUFFIX) not in known]
    mismatches += [f"{rid}: route record without a request" for rid in strays]
    counts: dict[str, int] = {}
    for r in route:
        d = DECISION_NAMES.get(r.decision, "unspecified")
        counts[d] = counts.get(d, 0) + 1
    return {
        "route_records": len(route),
        "by_decision": counts,
        "with_outcome": sum(r.HasField("outcome") for r in route),
        "outcome_success": sum(r.HasField("outcome") and r.outcome.success for r in route),
        "mismatches": mismatches[:20],
        "agree": not mismatches,
    }


async def wait_fleet_seen(cp: ControlPlane, worker_ids: Sequence[str], timeout_s: float) -> None:
    """Until the in-process scheduler's fleet view holds every worker with a load report."""
    svc: Any = cp.scheduler.component.service  # type: ignore[union-attr]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        seen = svc.informer.workers
        if all(w in seen and seen[w].load is not None for w in worker_ids):
            svc.rebuild()
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the scheduler did not see the fleet within {timeout_s} s")


async def _wait_fleet_registered(
    reg_ch: grpc.aio.Channel, sch_ch: grpc.aio.Channel, worker_ids: Sequence[str], timeout_s: float
) -> None:
    """Attached to a running control plane: until the registry lists every worker with a
    load report and the scheduler reports SERVING (its view then follows within moments)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hetero_pd.v1 import registry_pb2 as r
    from hetero_pd.v1 import registry_pb2_grpc as r_grpc

    reg = r_grpc.RegistryServiceStub(reg_ch)
    health = health_pb2_grpc.HealthStub(sch_ch)
    want = set(worker_ids)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        try:
            seen: set[str] = set()
            token = ""
            while True:
                page = await reg.ListWorkers(
                    r.ListWorkersRequest(page_size=1000, page_token=token), timeout=5
                )
                seen |= {w.capability.worker_id for w in page.workers if w.HasField("load")}
                token = page.next_page_token
                if not token:
                    break
            serving = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            if want <= seen and serving.status == health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(1.0)  # the scheduler's informer and snapshot catch up
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the control plane did not see the fleet within {timeout_s} s")


async def _start_gateway(
    opts: DemoOptions, targets: tuple[str, str, str], out_dir: Path | None
) -> tuple[AgentProcess, str]:
    """``hpd gateway`` in a process of its own, as it is deployed (the demo's process runs
    the control plane, every engine and the clients: with the gateway too, its one core
    would time everything). Its log goes to ``<out>/gateway-demo.log``."""
    registry, scheduler, broker = targets
    port = opts.gateway_port or pick_port()
    url = f"http://{opts.host}:{port}"
    proc = AgentProcess(
        "demo",
        [
            "--host", opts.host, "--port", str(port), "--scheduler", scheduler,
            "--broker", broker, "--registry", registry, "--log-level", "warning",
        ],
        out_dir or Path(tempfile.gettempdir()),
        command="gateway",
    )  # fmt: skip
    proc.start()
    try:
        await asyncio.to_thread(wait_http, url + "/health", 30.0)
    except TimeoutError:
        proc.stop()
        raise
    return proc, url


async def _tiers(stub: s_grpc.SchedulerServiceStub) -> dict[str, Slo]:
    resp = await stub.GetPolicy(s.GetPolicyRequest(), timeout=5)
    return {t.name: Slo(t.ttft_ms, t.tpot_ms) for t in resp.policy.tiers}


async def run_demo(
    opts: DemoOptions,
    redis_url: str,
    redis: EmbeddedRedis | None = None,
    out: TextIO | None = None,
    stop_event: asyncio.Event | None = None,
) -> DemoResult:
    """One demo run against ``redis_url`` (``redis``: the embedded server, needed by the
    stop_redis fault). Returns the report; serves until ``stop_event`` when ``opts.serve``."""
    out = out or sys.stdout
    rng = random.Random(opts.seed)
    cluster: ClusterSpec = load_cluster(opts.cluster)
    trace: Trace = reshape(
        load_trace(opts.trace),
        rate_scale=opts.rate_scale,
        duration_s=opts.duration_s,
        max_requests=opts.max_requests,
        time_scale=opts.time_scale,
        rate_scale_end=opts.rate_scale_end,
    )
    clock = SystemClock()
    cp: ControlPlane | None = None
    if opts.attach is None:
        cp = ControlPlane(
            ControlPlaneSettings(
                redis_url=redis_url,
                host=opts.host,
                registry_port=opts.registry_port,
                scheduler_port=opts.scheduler_port,
                kvbroker_port=opts.kvbroker_port,
                key_prefix=opts.key_prefix,
                lease_ttl_ms=opts.lease_ttl_ms,
                log_level=opts.log_level,
            )
        )
        await cp.start()
        targets = (cp.registry_target, cp.scheduler_target, cp.kvbroker_target)
    else:
        targets = opts.attach
    registry_target, scheduler_target, kvbroker_target = targets
    channels = [
        grpc.aio.insecure_channel(t) for t in (registry_target, kvbroker_target, scheduler_target)
    ]
    reg_ch, kb_ch, sch_ch = channels
    emu = EmuTime(opts.time_scale, time.monotonic, asyncio.sleep, start=time.monotonic())
    fleet = Fleet(
        cluster,
        reg_ch,
        kb_ch,
        emu,
        clock,
        random.Random(rng.random()),
        lease_ttl_ms=opts.lease_ttl_ms,
        timing=ClientTiming(report_interval_s=opts.report_interval_s),
    )
    stub = s_grpc.SchedulerServiceStub(sch_ch)
    live: LiveView | None = None
    fleet_http = FleetHttp(fleet, opts.host) if opts.via_gateway else None
    front: AgentProcess | None = None
    try:
        if fleet_http is not None:
            await fleet_http.start()
        await fleet.start()
        if cp is not None:
            await wait_fleet_seen(cp, list(fleet.workers), timeout_s=15)
        else:
            await _wait_fleet_registered(reg_ch, sch_ch, list(fleet.workers), timeout_s=60)
        tier_slos = await _tiers(stub)
        mix = tuple((t, w) for t, w in opts.gateway.tier_mix if t in tier_slos) or tuple(
            (t, 1.0) for t in tier_slos
        )
        run_id = f"demo{clock.now_ms() % 10**10:010d}"
        gw_config = GatewayConfig(
            **{**_config_dict(opts.gateway), "tier_mix": mix, "model_id": cluster.model.name}
        )
        gateway: Replay
        if fleet_http is None:
            gateway = Gateway(
                sch_ch, fleet, emu, random.Random(rng.random()), gw_config, run_id=run_id
            )
        else:
            front, url = await _start_gateway(opts, targets, opts.out)
            gateway = HttpReplay(
                url, sch_ch, emu, random.Random(rng.random()), gw_config, run_id=run_id
            )
            print(f"hpd demo: requests go through hpd gateway at {url}", file=out, flush=True)
        print(
            f"hpd demo: {len(fleet.workers)} emulated workers in {len(fleet.pools())} pools "
            f"({cluster.gpus} GPUs, ${cluster.price_per_hour:.2f}/h assumed); replaying "
            f"{len(trace)} requests of {Path(opts.trace).name} over {opts.duration_s:g} s "
            f"(rate {_rate_words(opts)}, time x{opts.time_scale:g})",
            file=out,
            flush=True,
        )
        injector = FaultInjector(
            fleet,
            gateway,
            stop_redis=(lambda: asyncio.to_thread(redis.stop)) if redis is not None else None,
            start_redis=(lambda: _restart(redis)) if redis is not None else None,
        )
        if opts.live:
            live = LiveView(gateway, fleet, out)
            live.start()
        since_ms = clock.now_ms() - 1_000
        emu_start = emu.now_ms()
        fault_task = asyncio.create_task(injector.run(list(opts.faults)))
        records = await gateway.run(trace)
        await fault_task
        replay_s = (emu.now_ms() - emu_start) / 1000.0
        if live is not None:
            await live.stop()
            live = None
        await asyncio.sleep(0.3)  # the last outcomes land in Redis
        route = await _route_records(stub, since_ms, run_id)
        check = reconcile(records, route)
        sessions = await _killed_sessions(kb_grpc.KvBrokerServiceStub(kb_ch), fleet)
        report = build_report(
            records,
            tier_slos,
            replay_s,
            cluster.price_per_hour,
            extra={
                "run_id": run_id,
                "trace": Path(opts.trace).name,
                "cluster": cluster.name,
                "rate_scale": opts.rate_scale,
                "rate_scale_end": opts.rate_scale_end,
                "time_scale": opts.time_scale,
                "duration_s": opts.duration_s,
                "lease_ttl_ms": opts.lease_ttl_ms,
                "faults": injector.applied,
                "schedule_retries_while_unavailable": gateway.stats.unavailable_retries,
                "route_records": check,
                "killed_worker_sessions": {
                    wid: dict(
                        collections.Counter(
                            f"{kb.SessionState.Name(x.state)}: {x.reason.split(':')[0]}" for x in ss
                        )
                    )
                    for wid, ss in sessions.items()
                },
                "workers": {
                    w.worker_id: {
                        "pool": w.view.pool_id,
                        "stage": w.view.stage.value,
                        "gpu": w.view.gpu_type,
                        "killed": w.killed,
                        "killed_at_unix_ms": w.killed_at_unix_ms,
                        "registrations": w.client.registrations,
                        "directives": len(w.client.directives),
                    }
                    for w in fleet
                },
            },
        )
        status = 0 if report["accounting"]["accounted"] and check["agree"] else 1
        print("", file=out)
        print(format_report(report), file=out)
        verdict = (
            "agree with the report"
            if check["agree"]
            else "DISAGREE: " + "; ".join(check["mismatches"][:3])
        )
        print(f"route records in Redis: {check['route_records']} ({verdict})", file=out)
        if opts.out is not None:
            path = write_report(report, records, opts.out)
            print(f"report: {path}", file=out)
            print(plot_report(records, report, opts.out), file=out)
        out.flush()
        if opts.serve and cp is not None:
            curl, front_url = "", ""
            if isinstance(gateway, HttpReplay):
                front_url = gateway.url
                body = json.dumps(
                    {"model": cluster.model.name, "prompt": "Hello there", "max_tokens": 8}
                )
                curl = (
                    f"  curl -s {gateway.url}/v1/completions -H 'content-type: "
                    f"application/json' -d '{body}'\n"
                )
            print(
                f"\nserving: registry {registry_target}, scheduler {scheduler_target}, "
                f"kvbroker {kvbroker_target}"
                + (f", gateway {front_url}" if front_url else "")
                + "; try\n"
                f"  grpcurl -plaintext {scheduler_target} list\n"
                f"  grpcurl -plaintext -d '{{\"page_size\": 5}}' {scheduler_target} "
                "hetero_pd.v1.SchedulerService/ListRouteRecords\n"
                f"{curl}"
                "Ctrl-C to stop",
                file=out,
                flush=True,
            )
            await (stop_event or asyncio.Event()).wait()
        return DemoResult(report, records, status, route, sessions)
    finally:
        if live is not None:
            await live.stop()
        if front is not None:
            await asyncio.to_thread(front.stop)
        await fleet.stop()
        if fleet_http is not None:
            await fleet_http.stop()
        for ch in channels:
            await ch.close()
        if cp is not None:
            await cp.stop()


async def _route_records(
    stub: s_grpc.SchedulerServiceStub, since_ms: int, prefix: str
) -> list[s.RouteRecord]:
    for attempt in range(20):
        try:
            return await list_route_records(stub, since_ms, prefix)
        except grpc.aio.AioRpcError:
            if attempt == 19:
                raise
            await asyncio.sleep(0.5)
    return []


async def _killed_sessions(
    stub: kb_grpc.KvBrokerServiceStub, fleet: Fleet
) -> dict[str, list[kb.KvSession]]:
    out: dict[str, list[kb.KvSession]] = {}
    for w in fleet:
        if not w.killed:
            continue
        found: list[kb.KvSession] = []
        token = ""
        while True:
            resp = await stub.ListSessions(
                kb.ListSessionsRequest(worker_id=w.worker_id, page_size=1000, page_token=token),
                timeout=10,
            )
            found += list(resp.sessions)
            token = resp.next_page_token
            if not token:
                break
        out[w.worker_id] = found
    return out


async def _restart(redis: EmbeddedRedis) -> None:
    await asyncio.to_thread(redis.start)


def _config_dict(cfg: GatewayConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in cfg.__slots__}


# The default replay's rate: a ramp from the trace's own rate to 9 x it. Measured on the
# demo fleet with `hpd demo --rate-scale X --time-scale 3`: at x1 every request took the
# fastest pair (H100 prefill -> A100 decode) and met its SLOs; at x5 all five pools served
# and 30% of requests recomputed on the other zone's decode pools (76% SLO attainment); at
# x10 the memory ladder acted (batch caps, shedding, throttling; 28%). The ramp shows the first
# two regimes in one replay (measured: all 5 pools, about 60% transfer and 40% recompute, SLO
# attainment about 73%) and stops short of the third. It is a demonstration setting, not a
# policy constant.
DEFAULT_RAMP = (1.0, 9.0)


def _rate_scale(text: str) -> tuple[float, float | None]:
    """``X`` or ``X:Y`` (a ramp) -> (X, Y or None); both > 0."""
    parts = text.split(":")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected X or X:Y (numbers), got {text!r}") from None
    if len(values) not in (1, 2) or not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected X or X:Y, both > 0, got {text!r}")
    return values[0], (values[1] if len(values) == 2 else None)


def _rate_words(opts: DemoOptions) -> str:
    if opts.rate_scale_end is None:
        return f"x{opts.rate_scale:g}"
    return f"rising x{opts.rate_scale:g} -> x{opts.rate_scale_end:g}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpd demo",
        description="Run the control plane with an emulated heterogeneous fleet and replay a "
        "request trace through it; report per tier; then serve until Ctrl-C.",
    )
    p.add_argument(
        "--real", action="store_true",
        help="real vLLM engines (CPU build, NIXL) instead of the emulated fleet; see "
        "`hpd demo --real --help`",
    )  # fmt: skip
    p.add_argument("--trace", default="", help="Azure CSV or Mooncake JSONL (default: Azure conv)")
    p.add_argument("--cluster", default="", help="cluster YAML (default: the demo fleet)")
    p.add_argument(
        "--rate-scale", type=_rate_scale, default=(DEFAULT_RAMP[0], DEFAULT_RAMP[1]),
        metavar="X[:Y]",
        help="replay at X x the trace's rate, or rising from X x to Y x over the replay"
        f" (default {DEFAULT_RAMP[0]:g}:{DEFAULT_RAMP[1]:g}: light load first, on the fastest"
        " pair; then the fast pools queue and requests spread over the other pools)",
    )  # fmt: skip
    p.add_argument("--duration", type=float, default=30.0, help="seconds of trace to replay")
    p.add_argument("--time-scale", type=float, default=1.0, help="run this x faster than real time")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=".hpd/demo", help="directory for report.json and plots")
    p.add_argument("--no-serve", action="store_true", help="exit after the report")
    p.add_argument("--no-live", action="store_true", help="no live progress table")
    p.add_argument("--redis-url", default="", help="use this Redis instead of an embedded one")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--registry-port", type=int, default=50051)
    p.add_argument("--scheduler-port", type=int, default=50052)
    p.add_argument("--kvbroker-port", type=int, default=50053)
    p.add_argument("--lease-ttl-ms", type=int, default=3_000, help="worker lease")
    p.add_argument(
        "--fault-at", type=float, default=0.3, help="faults fire at this share of the replay"
    )
    p.add_argument("--kill-worker", nargs="?", const="auto", default=None, metavar="WORKER",
                   help="kill a worker mid-run (default: the busiest decode worker)")  # fmt: skip
    p.add_argument("--slow-link", nargs="?", const="auto", default=None, metavar="SRC>DST[=F]",
                   help="cut a pool pair's bandwidth F-fold (default 10, busiest)")  # fmt: skip
    p.add_argument("--fill-pool", nargs="?", const="auto", default=None, metavar="POOL[=FRAC]",
                   help="fill a decode pool's KV memory (default 0.97; busiest pool)")  # fmt: skip
    p.add_argument("--stop-redis", nargs="?", const="3", default=None, metavar="SECONDS",
                   help="stop the embedded Redis for a few seconds (default 3)")  # fmt: skip
    p.add_argument(
        "--attach",
        default="",
        metavar="REGISTRY,SCHEDULER,KVBROKER",
        help="attach the fleet and the replay to a running control plane at these host:port "
        "addresses instead of starting one; exits after the report",
    )
    path = p.add_mutually_exclusive_group()
    path.add_argument(
        "--via-gateway", action="store_true",
        help="send every request as an OpenAI client would, over HTTP through `hpd gateway`"
        " (a process of its own, the front door real engines sit behind) to emulated engines"
        " speaking vLLM's HTTP protocol and KV hand-off. The default in real time without"
        " --attach",
    )  # fmt: skip
    path.add_argument(
        "--in-process", action="store_true",
        help="execute plans inside this process instead of through the gateway (the default"
        " with --time-scale or --attach: the gateway times requests by the wall clock)",
    )  # fmt: skip
    p.add_argument(
        "--gateway-port", type=int, default=0,
        help="the gateway's port when requests go through it (default: any free one)",
    )  # fmt: skip
    p.add_argument("--log-level", default="error")
    return p


def options_from(args: argparse.Namespace) -> DemoOptions:
    if args.via_gateway and args.time_scale != 1.0:
        raise ValueError(
            "--via-gateway runs in real time (the gateway times requests by the wall clock): "
            "drop --time-scale, or add --in-process"
        )
    # through the real front door unless time is scaled or the plane is someone else's (its
    # gateway, tokens and certificates are the operator's to run)
    via_gateway = args.via_gateway or (
        not args.in_process and args.time_scale == 1.0 and not args.attach
    )
    at = max(0.0, args.fault_at) * args.duration / args.time_scale
    faults = []
    for kind, value in (
        ("kill_worker", args.kill_worker),
        ("slow_link", args.slow_link),
        ("fill_pool", args.fill_pool),
        ("stop_redis", args.stop_redis),
    ):
        if value is not None:
            faults.append(parse_fault(kind, value, at))
    return DemoOptions(
        trace=Path(args.trace) if args.trace else default_trace_path(),
        cluster=Path(args.cluster) if args.cluster else default_cluster_path(),
        rate_scale=args.rate_scale[0],
        rate_scale_end=args.rate_scale[1],
        duration_s=args.duration,
        time_scale=args.time_scale,
        max_requests=args.max_requests,
        seed=args.seed,
        out=Path(args.out) if args.out else None,
        serve=not args.no_serve,
        live=not args.no_live,
        host=args.host,
        registry_port=args.registry_port,
        scheduler_port=args.scheduler_port,
        kvbroker_port=args.kvbroker_port,
        lease_ttl_ms=args.lease_ttl_ms,
        faults=tuple(faults),
        log_level=args.log_level,
        attach=_attach(args.attach),
        via_gateway=via_gateway,
        gateway_port=args.gateway_port,
    )


def _attach(text: str) -> tuple[str, str, str] | None:
    if not text:
        return None
    parts = [t.strip() for t in text.split(",")]
    if len(parts) != 3 or not all(":" in t for t in parts):
        raise ValueError("--attach wants REGISTRY,SCHEDULER,KVBROKER as three host:port")
    return parts[0], parts[1], parts[2]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--real" in argv:  # real vLLM engines instead of the emulated fleet
        from .real_demo import main as real_main

        return real_main([a for a in argv if a != "--real"])
    args = parser().parse_args(argv)
    configure_logging(args.log_level, json_logs=False)
    try:
        opts = options_from(args)
    except ValueError as exc:
        print(f"hpd demo: {exc}", file=sys.stderr)
        return 2
    if (args.redis_url or opts.attach) and args.stop_redis is not None:
        print("hpd demo: --stop-redis needs the embedded Redis (drop --redis-url)", file=sys.stderr)
        return 2

    async def go(url: str, redis: EmbeddedRedis | None) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        result = await run_demo(opts, url, redis, stop_event=stop)
        return result.status

    if args.redis_url or opts.attach:
        return asyncio.run(go(args.redis_url, None))
    with (
        tempfile.TemporaryDirectory(prefix="hpd-demo-") as state,
        EmbeddedRedis(Path(state), persist=True) as redis,
    ):
        return asyncio.run(go(redis.url, redis))


if __name__ == "__main__":
    raise SystemExit(main())
