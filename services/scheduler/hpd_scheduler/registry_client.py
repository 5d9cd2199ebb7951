"""The scheduler's client of the registry for directives (the only gRPC it speaks besides
the informer's watch)."""

from __future__ import annotations

from typing import Protocol

import grpc

from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_common.channels import CallIdentity, aio_channel
from hpd_registry.convert import directive_to_pb
from hpd_registry.domain import Directive


class DirectiveSender(Protocol):
    """Queues a directive for one worker; True when the registry accepted it."""

    async def send(self, worker_id: str, directive: Directive) -> str | None: ...

    async def close(self) -> None: ...


class GrpcDirectiveSender:
    """SendDirective over one lazily opened channel; returns None and the status name on
    refusal instead of raising, since a missed directive is retried next cycle."""

    def __init__(
        self, target: str, timeout_s: float = 2.0, identity: CallIdentity | None = None
    ) -> None:
        self._target = target
        self._identity = identity
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    async def send(self, worker_id: str, directive: Directive) -> str | None:
        if self._channel is None:
            self._channel = aio_channel(self._target, self._identity)
        stub = r_grpc.RegistryServiceStub(self._channel)
        try:
            await stub.SendDirective(
                r.SendDirectiveRequest(worker_id=worker_id, directive=directive_to_pb(directive)),
                timeout=self._timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
        return None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
