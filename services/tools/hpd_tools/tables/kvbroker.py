"""`hpd sessions` and `hpd compat MODEL`: tables from a running KV broker.

`main(["sessions", ...])` lists KV transfer sessions (filters: --state, --worker);
`main(["compat", MODEL, ...])` prints the model's prefill x decode compatibility matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import grpc
from google.protobuf.json_format import MessageToDict

from hetero_pd.v1 import kvbroker_pb2 as k
from hetero_pd.v1 import kvbroker_pb2_grpc as k_grpc
from hpd_common.channels import CallIdentity, sync_channel
from hpd_tools.tables import render

SESSION_HEADERS = [
    "SESSION",
    "REQUEST",
    "STATE",
    "SOURCE",
    "DESTINATION",
    "PROGRESS",
    "DEADLINE",
    "AGE",
    "REASON",
]
COMPAT_HEADERS = ["PREFILL", "DECODE", "VERDICT", "MS/GIB", "REASONS"]


def _state(value: int) -> str:
    return k.SessionState.Name(value).removeprefix("SESSION_STATE_")


def _verdict(value: int) -> str:
    return k.CompatibilityVerdict.Name(value).removeprefix("COMPATIBILITY_VERDICT_")


def _bytes(n: int) -> str:
    for unit, size in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def _seconds(ms: int) -> str:
    s = ms // 1000
    if abs(s) < 120:
        return f"{s}s"
    if abs(s) < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h"


def session_rows(sessions: Sequence[k.KvSession], now_ms: int) -> list[list[str]]:
    rows = []
    for s in sessions:
        pct = 100 * s.bytes_done / s.expected_bytes if s.expected_bytes else 0.0
        open_ = s.state in (
            k.SESSION_STATE_NEGOTIATED,
            k.SESSION_STATE_RESERVED,
            k.SESSION_STATE_TRANSFERRING,
        )
        rows.append([
            s.session_id, s.request_id, _state(s.state), s.source_worker_id,
            s.destination_worker_id, f"{_bytes(s.bytes_done)}/{_bytes(s.expected_bytes)} "
            f"({pct:.0f}%)", f"in {_seconds(s.deadline_unix_ms - now_ms)}" if open_ else "-",
            _seconds(now_ms - s.created_at_unix_ms), s.reason or "-",
        ])  # fmt: skip
    return rows


def compat_rows(resp: k.GetCompatibilityMatrixResponse) -> list[list[str]]:
    return [
        [
            p.prefill_worker_id,
            p.decode_worker_id,
            _verdict(p.negotiation.verdict),
            f"{p.negotiation.cost_ms_per_gib:g}",
            ",".join(p.negotiation.reasons) or "-",
        ]
        for p in resp.pairs
    ]


def _list_sessions(stub: k_grpc.KvBrokerServiceStub, args: argparse.Namespace) -> int:
    if args.limit < 1:
        print(f"hpd sessions: --limit must be at least 1, got {args.limit}", file=sys.stderr)
        return 2
    state: int = k.SESSION_STATE_UNSPECIFIED
    if args.state:
        try:
            state = k.SessionState.Value("SESSION_STATE_" + args.state.upper())
        except ValueError:
            print(f"hpd sessions: unknown state {args.state!r}", file=sys.stderr)
            return 2
    sessions: list[k.KvSession] = []
    token = ""
    while True:
        resp = stub.ListSessions(
            k.ListSessionsRequest(
                state=state,  # type: ignore[arg-type]
                worker_id=args.worker,
                page_size=min(1000, args.limit - len(sessions)),
                page_token=token,
            ),
            timeout=args.timeout,
        )
        sessions += resp.sessions
        token = resp.next_page_token
        if not token or len(sessions) >= args.limit:
            break
    if args.output == "json":
        print(
            json.dumps(
                [MessageToDict(s, preserving_proto_field_name=True) for s in sessions], indent=2
            )
        )
    else:
        print(render(SESSION_HEADERS, session_rows(sessions, int(time.time() * 1000))))
    return 0


def _compat(stub: k_grpc.KvBrokerServiceStub, args: argparse.Namespace) -> int:
    resp = stub.GetCompatibilityMatrix(
        k.GetCompatibilityMatrixRequest(model_id=args.model), timeout=args.timeout
    )
    if args.output == "json":
        print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True), indent=2))
    else:
        print(render(COMPAT_HEADERS, compat_rows(resp)))
    return 0


def main(argv: Sequence[str]) -> int:
    what, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(
        prog=f"hpd {what}",
        description="List KV transfer sessions."
        if what == "sessions"
        else "Print a model's prefill x decode KV compatibility matrix.",
    )
    p.add_argument(
        "--kvbroker",
        default=os.environ.get("HPD_KVBROKER", "127.0.0.1:50053"),
        help="KV broker address host:port (env HPD_KVBROKER)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="RPC deadline in seconds")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    if what == "sessions":
        p.add_argument("--state", default="", help="only this state, e.g. transferring")
        p.add_argument("--worker", default="", help="only sessions of this worker")
        p.add_argument("--limit", type=int, default=10_000, help="stop after this many")
    else:
        p.add_argument("model", help="model id")
    args = p.parse_args(rest)
    try:
        with sync_channel(args.kvbroker, CallIdentity.from_env()) as channel:
            stub = k_grpc.KvBrokerServiceStub(channel)
            return _list_sessions(stub, args) if what == "sessions" else _compat(stub, args)
    except grpc.RpcError as exc:
        print(f"hpd {what}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
