"""`hpd fleet`: an emulated heterogeneous fleet serving vLLM's HTTP protocol, attached to a
control plane that runs elsewhere, until stopped.

Every worker of ``--cluster`` (default: the demo fleet) registers with the registry at
``--registry`` and answers on a port of its own as a vLLM engine does
(``hpd_fleet.engine_http``: completions whole and streamed, the NIXL hand-off, /tokenize,
/metrics), so an ``hpd gateway`` in front of that plane runs its plans on them exactly as
on real engines. It is what the compose stack's `engines` service runs: the engines listen
on ``--host 0.0.0.0`` in their container and register as ``--advertise engines:<port>``,
the name the gateway's container resolves::

    hpd fleet --registry registry:50051 --broker kvbroker:50053 --tls-dir /tls \\
        --host 0.0.0.0 --advertise engines --model qwen2.5-7b --id-prefix engines-

``--model`` serves another model of ``hpd_common.perfmodel`` than the cluster's, and
``--id-prefix`` names the workers apart, so this fleet can share a plane with another
(``hpd demo --attach``'s) without either taking the other's requests. With ``--tls-dir``
(the folder ``hpd certs`` wrote) every worker presents the worker role's certificate.
SIGTERM or SIGINT deregisters every worker and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpd_agent.worker_client import ClientTiming
from hpd_common import perfmodel
from hpd_common.channels import CallIdentity, aio_channel
from hpd_common.clock import SystemClock
from hpd_common.logging import configure_logging, get_logger
from hpd_sim.cluster import ClusterError, ClusterSpec, load_cluster

from .attach import role_identity
from .engine import EmuTime
from .engine_http import FleetHttp
from .fleet import Fleet, advertised_host, default_cluster_path

__all__ = ["main", "parser"]

log = get_logger("fleet.serve")


def parser() -> argparse.ArgumentParser:
    head, _, rest = (__doc__ or "").partition("\n\n")
    p = argparse.ArgumentParser(
        prog="hpd fleet",
        description=head,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--registry", required=True, help="the registry's host:port")
    p.add_argument("--broker", required=True, help="the KV broker's host:port")
    p.add_argument(
        "--tls-dir", default="", metavar="DIR",
        help="mutual TLS with the certificates `hpd certs DIR` wrote, as the worker role",
    )  # fmt: skip
    p.add_argument("--cluster", default="", help="cluster YAML (default: the demo fleet)")
    p.add_argument("--model", default="", help="serve this model instead of the cluster's")
    p.add_argument("--host", default="127.0.0.1", help="address the engines listen on")
    p.add_argument(
        "--advertise", default="",
        help="host name the engines register with (default: --host; needed with 0.0.0.0)",
    )  # fmt: skip
    p.add_argument("--id-prefix", default="", help="prefix of every worker id")
    p.add_argument("--lease-ttl-ms", type=int, default=0, help="worker lease (0: the registry's)")
    p.add_argument(
        "--report-interval-s", type=float, default=1.0,
        help="seconds between a worker's load reports (each also renews its lease)",
    )  # fmt: skip
    p.add_argument(
        "--ready-file", default="",
        help="touched once every worker is registered and serving (a container's health check)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--log-level", default="info")
    return p


def cluster_of(args: argparse.Namespace) -> ClusterSpec:
    """The cluster to emulate, with ``--model`` in place of its own; ValueError naming a bad
    file or an unknown model."""
    cluster = load_cluster(args.cluster or default_cluster_path())
    if args.model:
        try:
            model = perfmodel.model_spec(args.model)
        except perfmodel.UnknownModelError as exc:
            raise ValueError(f"--model {args.model!r}: known are {', '.join(exc.known)}") from None
        cluster = dataclasses.replace(cluster, model=model)
    return cluster


async def serve(args: argparse.Namespace, cluster: ClusterSpec, stop: asyncio.Event) -> None:
    """Register and serve the fleet until ``stop`` is set; then deregister and stop."""
    identity: CallIdentity | None = None
    if args.tls_dir:
        identity = role_identity(Path(args.tls_dir), "worker")
    registry = aio_channel(args.registry, identity)
    broker = aio_channel(args.broker, identity)
    emu = EmuTime(1.0, time.monotonic, asyncio.sleep, start=time.monotonic())
    fleet = Fleet(
        cluster, registry, broker, emu, SystemClock(), random.Random(args.seed),
        id_prefix=args.id_prefix, lease_ttl_ms=args.lease_ttl_ms,
        timing=ClientTiming(report_interval_s=args.report_interval_s),
    )  # fmt: skip
    http = FleetHttp(fleet, args.host, args.advertise)
    try:
        await http.start()
        await fleet.start()
        print(
            f"hpd fleet: {len(fleet.workers)} emulated workers of {cluster.model.name} in "
            f"{len(fleet.pools())} pools registered at {args.registry}, serving at "
            + ", ".join(http.endpoint(w) for w in fleet.workers),
            file=sys.stderr,
            flush=True,
        )
        if args.ready_file:
            await asyncio.to_thread(Path(args.ready_file).touch)
        await stop.wait()
    finally:
        if args.ready_file:
            await asyncio.to_thread(Path(args.ready_file).unlink, missing_ok=True)
        await fleet.stop()
        await http.stop()
        await registry.close()
        await broker.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        configure_logging(args.log_level)
        cluster = cluster_of(args)
        advertised_host(args.host, args.advertise)
        if args.tls_dir:
            role_identity(Path(args.tls_dir), "worker")  # a missing file, before anything
        if not args.report_interval_s > 0:
            raise ValueError("--report-interval-s must be > 0")
    except (ClusterError, OSError, ValueError) as exc:
        print(f"hpd fleet: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(args, cluster, stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
