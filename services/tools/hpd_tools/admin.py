"""Operator commands: ``hpd drain | cordon | uncordon | deregister WORKER`` and
``hpd token ROLE``.

The worker commands call the registry as the caller ``HPD_TOKEN`` names (an operator's
token when the plane runs with auth; nothing when it does not), over TLS when
``HPD_CA_FILE`` is set, and print the worker's state after the change. Each is one
audited call at the registry. ``hpd token ROLE`` prints the token ``hpd up --auth`` made
for a role, for ``export HPD_TOKEN=$(hpd token operator)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common import auth
from hpd_common.channels import CallIdentity, sync_channel

WORKER_COMMANDS = ("drain", "cordon", "uncordon", "deregister")


def parser(command: str) -> argparse.ArgumentParser:
    if command == "token":
        p = argparse.ArgumentParser(
            prog="hpd token",
            description="Print the token `hpd up --auth` made for a role.",
            epilog="e.g. export HPD_TOKEN=$(hpd token operator)",
        )
        p.add_argument("role", choices=[x.value for x in auth.Role])
        p.add_argument("--state-dir", default=".hpd", help="hpd up's --state-dir")
        p.add_argument("--tokens-file", default="", help="read this tokens file instead")
        return p
    what = {
        "drain": "finish in-flight work, take no new work, and leave once idle",
        "cordon": "take no new work (stays registered)",
        "uncordon": "clear cordon and drain",
        "deregister": "take the worker out of the fleet now (an operator's token when auth is on)",
    }[command]
    p = argparse.ArgumentParser(
        prog=f"hpd {command}",
        description=f"Tell the registry: worker WORKER should {what}.",
        epilog="The caller is HPD_TOKEN's (HPD_CA_FILE, HPD_CERT_FILE, HPD_KEY_FILE for TLS).",
    )
    p.add_argument("worker_id", metavar="WORKER")
    p.add_argument(
        "--registry",
        default=os.environ.get("HPD_REGISTRY", "127.0.0.1:50051"),
        help="registry host:port (env HPD_REGISTRY)",
    )
    if command in ("drain", "cordon"):
        p.add_argument("--reason", default="", help="why (kept with the worker and the audit)")
    return p


def _token(args: argparse.Namespace) -> int:
    path = Path(args.tokens_file) if args.tokens_file else Path(args.state_dir) / "tokens.yaml"
    if not path.exists():
        print(f"hpd token: no {path} (start `hpd up --auth` first)", file=sys.stderr)
        return 1
    token = auth.read_tokens_file(path).get(auth.Role(args.role))
    if not token:
        print(f"hpd token: {path} holds no plain token of role {args.role}", file=sys.stderr)
        return 1
    print(token)
    return 0


def _worker(command: str, args: argparse.Namespace) -> int:
    wid = args.worker_id
    reason = getattr(args, "reason", "")
    with sync_channel(args.registry, CallIdentity.from_env()) as channel:
        stub = r_grpc.RegistryServiceStub(channel)
        try:
            if command == "deregister":
                rev = stub.DeregisterWorker(r.DeregisterWorkerRequest(worker_id=wid), timeout=5)
                print(f"{wid}: deregistered (revision {rev.revision})")
                return 0
            if command == "drain":
                got = stub.DrainWorker(
                    r.DrainWorkerRequest(worker_id=wid, reason=reason), timeout=5
                )
            elif command == "cordon":
                got = stub.CordonWorker(
                    r.CordonWorkerRequest(worker_id=wid, reason=reason), timeout=5
                )
            else:
                got = stub.UncordonWorker(r.UncordonWorkerRequest(worker_id=wid), timeout=5)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "ERROR"
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            print(f"hpd {command}: {code}: {detail}", file=sys.stderr)
            return 1
    st = got.worker.status
    print(
        f"{wid}: {c.HealthState.Name(st.health).removeprefix('HEALTH_STATE_').lower()}"
        f" (draining={st.draining}, cordoned={st.cordoned})"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    command, rest = args_in[0], args_in[1:]
    args = parser(command).parse_args(rest)
    if command == "token":
        return _token(args)
    return _worker(command, args)
