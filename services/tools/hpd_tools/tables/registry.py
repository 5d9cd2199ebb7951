"""`hpd workers` and `hpd pools`: tables from a running registry, as `kubectl get` prints;
`hpd watch`: the registry's change feed, one line per event."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.channels import CallIdentity, sync_channel
from hpd_tools.tables import age, render


def _gib(n: int) -> str:
    return f"{n / 2**30:.0f}Gi"


def _stages(stages: Sequence[int]) -> str:
    names: dict[int, str] = {c.STAGE_PREFILL: "prefill", c.STAGE_DECODE: "decode"}
    return ",".join(names.get(s, "?") for s in stages) or "-"


def _health(h: int) -> str:
    return c.HealthState.Name(h).removeprefix("HEALTH_STATE_")


def worker_rows(workers: Sequence[c.Worker], now_ms: int) -> list[list[str]]:
    rows = []
    for w in workers:
        cap, st = w.capability, w.status
        load = w.load if w.HasField("load") else None
        kv = "-"
        if load and load.kv_blocks_total:
            kv = f"{100 * (1 - load.kv_blocks_free / load.kv_blocks_total):.0f}%"
        rows.append([
            cap.worker_id, cap.pool_id, _stages(cap.stages), f"{cap.gpu_count}x{cap.gpu_type}",
            str(cap.tp_size), _health(st.health),
            str(load.queue_depth) if load else "-",
            f"{load.batch_size}/{cap.max_batch_size}" if load else f"-/{cap.max_batch_size}",
            kv, age(st.last_heartbeat_unix_ms, now_ms), age(st.registered_at_unix_ms, now_ms),
        ])  # fmt: skip
    return rows


WORKER_HEADERS = [
    "NAME",
    "POOL",
    "STAGES",
    "GPUS",
    "TP",
    "HEALTH",
    "QUEUE",
    "BATCH",
    "KV",
    "SEEN",
    "AGE",
]
POOL_HEADERS = [
    "POOL",
    "MODEL",
    "STAGES",
    "GPU",
    "WORKERS",
    "HEALTHY",
    "GPUS",
    "KV",
    "GPU-UTIL",
    "QUEUE",
]


def pool_rows(pools: Sequence[c.PoolSummary]) -> list[list[str]]:
    return [
        [
            p.pool_id,
            p.model_id,
            _stages(p.stages),
            p.gpu_type,
            str(p.worker_count),
            str(p.workers_by_health.get("HEALTHY", 0)),
            str(p.gpu_count),
            _gib(p.kv_memory_total_bytes),
            f"{100 * p.gpu_util_mean:.0f}%",
            str(p.queue_depth_total),
        ]
        for p in pools
    ]


WATCH_KINDS = {
    name.removeprefix("WATCH_EVENT_TYPE_").lower(): value
    for name, value in r.WatchEventType.items()
    if value != r.WATCH_EVENT_TYPE_UNSPECIFIED
}


def watch_kinds(text: str) -> list[int]:
    """``put,delete`` -> the event types; an unknown name is an error naming the known ones."""
    out = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in WATCH_KINDS:
            raise argparse.ArgumentTypeError(
                f"unknown event kind {name!r} (known: {', '.join(WATCH_KINDS)})"
            )
        out.append(WATCH_KINDS[name])
    return out


def event_line(ev: r.WorkerEvent) -> str:
    """One event as a line: revision, kind, worker and what the kind says."""
    kind = r.WatchEventType.Name(ev.type).removeprefix("WATCH_EVENT_TYPE_").lower()
    w = ev.worker
    if ev.type in (r.WATCH_EVENT_TYPE_SNAPSHOT, r.WATCH_EVENT_TYPE_PUT):
        what = f"pool={w.capability.pool_id} health={_health(w.status.health).lower()}"
    elif ev.type == r.WATCH_EVENT_TYPE_LOAD:
        ld = w.load
        what = f"queue={ld.queue_depth} batch={ld.batch_size} kv_free_blocks={ld.kv_blocks_free}"
    elif ev.type == r.WATCH_EVENT_TYPE_DELETE:
        what = f"reason={ev.reason or '-'}"
    else:
        what = ev.reason
    return f"{ev.revision:>8}  {kind:<12} {ev.worker_id or '-':<20} {what}".rstrip()


def watch_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="hpd watch",
        description="Follow the registry's change feed (WatchWorkers), one line per event.",
        epilog="examples:\n"
        "  hpd watch                        # snapshot, then every change\n"
        "  hpd watch --kind put,delete      # registrations, health changes, departures\n"
        "  hpd watch --kind load --model llama-3-8b -o json\n"
        f"kinds: {', '.join(WATCH_KINDS)} (a resync always comes through)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--registry",
        default=os.environ.get("HPD_REGISTRY", "127.0.0.1:50051"),
        help="registry address host:port (env HPD_REGISTRY)",
    )
    p.add_argument("--model", default="", help="only workers of this model")
    p.add_argument(
        "--kind", type=watch_kinds, default=[], help="only these event kinds, comma-separated"
    )
    p.add_argument("--from-revision", type=int, default=0, help="replay after this revision")
    p.add_argument(
        "--count", type=int, default=0, help="stop after this many events of the kinds asked for"
    )
    p.add_argument("-o", "--output", choices=["line", "json"], default="line")
    args = p.parse_args(argv)
    seen = 0
    try:
        with sync_channel(args.registry, CallIdentity.from_env()) as channel:
            stream = r_grpc.RegistryServiceStub(channel).WatchWorkers(
                r.WatchWorkersRequest(
                    from_revision=args.from_revision, model_id=args.model, event_types=args.kind
                ),
                wait_for_ready=True,
            )
            asked = set(args.kind)
            for resp in stream:
                for ev in resp.events:
                    # the registry always sends snapshot_end and resync; a person asked for
                    # other kinds, and sees only a resync (the view starts over)
                    if asked and ev.type not in asked and ev.type != r.WATCH_EVENT_TYPE_RESYNC:
                        continue
                    if args.output == "json":
                        doc = MessageToDict(ev, preserving_proto_field_name=True)
                        print(json.dumps(doc, separators=(",", ":")), flush=True)
                    else:
                        print(event_line(ev), flush=True)
                    seen += not asked or ev.type in asked
                    if args.count and seen >= args.count:
                        stream.cancel()
                        return 0
    except KeyboardInterrupt:
        return 0
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and args.count and seen >= args.count:
            return 0
        print(f"hpd watch: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


WIDE_HEADERS = ["ITL", "PREFILL (LEARNED)", "DECODE STEP (LEARNED)"]


def learned_text(e: s.WorkerEstimate | None) -> str:
    """``62ms/req + 31x declared, 0.4 queued (12)``: a worker's learned prefill speed (the
    fixed cost of a request, the compute time over the declared one, the share of its fixed
    cost each queued request adds; ``-`` before it has one, ``?`` when the scheduler did
    not answer)."""
    if e is None:
        return "?"
    if not e.learned_prefill_samples:
        return "- (declared)"
    return (
        f"{e.learned_prefill_fixed_ms:.0f}ms/req + {e.learned_prefill_scale:.3g}x declared, "
        f"{e.learned_prefill_queue_share:.2g} queued ({e.learned_prefill_samples})"
    )


def learned_step_text(e: s.WorkerEstimate | None) -> str:
    """``3.1x declared + 0.42ms/seq (9)``: a worker's learned decode step (``-`` before it
    has one, ``?`` when the scheduler did not answer)."""
    if e is None:
        return "?"
    if not e.learned_decode_samples:
        return "- (declared)"
    return (
        f"{e.learned_decode_scale:.3g}x declared + {e.learned_decode_seq_ms:.2f}ms/seq "
        f"({e.learned_decode_samples})"
    )


def wide_rows(
    workers: Sequence[c.Worker],
    rows: list[list[str]],
    estimates: dict[str, s.WorkerEstimate] | None,
) -> list[list[str]]:
    """``rows`` with the scheduler's figures per worker (``WIDE_HEADERS``)."""
    out = []
    for w, row in zip(workers, rows, strict=True):
        wid = w.capability.worker_id
        load = w.load if w.HasField("load") else None
        itl = f"{load.itl_p50_ms:.1f}ms" if load and load.itl_p50_ms else "-"
        if estimates is None:
            est: s.WorkerEstimate | None = None
        else:
            est = estimates.get(wid, s.WorkerEstimate(worker_id=wid))
        out.append([*row, itl, learned_text(est), learned_step_text(est)])
    return out


