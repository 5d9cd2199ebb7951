"""The worker client library: what an inference engine adapter uses to join a hetero-pd fleet.

An engine (vLLM, SGLang, TensorRT-LLM, or the emulated engine of this package) talks to two
services through one :class:`WorkerClient`:

* **registry**: ``RegisterWorker`` with the engine's capability record, then one long-lived
  ``StreamHeartbeats`` stream. Every ``report_interval_s`` the client sends the engine's load
  report (``load_fn()``) and the health it last set (:meth:`WorkerClient.set_health`); every
  message renews the lease. Directives arrive on the same stream and go to ``on_directive``.
  A broken stream is reopened with capped, jittered exponential backoff
  (``min(max_backoff, min_backoff x 2^attempt) x U(0.5, 1)``); a NOT_FOUND or
  PERMISSION_DENIED answer means the lease is gone (expired while the worker was cut off, or
  the registry lost it), so the client registers again (a new credential) before reopening.
* **kvbroker**: the KV session protocol, as sender (the prefill side: optionally open a
  session as a party, report bytes moved, complete or fail it) and as receiver (the decode
  side: report that KV memory is reserved, then :meth:`WorkerClient.await_session` watches the
  session until it is terminal, resuming from the last version seen when the stream breaks).
  Every call carries the worker's own credential (``SessionCaller``).

Retries: session calls that the broker may not have applied (UNAVAILABLE,
DEADLINE_EXCEEDED) are retried with the same backoff until ``retry_budget_s`` has passed; they
are idempotent at the broker (progress never goes backwards; completing COMPLETE, failing
FAILED, aborting ABORTED are no-ops). A session that already ended raises
:class:`SessionEnded` carrying the broker's view of it, so the caller can apply its fallback.

Time and randomness are injected: ``clock`` stamps load reports (``reported_at_unix_ms``),
``rng`` draws the backoff jitter.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_agent.directive_acks import DirectiveAcks
from hpd_common.clock import Clock
from hpd_common.logging import get_logger
from hpd_common.worker_model import LoadReport
from hpd_registry.convert import load_to_pb

__all__ = [
    "TERMINAL_STATES",
    "ClientTiming",
    "SessionEnded",
    "WorkerClient",
    "WorkerGone",
]

log = get_logger("fleet.client")

T = TypeVar("T")

TERMINAL_STATES = frozenset(
    {
        kb.SESSION_STATE_COMPLETE,
        kb.SESSION_STATE_FAILED,
        kb.SESSION_STATE_EXPIRED,
        kb.SESSION_STATE_ABORTED,
    }
)
"""Session states after which nothing changes."""

_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_LEASE_LOST = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED})


class SessionEnded(Exception):
    """The session is terminal (or unknown): no further progress can be made on it."""

    def __init__(self, session_id: str, state: int, reason: str) -> None:
        name = kb.SessionState.Name(state) if state else "UNKNOWN"
        super().__init__(f"session {session_id} is {name}: {reason}")
        self.session_id = session_id
        self.state = state
        self.reason = reason


class WorkerGone(Exception):
    """The client was stopped or killed; the worker can take no part in any session."""


@dataclass(frozen=True, slots=True)
class ClientTiming:
    """Intervals and bounds of the client, in wall seconds.

    ``report_interval_s``: load reports on the heartbeat stream (also the lease renewal
    rate; keep it well under a third of the lease). ``rpc_timeout_s``: deadline of one unary
    call. ``retry_budget_s``: how long a session call is retried while the broker is away.
    """

    report_interval_s: float = 0.25
    min_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    rpc_timeout_s: float = 2.0
    retry_budget_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("report_interval_s", "min_backoff_s", "max_backoff_s", "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ClientTiming.{name} must be > 0")
        if self.max_backoff_s < self.min_backoff_s or self.retry_budget_s < 0:
            raise ValueError("ClientTiming: need max_backoff_s >= min_backoff_s, budget >= 0")

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """``min(max, min x 2^attempt) x U(0.5, 1)``: jittered so a fleet does not reconnect
        in lockstep after a registry restart."""
        base = min(self.max_backoff_s, self.min_backoff_s * (2 ** min(attempt, 30)))
        return float(base * (0.5 + 0.5 * rng.random()))


class WorkerClient:
    """One worker's connection to the control plane (module docstring).

    ``registry`` and ``broker`` are open channels (shared by many clients in one process;
    ``broker`` may be None for a client that takes no part in KV sessions, like an engine's
    agent); ``load_fn`` returns the engine's current figures (stamped with ``clock`` when
    sent), or None when it has none worth sending (a failed scrape);
    ``on_directive`` is called, on the event loop, for every directive received.
    """

    def __init__(
        self,
        capability: c.WorkerCapability,
        registry: grpc.aio.Channel,
        broker: grpc.aio.Channel | None,
        load_fn: Callable[[], LoadReport | None],
        clock: Clock,
        rng: random.Random,
        on_directive: Callable[[c.Directive], None] | None = None,
        lease_ttl_ms: int = 0,
        timing: ClientTiming | None = None,
    ) -> None:
        self.capability = capability
        self.worker_id: str = capability.worker_id
        self._registry = r_grpc.RegistryServiceStub(registry)
        self._broker_stub = None if broker is None else kb_grpc.KvBrokerServiceStub(broker)
        self._load_fn = load_fn
        self._clock = clock
        self._rng = rng
        self._on_directive = on_directive
        self._lease_ttl_ms = lease_ttl_ms
        self.timing = timing or ClientTiming()
        self.credential = ""
        self.lease_ttl_ms = 0
        self.registrations = 0
        self.reconnects = 0
        self.directives: list[c.Directive] = []
        self._acks = DirectiveAcks()  # at least once: acked by id, applied once
        self._health = c.HEALTH_STATE_HEALTHY
        self._health_reason = ""
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.connected = asyncio.Event()

    # -- registry ---------------------------------------------------------------------------

    async def register(self) -> r.RegisterWorkerResponse:
        """Register (or refresh) the capability record; keeps the returned credential."""
        resp: r.RegisterWorkerResponse = await self._registry.RegisterWorker(
            r.RegisterWorkerRequest(
                capability=self.capability,
                credential=self.credential,
                lease_ttl_ms=self._lease_ttl_ms,
            ),
            timeout=self.timing.rpc_timeout_s,
        )
        self.credential = resp.credential
        self.lease_ttl_ms = resp.lease_ttl_ms
        self.registrations += 1
        log.debug("worker_registered", worker_id=self.worker_id, lease_ttl_ms=resp.lease_ttl_ms)
        return resp

    async def start(self) -> None:
        """Register, then keep the heartbeat stream in a background task."""
        await self._retry(self.register)
        self._stopped = False
        self._task = asyncio.create_task(self._heartbeat_loop(), name=f"hb-{self.worker_id}")

    def set_health(self, healthy: bool, reason: str = "") -> None:
        """Report HEALTHY, or UNHEALTHY with a reason, from the next load report on."""
        if not healthy and not reason:
            raise ValueError("an UNHEALTHY report needs a reason")
        self._health = c.HEALTH_STATE_HEALTHY if healthy else c.HEALTH_STATE_UNHEALTHY
        self._health_reason = "" if healthy else reason[:256]

    async def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; deregister (a clean exit) unless told not to."""
        await self._halt()
        if deregister and self.credential:
            await self._deregister()

    async def _deregister(self) -> None:
        """DeregisterWorker, tried again while the registry answers UNAVAILABLE or misses
        the deadline, for ``retry_budget_s`` or one lease, whichever is longer: a busy
        registry must not leave a gone engine planned on (a lease does not lapse while the
        registry grants the grace that follows its own stall). When the budget runs out
        the lease still takes the worker out, and the log says so."""
        req = r.DeregisterWorkerRequest(worker_id=self.worker_id, credential=self.credential)
        loop = asyncio.get_running_loop()
        budget_s = max(self.timing.retry_budget_s, self.lease_ttl_ms / 1000)
        deadline = loop.time() + budget_s
        attempt = 0
        while True:
            try:
                await self._registry.DeregisterWorker(req, timeout=self.timing.rpc_timeout_s)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _LEASE_LOST:
                    return  # already gone (its lease lapsed, or an operator removed it)
                pause = self.timing.backoff_s(attempt, self._rng)
                if exc.code() not in _RETRYABLE or loop.time() + pause > deadline:
                    log.warning(
                        "deregister_failed",
                        worker_id=self.worker_id,
                        code=exc.code().name,
                        attempts=attempt + 1,
                        note="the worker leaves when its lease lapses",
                    )
                    return
            await asyncio.sleep(pause)
            attempt += 1

    async def kill(self) -> None:
        """A crash: heartbeats stop, nothing is said; the lease lapses at the registry."""
        await self._halt()

    @property
    def alive(self) -> bool:
        return not self._stopped

    async def _halt(self) -> None:
        self._stopped = True
        self.connected.clear()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    @property
    def _broker(self) -> kb_grpc.KvBrokerServiceStub:
        if self._broker_stub is None:
            raise RuntimeError("this WorkerClient was made without a broker channel")
        return self._broker_stub

    def _report(self, first: bool) -> r.StreamHeartbeatsRequest:
        figures = self._load_fn()
        msg = r.StreamHeartbeatsRequest(
            worker_id=self.worker_id if first else "",
            credential=self.credential if first else "",
            reported_health=self._health,
            health_reason=self._health_reason,
            acked_directive_ids=self._acks.due(),
        )
        if figures is not None:  # None: alive, no figures worth sending (renews the lease)
            msg.load.CopyFrom(load_to_pb(figures))
            msg.load.reported_at_unix_ms = self._clock.now_ms()
        return msg

    async def _reports(self) -> AsyncIterator[r.StreamHeartbeatsRequest]:
        yield self._report(first=True)
        while not self._stopped:
            await asyncio.sleep(self.timing.report_interval_s)
            yield self._report(first=False)

    async def _heartbeat_loop(self) -> None:
        attempt = 0
        while not self._stopped:
            try:
                call = self._registry.StreamHeartbeats(self._reports())
                async for msg in call:
                    if msg.HasField("ack"):
                        attempt = 0
                        self.connected.set()
                    elif msg.HasField("directive"):
                        self._apply(msg.directive)
                # the registry ended the stream (a newer stream of ours replaced it, or it
                # is shutting down): reopen
            except grpc.aio.AioRpcError as exc:
                self.connected.clear()
                if exc.code() in _LEASE_LOST:
                    log.info("lease_lost", worker_id=self.worker_id, code=exc.code().name)
                    self.credential = ""
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.register()
                else:
                    log.debug(
                        "heartbeat_stream_broken", worker_id=self.worker_id, code=str(exc.code())
                    )
            if self._stopped:
                return
            self.reconnects += 1
            await asyncio.sleep(self.timing.backoff_s(attempt, self._rng))
            attempt += 1

    def _apply(self, d: c.Directive) -> None:
        if not self._acks.take(d.directive_id):
            return  # redelivered: its ack was lost; acked again, not applied again
        self.directives.append(d)
        log.info(
            "directive_received",
            worker_id=self.worker_id,
            kind=c.DirectiveKind.Name(d.kind),
            reason=d.reason,
        )
        if self._on_directive is not None:
            self._on_directive(d)

    # -- KV sessions ------------------------------------------------------------------------

    def _caller(self) -> kb.SessionCaller:
        if self._stopped:
            raise WorkerGone(self.worker_id)
        return kb.SessionCaller(worker_id=self.worker_id, credential=self.credential)

    async def _retry(self, call: Callable[[], Awaitable[T]]) -> T:
        """Retry `call` while the service answers UNAVAILABLE / DEADLINE_EXCEEDED, within
        the retry budget."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timing.retry_budget_s
        attempt = 0
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE or loop.time() >= deadline:
                    raise
            await asyncio.sleep(self.timing.backoff_s(attempt, self._rng))
            attempt += 1

    async def _session_call(self, method: Any, request: Any, session_id: str) -> kb.KvSession:
        try:
            resp = await self._retry(lambda: method(request, timeout=self.timing.rpc_timeout_s))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                state = await self._state_of(session_id)
                raise SessionEnded(session_id, state[0], state[1] or exc.details() or "") from exc
            raise
        session: kb.KvSession = resp.session
        return session

    async def _state_of(self, session_id: str) -> tuple[int, str]:
        try:
            resp = await self._broker.GetSession(
                kb.GetSessionRequest(session_id=session_id), timeout=self.timing.rpc_timeout_s
            )
        except grpc.aio.AioRpcError:
            return 0, ""
        return int(resp.session.state), str(resp.session.reason)

    async def open_session(
        self,
        request_id: str,
        destination_worker_id: str,
        expected_bytes: int,
        deadline_ms: int = 0,
        lease_ttl_ms: int = 0,
    ) -> kb.KvSession:
        """Sender: open a session to ``destination_worker_id`` as one of its parties (the
        scheduler usually opens it; a fallback transfer the gateway improvises does not have
        one). Idempotent per request id."""
        req = kb.OpenSessionRequest(
            request_id=request_id,
            source_worker_id=self.worker_id,
            destination_worker_id=destination_worker_id,
            expected_bytes=max(1, expected_bytes),
            deadline_ms=deadline_ms,
            lease_ttl_ms=lease_ttl_ms,
            caller=self._caller(),
        )
        resp = await self._retry(
            lambda: self._broker.OpenSession(req, timeout=self.timing.rpc_timeout_s)
        )
        session: kb.KvSession = resp.session
        return session

    async def report_reserved(self, session_id: str) -> kb.KvSession:
        """Receiver: KV memory for the transfer is reserved (NEGOTIATED -> RESERVED)."""
        req = kb.ReportProgressRequest(
            session_id=session_id, caller=self._caller(), state=kb.SESSION_STATE_RESERVED
        )
        return await self._session_call(self._broker.ReportProgress, req, session_id)

    async def report_progress(self, session_id: str, bytes_done: int) -> kb.KvSession:
        """Sender: ``bytes_done`` bytes have moved (renews the session lease)."""
        req = kb.ReportProgressRequest(
            session_id=session_id,
            caller=self._caller(),
            bytes_done=bytes_done,
            state=kb.SESSION_STATE_TRANSFERRING,
        )
        return await self._session_call(self._broker.ReportProgress, req, session_id)

    async def report_failed(self, session_id: str, reason: str) -> kb.KvSession:
        """Either side: the transfer failed (the session becomes FAILED with the reason)."""
        req = kb.ReportProgressRequest(
            session_id=session_id,
            caller=self._caller(),
            state=kb.SESSION_STATE_FAILED,
            reason=(reason or "failed")[:256],
        )
        return await self._session_call(self._broker.ReportProgress, req, session_id)

    async def complete_session(self, session_id: str) -> kb.KvSession:
        """Sender: every byte arrived (TRANSFERRING -> COMPLETE)."""
        req = kb.CompleteSessionRequest(session_id=session_id, caller=self._caller())
        return await self._session_call(self._broker.CompleteSession, req, session_id)

    async def abort_session(self, session_id: str, reason: str) -> kb.KvSession:
        """Either side abandons the transfer."""
        req = kb.AbortSessionRequest(
            session_id=session_id, caller=self._caller(), reason=(reason or "aborted")[:256]
        )
        return await self._session_call(self._broker.AbortSession, req, session_id)

    async def await_session(self, session_id: str, timeout_s: float) -> kb.KvSession:
        """Receiver: watch the session until it is terminal and return it (COMPLETE means
        the KV is in place). A broken stream is resumed from the last version seen; gives
        up with TimeoutError after ``timeout_s``."""
        last = 0
        attempt = 0
        latest: kb.KvSession | None = None

        async def watch() -> kb.KvSession:
            nonlocal last, attempt, latest
            while True:
                if self._stopped:
                    raise WorkerGone(self.worker_id)
                try:
                    call = self._broker.WatchSession(
                        kb.WatchSessionRequest(session_id=session_id, from_version=last)
                    )
                    async for msg in call:
                        attempt = 0
                        latest = msg.session
                        last = max(last, int(msg.session.version))
                        if msg.session.state in TERMINAL_STATES:
                            done: kb.KvSession = msg.session
                            return done
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is grpc.StatusCode.NOT_FOUND:
                        raise SessionEnded(session_id, 0, "session not found") from exc
                await asyncio.sleep(self.timing.backoff_s(attempt, self._rng))
                attempt += 1

        async with asyncio.timeout(timeout_s):
            return await watch()
