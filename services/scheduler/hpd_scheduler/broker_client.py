"""Opening KV transfer sessions at the KV broker for plans that transfer KV.

The scheduler only needs two things from the broker: open a session for a planned
transfer (idempotent per request id at the broker, so a replayed Schedule gets the same
session) and abort one it no longer needs. `KvSessionOpener` is that seam; `NoKvBroker`
is the default when no broker is configured (plans carry no session id).

Any failure to open is a `SessionRefused` with a reason code, never an error of
Schedule: the plan becomes recompute on the decode worker and says why
(`broker_unreachable` when the broker did not answer, `broker_incompatible` when it
judged the pair's KV formats incompatible, `broker_<code>` otherwise).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import grpc

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hpd_common.channels import CallIdentity, aio_channel
from hpd_common.logging import get_logger
from hpd_common.rpc import status_for

log = get_logger("scheduler.broker")

__all__ = [
    "GrpcKvBroker",
    "KvSessionOpener",
    "NoKvBroker",
    "SessionRefused",
    "refusal_for",
    "refusal_reason",
    "session_opener",
]


class SessionRefused(Exception):
    """The broker did not open the session; ``reason`` is a stable code for the record."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KvSessionOpener(Protocol):
    """Opens and aborts KV transfer sessions."""

    @property
    def enabled(self) -> bool: ...

    async def open(
        self, request_id: str, source_worker_id: str, destination_worker_id: str, kv_bytes: int
    ) -> str:
        """The session id; raises :class:`SessionRefused`."""
        ...

    async def abort(self, session_id: str, reason: str) -> None:
        """Best effort: a session left open expires at the broker by its lease."""
        ...

    async def close(self) -> None: ...


class NoKvBroker:
    """No broker configured: transfers are planned without a session."""

    enabled = False

    async def open(
        self, request_id: str, source_worker_id: str, destination_worker_id: str, kv_bytes: int
    ) -> str:
        return ""

    async def abort(self, session_id: str, reason: str) -> None:
        return None

    async def close(self) -> None:
        return None


_UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}


def refusal_reason(code: grpc.StatusCode) -> str:
    """The plan's ``mode_reason`` when the broker answers ``code`` instead of a session."""
    if code in _UNREACHABLE:
        return "broker_unreachable"
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return "broker_incompatible"
    return f"broker_{code.name.lower()}"


def refusal_for(exc: BaseException) -> str | None:
    """The refusal reason for what a broker called in process raised, as the gRPC path
    would have reported it; None when it is a bug (INTERNAL), not a refusal."""
    code, _message, _trailers = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        return None
    return refusal_reason(code)


class GrpcKvBroker:
    """The KV broker over gRPC, presenting the scheduler token it was configured with."""

    enabled = True

    def __init__(
        self,
        target: str,
        scheduler_token: str = "",
        timeout_s: float = 0.25,
        deadline_ms: int = 0,
        identity: CallIdentity | None = None,
    ) -> None:
        self.target = target
        self._token = scheduler_token
        self._timeout_s = timeout_s
        self._deadline_ms = deadline_ms
        self._identity = identity
        self._channel: grpc.aio.Channel | None = None

    @property
    def _stub(self) -> Any:
        """The stub over a channel opened on first use: a grpc.aio channel belongs to the
        event loop that is running when it is made, and servers are built before theirs."""
        if self._channel is None:
            self._channel = aio_channel(self.target, self._identity)
        return kb_grpc.KvBrokerServiceStub(self._channel)

    async def open(
        self, request_id: str, source_worker_id: str, destination_worker_id: str, kv_bytes: int
    ) -> str:
        req = kb.OpenSessionRequest(
            request_id=request_id,
            source_worker_id=source_worker_id,
            destination_worker_id=destination_worker_id,
            expected_bytes=max(1, kv_bytes),
            deadline_ms=self._deadline_ms,
            caller=kb.SessionCaller(scheduler_token=self._token),
        )
        try:
            resp = await self._stub.OpenSession(  # the request id joins the broker's logs
                req, timeout=self._timeout_s, metadata=(("x-request-id", request_id),)
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            reason = refusal_reason(code)
            log.warning("kv_session_refused", target=self.target, code=code.name, reason=reason)
            raise SessionRefused(reason) from exc
        return str(resp.session.session_id)

    async def abort(self, session_id: str, reason: str) -> None:
        if not session_id:
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.AbortSession(
                kb.AbortSessionRequest(
                    session_id=session_id,
                    caller=kb.SessionCaller(scheduler_token=self._token),
                    reason=reason[:256],
                ),
                timeout=self._timeout_s,
            )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def session_opener(settings: Any) -> KvSessionOpener | None:
    """The opener a scheduler's settings name (``broker_target``, its token, deadline and
    identity), or None without a broker: the one place a scheduler process, and a gateway's
    embedded replica, reach the broker from."""
    if not settings.broker_target:
        return None
    return GrpcKvBroker(
        settings.broker_target,
        settings.broker_token,
        timeout_s=settings.broker_timeout_ms / 1000,
        identity=settings.call_identity(),
    )