def _estimates(target: str, timeout: float) -> dict[str, s.WorkerEstimate] | None:
    """The scheduler's per-worker figures (GetRecommendations); None when it does not
    answer (said on stderr; the registry's columns still print)."""
    try:
        with sync_channel(target, CallIdentity.from_env()) as channel:
            resp = s_grpc.SchedulerServiceStub(channel).GetRecommendations(
                s.GetRecommendationsRequest(), timeout=timeout
            )
    except grpc.RpcError as exc:
        print(f"hpd workers: scheduler {target}: {exc.code().name}: {exc.details()}",
              file=sys.stderr)  # fmt: skip
        return None
    return {w.worker_id: w for w in resp.workers}


def main(argv: Sequence[str]) -> int:
    what, rest = argv[0], argv[1:]
    if what == "watch":
        return watch_main(rest)
    p = argparse.ArgumentParser(prog=f"hpd {what}", description=f"List the {what} of a registry.")
    p.add_argument(
        "--registry",
        default=os.environ.get("HPD_REGISTRY", "127.0.0.1:50051"),
        help="registry address host:port (env HPD_REGISTRY)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds")
    outputs = ["table", "wide", "json"] if what == "workers" else ["table", "json"]
    p.add_argument(
        "-o",
        "--output",
        choices=outputs,
        default="table",
        help="table; wide: and the scheduler's measured figures per worker (its prefill speed "
        "learned from outcomes, ITL); json",
    )
    p.add_argument("--model", default="", help="only this model")
    if what == "workers":
        p.add_argument("--pool", default="", help="only this pool")
        p.add_argument(
            "--scheduler",
            default=os.environ.get("HPD_SCHEDULER", "127.0.0.1:50052"),
            help="scheduler host:port for -o wide (env HPD_SCHEDULER)",
        )
    args = p.parse_args(rest)
    try:
        with sync_channel(args.registry, CallIdentity.from_env()) as channel:
            stub = r_grpc.RegistryServiceStub(channel)
            if what == "workers":
                workers: list[c.Worker] = []
                token = ""
                while True:
                    resp = stub.ListWorkers(
                        r.ListWorkersRequest(
                            pool_id=args.pool, model_id=args.model, page_size=1000, page_token=token
                        ),
                        timeout=args.timeout,
                    )
                    workers += resp.workers
                    token = resp.next_page_token
                    if not token:
                        break
                if args.output == "json":
                    print(
                        json.dumps(
                            [MessageToDict(w, preserving_proto_field_name=True) for w in workers],
                            indent=2,
                        )
                    )
                elif args.output == "wide":
                    rows = worker_rows(workers, int(time.time() * 1000))
                    est = _estimates(args.scheduler, args.timeout)
                    print(render(WORKER_HEADERS + WIDE_HEADERS, wide_rows(workers, rows, est)))
                else:
                    print(render(WORKER_HEADERS, worker_rows(workers, int(time.time() * 1000))))
            else:
                pools = stub.ListPools(
                    r.ListPoolsRequest(model_id=args.model), timeout=args.timeout
                )
                if args.output == "json":
                    print(
                        json.dumps(MessageToDict(pools, preserving_proto_field_name=True), indent=2)
                    )
                else:
                    print(render(POOL_HEADERS, pool_rows(pools.pools)))
    except grpc.RpcError as exc:
        print(f"hpd {what}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0
