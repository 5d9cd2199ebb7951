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
or ``--attach``), plans are executed in this process (``hpd_fleet.gateway``). One run is
``hpd_fleet.demo_run``. It shows a live
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
import contextlib
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hpd_common.logging import configure_logging, get_logger
from hpd_tools.embedded_redis import EmbeddedRedis

from .attach import role_identity
from .demo_run import DemoOptions, default_trace_path, run_demo
from .faults import parse_fault
from .fleet import default_cluster_path

__all__ = ["main", "options_from", "parser"]

log = get_logger("demo")


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
    p.add_argument(
        "--tls-dir",
        default="",
        metavar="DIR",
        help="with --attach, speak mutual TLS to a control plane whose certificates `hpd "
        "certs DIR` wrote (the compose stack's default): the fleet presents DIR/role-worker.pem"
        " to the registry and the KV broker, the replay DIR/role-gateway.pem to the scheduler",
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
    if args.tls_dir and not args.attach:
        raise ValueError("--tls-dir names the certificates of the plane --attach reaches")
    if args.tls_dir and args.via_gateway:
        raise ValueError(
            "--tls-dir with --via-gateway: the plane's own gateway speaks for it; run the "
            "replay --in-process"
        )
    for role in ("worker", "gateway") if args.tls_dir else ():
        role_identity(Path(args.tls_dir), role)  # ValueError naming a missing file
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
        tls_dir=Path(args.tls_dir) if args.tls_dir else None,
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
