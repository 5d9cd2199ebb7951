"""A demo attached to a control plane it did not start (``hpd demo --attach``, the compose
stack's `fleet` profile): the channels it speaks on, and the wait until the plane has
seen the fleet."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import grpc

from hpd_common.channels import CallIdentity, aio_channel


def role_identity(folder: Path, role: str) -> CallIdentity:
    """The identity of ``role``'s client certificate in the folder `hpd certs` wrote (its
    files as ``hpd_tools.tlsgen.Pki`` names them); ValueError naming what is missing."""
    from hpd_tools.tlsgen import Pki

    pki = Pki.in_folder(folder)
    cert, key = pki.role_cert(role)
    missing = [path.name for path in (pki.ca, cert, key) if not path.is_file()]
    if missing:
        raise ValueError(f"--tls-dir {folder}: no {', '.join(missing)} there (see `hpd certs`)")
    return CallIdentity(ca_file=str(pki.ca), cert_file=str(cert), key_file=str(key))


def plane_channels(targets: Sequence[str], tls_dir: Path | None) -> list[grpc.aio.Channel]:
    """Registry, broker and scheduler channels: plaintext to a plane of this run's own;
    to an attached plane on mutual TLS, the fleet as the worker role (it registers and
    completes transfers) and the replay as the gateway role (it plans)."""
    registry, scheduler, broker = targets[0], targets[1], targets[2]
    if tls_dir is None:
        return [grpc.aio.insecure_channel(t) for t in (registry, broker, scheduler)]
    worker, gateway = role_identity(tls_dir, "worker"), role_identity(tls_dir, "gateway")
    return [
        aio_channel(registry, worker),
        aio_channel(broker, worker),
        aio_channel(scheduler, gateway),
    ]


async def wait_fleet_registered(
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
