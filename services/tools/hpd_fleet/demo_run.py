"""One `hpd demo` run (``hpd_fleet.demo`` is the command): the control plane (or the one
``--attach`` names), the emulated fleet, the replay through ``hpd gateway`` or in this
process, the faults, the live view, the report and its cross-check against the route
records in Redis; then serving until Ctrl-C when asked."""

from __future__ import annotations

import asyncio
import collections
import json
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
from hpd_common.logging import get_logger
from hpd_sim.cluster import ClusterSpec, load_cluster
from hpd_sim.metrics import Slo
from hpd_sim.traces import Trace, load_trace, reshape
from hpd_tools.controlplane import ControlPlane, ControlPlaneSettings
from hpd_tools.embedded_redis import EmbeddedRedis

from .attach import plane_channels, wait_fleet_registered
from .demo_checks import killed_sessions, reconcile, route_records
from .engine import EmuTime
from .engine_http import FleetHttp
from .faults import Fault, FaultInjector
from .fleet import Fleet
from .gateway import Gateway
from .live import LiveView
from .real_processes import AgentProcess, pick_port, wait_http
from .replay import HttpReplay
from .replay_common import GatewayConfig, Replay, RequestRecord
from .report import build_report, format_report, plot_report, write_report

__all__ = [
    "DemoOptions",
    "DemoResult",
    "default_trace_path",
    "run_demo",
    "wait_fleet_seen",
]

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
    # the attached plane's certificates (`hpd certs`): speak mutual TLS as its roles
    tls_dir: Path | None = None
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
    cp, targets = await _control_plane(opts, redis_url)
    channels = plane_channels(targets, opts.tls_dir)
    reg_ch, kb_ch, sch_ch = channels
    emu = EmuTime(opts.time_scale, time.monotonic, asyncio.sleep, start=time.monotonic())
    fleet = Fleet(
        cluster, reg_ch, kb_ch, emu, clock, random.Random(rng.random()),
        lease_ttl_ms=opts.lease_ttl_ms,
        timing=ClientTiming(report_interval_s=opts.report_interval_s),
    )  # fmt: skip
    stub = s_grpc.SchedulerServiceStub(sch_ch)
    fleet_http = FleetHttp(fleet, opts.host) if opts.via_gateway else None
    front: AgentProcess | None = None
    try:
        if fleet_http is not None:
            await fleet_http.start()
        await fleet.start()
        if cp is not None:
            await wait_fleet_seen(cp, list(fleet.workers), timeout_s=15)
        else:
            await wait_fleet_registered(reg_ch, sch_ch, list(fleet.workers), timeout_s=60)
        tier_slos = await _tiers(stub)
        run_id = f"demo{clock.now_ms() % 10**10:010d}"
        gateway, front = await _replay_of(
            opts, targets, cluster, tier_slos, fleet, sch_ch, emu, rng, run_id, out
        )
        print(
            f"hpd demo: {len(fleet.workers)} emulated workers in {len(fleet.pools())} pools "
            f"({cluster.gpus} GPUs, ${cluster.price_per_hour:.2f}/h assumed); replaying "
            f"{len(trace)} requests of {Path(opts.trace).name} over {opts.duration_s:g} s "
            f"(rate {_rate_words(opts)}, time x{opts.time_scale:g})",
            file=out,
            flush=True,
        )
        records, replay_s, injector, since_ms = await _replay_trace(
            gateway, fleet, trace, redis, emu, clock, opts, out
        )
        await asyncio.sleep(0.3)  # the last outcomes land in Redis
        route = await route_records(stub, since_ms, run_id)
        check = reconcile(records, route)
        sessions = await killed_sessions(kb_grpc.KvBrokerServiceStub(kb_ch), fleet)
        extra = _report_extra(opts, cluster, run_id, injector, gateway, check, sessions, fleet)
        report = build_report(records, tier_slos, replay_s, cluster.price_per_hour, extra=extra)
        status = 0 if report["accounting"]["accounted"] and check["agree"] else 1
        _print_report(report, records, check, opts, out)
        if opts.serve and cp is not None:
            await _serve(gateway, cluster, targets, out, stop_event or asyncio.Event())
        return DemoResult(report, records, status, route, sessions)
    finally:
        if front is not None:
            await asyncio.to_thread(front.stop)
        await fleet.stop()
        if fleet_http is not None:
            await fleet_http.stop()
        for ch in channels:
            await ch.close()
        if cp is not None:
            await cp.stop()


