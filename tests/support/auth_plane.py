"""The whole control plane with a tokens file (auth on, reads closed), and a channel per
principal to every service: what the auth and security tests call as their callers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.auth import Role
from hpd_common.channels import CallIdentity, aio_channel
from hpd_tools.controlplane import ControlPlane, ControlPlaneSettings

# one principal per role, and a second gateway (a gateway's requests are its own)
TOKENS = {
    "ops": (Role.OPERATOR, "operator-token-0123456789abcdef"),
    "gw-1": (Role.GATEWAY, "gateway-one-token-0123456789ab"),
    "gw-2": (Role.GATEWAY, "gateway-two-token-0123456789ab"),
    "sched": (Role.SCHEDULER, "scheduler-token-0123456789abcd"),
    "wk": (Role.WORKER, "worker-join-token-0123456789ab"),
}
UNKNOWN = "not-in-the-file-0123456789abcdef"


@dataclass
class Plane:
    cp: ControlPlane
    channels: dict[str, grpc.aio.Channel]

    def target_of(self, key: str) -> str:
        service = key.split("/")[0]
        return {
            "RegistryService": self.cp.registry_target,
            "SchedulerService": self.cp.scheduler_target,
            "KvBrokerService": self.cp.kvbroker_target,
            "DiagnosticsService": self.cp.registry_target,
        }[service]

    def channel(self, who: str) -> grpc.aio.Channel:
        return self.channels[who]

    def registry(self, who: str) -> r_grpc.RegistryServiceStub:
        return r_grpc.RegistryServiceStub(self.channels[f"{who}@registry"])

    def scheduler(self, who: str) -> s_grpc.SchedulerServiceStub:
        return s_grpc.SchedulerServiceStub(self.channels[f"{who}@scheduler"])

    def broker(self, who: str) -> kb_grpc.KvBrokerServiceStub:
        return kb_grpc.KvBrokerServiceStub(self.channels[f"{who}@kvbroker"])


@asynccontextmanager
async def auth_plane(
    redis_url: str,
    key_prefix: str,
    folder: Path,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> AsyncIterator[Plane]:
    """The control plane with :data:`TOKENS` (and ``extra`` entries by name: a tokens-file
    entry each, with a ``token``) in its tokens file, reads closed; a channel per caller
    (``<name>@registry`` ...), ``anon`` without a token and ``stranger`` with an unknown one."""
    entries = [{"name": n, "role": role.value, "token": t} for n, (role, t) in TOKENS.items()]
    entries += [{"name": n, **e} for n, e in (extra or {}).items()]
    path = folder / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": entries}))
    cp = ControlPlane(
        ControlPlaneSettings(
            redis_url=redis_url,
            key_prefix=key_prefix,
            auth_tokens_file=str(path),
            auth_open_reads=False,
            service_token=TOKENS["sched"][1],
        )
    )
    await cp.start()
    channels: dict[str, grpc.aio.Channel] = {}
    callers = {
        **{who: t for who, (_, t) in TOKENS.items()},
        **{n: str(e["token"]) for n, e in (extra or {}).items()},
        "anon": "",
        "stranger": UNKNOWN,
    }
    for svc, target in (
        ("registry", cp.registry_target),
        ("scheduler", cp.scheduler_target),
        ("kvbroker", cp.kvbroker_target),
    ):
        for who, token in callers.items():
            channels[f"{who}@{svc}"] = aio_channel(target, CallIdentity(token=token))
    try:
        yield Plane(cp, channels)
    finally:
        for ch in channels.values():
            await ch.close()
        await cp.stop()