async def _replay_trace(
    gateway: Replay,
    fleet: Fleet,
    trace: Trace,
    redis: EmbeddedRedis | None,
    emu: EmuTime,
    clock: SystemClock,
    opts: DemoOptions,
    out: TextIO,
) -> tuple[list[RequestRecord], float, FaultInjector, int]:
    """The trace through ``gateway`` with the run's faults injected and the live view on.
    Returns the records, the replay's emulated seconds, the injector (what it applied) and
    when the replay began (Unix ms less a second: the window its route records are in)."""
    injector = FaultInjector(
        fleet,
        gateway,
        stop_redis=(lambda: asyncio.to_thread(redis.stop)) if redis is not None else None,
        start_redis=(lambda: _restart(redis)) if redis is not None else None,
    )
    live = LiveView(gateway, fleet, out) if opts.live else None
    if live is not None:
        live.start()
    try:
        since_ms = clock.now_ms() - 1_000
        emu_start = emu.now_ms()
        fault_task = asyncio.create_task(injector.run(list(opts.faults)))
        records = await gateway.run(trace)
        await fault_task
        return records, (emu.now_ms() - emu_start) / 1000.0, injector, since_ms
    finally:
        if live is not None:
            await live.stop()


async def _control_plane(
    opts: DemoOptions, redis_url: str
) -> tuple[ControlPlane | None, tuple[str, str, str]]:
    """The control plane this run starts (None with ``--attach``) and the (registry,
    scheduler, kvbroker) targets the run talks to."""
    if opts.attach is not None:
        return None, opts.attach
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
    return cp, (cp.registry_target, cp.scheduler_target, cp.kvbroker_target)


async def _replay_of(
    opts: DemoOptions,
    targets: tuple[str, str, str],
    cluster: ClusterSpec,
    tier_slos: dict[str, Slo],
    fleet: Fleet,
    sch_ch: grpc.aio.Channel,
    emu: EmuTime,
    rng: random.Random,
    run_id: str,
    out: TextIO,
) -> tuple[Replay, AgentProcess | None]:
    """The replay this run sends its trace through: over HTTP to an ``hpd gateway`` it
    starts (returned with it, to stop), or plans executed in this process. Its tier mix is
    the configured one, restricted to the tiers the scheduler has."""
    mix = tuple((t, w) for t, w in opts.gateway.tier_mix if t in tier_slos) or tuple(
        (t, 1.0) for t in tier_slos
    )
    gw_config = GatewayConfig(
        **{**_config_dict(opts.gateway), "tier_mix": mix, "model_id": cluster.model.name}
    )
    if not opts.via_gateway:
        return Gateway(sch_ch, fleet, emu, random.Random(rng.random()), gw_config, run_id), None
    front, url = await _start_gateway(opts, targets, opts.out)
    replay = HttpReplay(url, sch_ch, emu, random.Random(rng.random()), gw_config, run_id=run_id)
    print(f"hpd demo: requests go through hpd gateway at {url}", file=out, flush=True)
    return replay, front


def _report_extra(
    opts: DemoOptions,
    cluster: ClusterSpec,
    run_id: str,
    injector: FaultInjector,
    gateway: Replay,
    check: dict[str, Any],
    sessions: dict[str, list[kb.KvSession]],
    fleet: Fleet,
) -> dict[str, Any]:
    """What the report says about the run beside its requests: settings, faults applied,
    the route records' cross-check, the killed workers' sessions, every worker."""
    return {
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
    }


def _print_report(
    report: dict[str, Any],
    records: Sequence[RequestRecord],
    check: dict[str, Any],
    opts: DemoOptions,
    out: TextIO,
) -> None:
    """The report, the route records' verdict, and the files written under ``--out``."""
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


async def _serve(
    gateway: Replay,
    cluster: ClusterSpec,
    targets: tuple[str, str, str],
    out: TextIO,
    stop_event: asyncio.Event,
) -> None:
    """Say where the services (and the gateway) answer, with commands to try, and serve
    until ``stop_event``."""
    registry_target, scheduler_target, kvbroker_target = targets
    curl, front_url = "", ""
    if isinstance(gateway, HttpReplay):
        front_url = gateway.url
        body = json.dumps({"model": cluster.model.name, "prompt": "Hello there", "max_tokens": 8})
        curl = (
            f"  curl -s {gateway.url}/v1/completions -H 'content-type: "
            f"application/json' -d '{body}'\n"
        )
    print(
        f"\nserving: registry {registry_target}, scheduler {scheduler_target}, "
        f"kvbroker {kvbroker_target}" + (f", gateway {front_url}" if front_url else "") + "; try\n"
        f"  grpcurl -plaintext {scheduler_target} list\n"
        f"  grpcurl -plaintext -d '{{\"page_size\": 5}}' {scheduler_target} "
        "hetero_pd.v1.SchedulerService/ListRouteRecords\n"
        f"{curl}"
        "Ctrl-C to stop",
        file=out,
        flush=True,
    )
    await stop_event.wait()


async def _restart(redis: EmbeddedRedis) -> None:
    await asyncio.to_thread(redis.start)


def _config_dict(cfg: GatewayConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in cfg.__slots__}


def _rate_words(opts: DemoOptions) -> str:
    if opts.rate_scale_end is None:
        return f"x{opts.rate_scale:g}"
    return f"rising x{opts.rate_scale:g} -> x{opts.rate_scale_end:g}"
