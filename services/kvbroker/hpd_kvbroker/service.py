"""KV broker use cases: async, owns the store, the clock, the fleet view and the loops.

Background loops (one set per replica, all safe to run on several replicas):
- the fleet informer (when `registry_target` is set): the registry's WatchWorkers keeps
  the compatibility matrix current, and a worker that leaves the fleet (lease expired or
  deregistered) has its open sessions failed at once, with the registry's reason;
- the sweeper: every `sweep_interval_ms`, one script expires overdue sessions, fails the
  open sessions of workers whose registry lease is gone (the safety net when the feed was
  missed, e.g. the broker was down), and purges terminal sessions past retention;
- the feed tailer: one blocking XREAD per replica fans session changes out to the
  WatchSession streams of this replica.

Worker lookups (Negotiate, OpenSession) read the informer's in-memory view and fall back
to the registry's Redis record when the worker is not (yet) in it, so a worker can be
used the moment its registration returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from hpd_common.aio import cancel_and_wait
from hpd_common.clock import Clock
from hpd_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from hpd_common.ids import check_id
from hpd_common.kvformat import KvFormat, KvFormatError, Negotiation, Verdict, across_models
from hpd_common.logging import get_logger
from hpd_common.redis_conn import refuse_when_full
from hpd_kvbroker import metrics
from hpd_kvbroker.domain import (
    Op,
    Session,
    SessionState,
    check_expected_bytes,
    check_ids,
    check_reason,
    negotiation_json,
    worker_lost_reason,
)
from hpd_kvbroker.identity import Caller, authenticate
from hpd_kvbroker.keys import KvKeys
from hpd_kvbroker.matrix import CompatibilityMatrix, MatrixView
from hpd_kvbroker.queries import SessionQueries
from hpd_kvbroker.settings import KvBrokerSettings, policy_from
from hpd_kvbroker.store import OpenArgs, Result, SessionStore, SweepResult
from hpd_registry.domain import WorkerRecord
from hpd_registry.informer import FleetChange, FleetInformer
from hpd_registry.keys import RegistryKeys
from hpd_registry.store import RegistryStore

log = get_logger("kvbroker")


@dataclass(frozen=True, slots=True)
class OpenRequest:
    request_id: str
    source_worker_id: str
    destination_worker_id: str
    expected_bytes: int
    deadline_ms: int = 0
    lease_ttl_ms: int = 0


@dataclass(frozen=True, slots=True)
class Negotiated:
    negotiation: Negotiation
    source: KvFormat
    destination: KvFormat


def _random_ids(rng: random.Random) -> Callable[[int], str]:
    def new_id(now_ms: int) -> str:
        return f"{now_ms:012x}{rng.getrandbits(48):012x}"

    return new_id


def _urandom_ids() -> Callable[[int], str]:
    """Session ids: the time, then 48 bits from the OS's CSPRNG, read 4 KiB at a time (one
    system call per 682 ids rather than one per id)."""
    buf = b""

    def new_id(now_ms: int) -> str:
        nonlocal buf
        if len(buf) < 6:
            buf = os.urandom(4092)
        bits, buf = buf[:6], buf[6:]
        return f"{now_ms:012x}{bits.hex()}"

    return new_id


_OP_VERB = {
    Op.RESERVE: "reserve",
    Op.PROGRESS: "report progress on",
    Op.COMPLETE: "complete",
    Op.FINISH: "complete",
    Op.FAIL: "fail",
    Op.ABORT: "abort",
    Op.EXPIRE: "expire",
}


class KvBrokerService(SessionQueries):
    """The broker's use cases; the gRPC servicer is a thin layer over this.

    Split by responsibility: this module holds the set-up, the lifecycle, negotiation and
    the matrix, and the session operations that change state; reading and watching
    sessions is `queries.py`, settings `settings.py`."""

    def __init__(
        self,
        settings: KvBrokerSettings,
        client: aioredis.Redis,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.clock = clock
        self.policy = policy_from(settings)
        self.store = SessionStore(
            client,
            KvKeys(settings.key_prefix),
            RegistryKeys(settings.registry_key_prefix),
            settings.retention_ms,
            settings.feed_max_len,
        )
        self.registry = RegistryStore(client, RegistryKeys(settings.registry_key_prefix))
        self.matrix = CompatibilityMatrix(self.policy)
        self._new_id = _random_ids(rng) if rng is not None else _urandom_ids()
        self.informer: FleetInformer | None = None
        if settings.registry_target:
            self.informer = FleetInformer(
                settings.registry_target,
                on_change=self._on_fleet_change,
                clock=clock,
                identity=settings.call_identity(),
            )
        self._watchers: dict[str, set[asyncio.Queue[Session | None]]] = {}  # None: end
        self._draining = False  # the server is stopping: watches end (`drain`)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[list[Session]]] = set()
        self._tail_client: aioredis.Redis | None = None
        self._tail_wanted = asyncio.Event()
        self._tail_ready = asyncio.Event()

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, sweeper: bool = True) -> None:
        kwargs = dict(self.client.connection_pool.connection_kwargs)
        kwargs["socket_timeout"] = max(2.0, (kwargs.get("socket_timeout") or 1.0) * 2)
        pool = aioredis.ConnectionPool(
            connection_class=self.client.connection_pool.connection_class,
            max_connections=4,
            **kwargs,
        )
        self._tail_client = self.client.__class__(connection_pool=pool)
        self._tasks = [asyncio.create_task(self._tail_feed(), name="kvbroker-feed")]
        if sweeper:
            self._tasks.append(asyncio.create_task(self._sweeper(), name="kvbroker-sweeper"))
        if self.informer is not None:
            await self.informer.start()

    def drain(self) -> None:
        """Ends every WatchSession stream with UNAVAILABLE (the server is stopping): the
        client resumes on another replica from the version it has, and shutdown does not
        wait on streams that last as long as their transfers."""
        self._draining = True  # and watches that subscribe from now on end at once
        for queues in list(self._watchers.values()):
            for q in queues:
                q.put_nowait(None)

    async def stop(self) -> None:
        if self.informer is not None:
            await self.informer.stop()
        await cancel_and_wait([*self._tasks, *self._background])
        if self._tail_client is not None:
            await self._tail_client.aclose()

    # -- negotiation and the matrix ---------------------------------------------------------

    async def _worker(self, path: str, worker_id: str) -> WorkerRecord:
        check_id(path, worker_id)
        if self.informer is not None:
            rec = self.informer.workers.get(worker_id)
            if rec is not None:
                return rec
        rec = await self.registry.get(worker_id)
        if rec is None or rec.state.lease_expires_at_ms < self.clock.now_ms():
            raise NotFound("worker", worker_id)
        return rec

    async def _format(self, path: str, ref: str | KvFormat) -> tuple[KvFormat, str]:
        """The format, and the model of the worker it is read from ('' for a descriptor)."""
        if isinstance(ref, KvFormat):
            try:
                ref.validate()
            except KvFormatError as exc:
                raise InvalidArgument(f"{path}_format.{exc.field}", exc.message) from exc
            return ref, ""
        spec = (await self._worker(f"{path}_worker_id", ref)).spec
        return spec.kv_format, spec.model_id

    async def negotiate(self, source: str | KvFormat, destination: str | KvFormat) -> Negotiated:
        """The verdict for KV moving from `source` to `destination` (worker ids or formats);
        two workers of different models are incompatible whatever their formats."""
        src, src_model = await self._format("source", source)
        dst, dst_model = await self._format("destination", destination)
        n = self.matrix.negotiate(src, dst)  # memoised per format pair
        if src_model != dst_model and src_model and dst_model:
            n = across_models(n, src_model, dst_model)
        metrics.observe_negotiation(n.verdict)
        return Negotiated(n, src, dst)

    def compatibility(self, model_id: str) -> MatrixView:
        check_id("model_id", model_id)
        return self.matrix.view(model_id)

    def _on_fleet_change(self, change: FleetChange) -> None:
        if change.kind == "resync" and self.informer is not None:
            self.matrix.reset(list(self.informer.workers.values()), change.revision)
        elif change.kind == "put" and change.record is not None:
            self.matrix.put(change.record, change.revision)
        elif change.kind == "delete":
            self.matrix.delete(change.worker_id, change.revision)
            why = change.reason
            task = asyncio.get_running_loop().create_task(
                self.worker_lost(change.worker_id, worker_lost_reason(change.worker_id, why))
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        metrics.MATRIX_PAIRS.set(self.matrix.pair_count)

    async def worker_lost(self, worker_id: str, reason: str) -> list[Session]:
        """Fails the worker's open sessions (the sweeper retries if Redis is away now)."""
        try:
            failed = await self.store.fail_worker(worker_id, reason, self.clock.now_ms())
        except Unavailable as exc:
            log.warning("worker_loss_not_applied", worker_id=worker_id, error=str(exc))
            return []
        for s in failed:
            metrics.observe_change(s)
            log.info("kv_session_failed", session_id=s.session_id, reason=reason)
        return failed

    # -- sessions ---------------------------------------------------------------------------

    def _clamp_lease(self, requested_ms: int, deadline_ms: int) -> int:
        s = self.settings
        ttl = requested_ms or s.lease_ttl_ms
        return max(s.min_lease_ttl_ms, min(s.max_lease_ttl_ms, ttl, deadline_ms))

    async def open(self, req: OpenRequest, caller: Caller) -> tuple[Session, bool]:
        """Opens (or, for a known request id, returns) the session; (session, created)."""
        check_ids(
            request_id=req.request_id,
            source_worker_id=req.source_worker_id,
            destination_worker_id=req.destination_worker_id,
        )
        if req.source_worker_id == req.destination_worker_id:
            raise InvalidArgument("destination_worker_id", "must differ from source_worker_id")
        check_expected_bytes("expected_bytes", req.expected_bytes)
        deadline = req.deadline_ms or self.settings.default_deadline_ms
        if deadline > self.settings.max_deadline_ms:
            raise InvalidArgument("deadline_ms", f"at most {self.settings.max_deadline_ms}")
        refuse_when_full(self.client, self.settings.redis_memory_limit_ratio, "KV sessions")
        actor, cred = authenticate(caller, None, self.settings)
        now = self.clock.now_ms()
        try:
            n = await self.negotiate(req.source_worker_id, req.destination_worker_id)
            if n.negotiation.verdict is Verdict.INCOMPATIBLE:
                raise FailedPrecondition(
                    f"KV of {req.source_worker_id!r} cannot be used by "
                    f"{req.destination_worker_id!r}: " + "; ".join(n.negotiation.details),
                    {"kv_format": n.negotiation.reasons},
                )
        except (NotFound, FailedPrecondition) as refused:
            # a retry of a request whose session exists gets that session, even once a
            # worker has left or the pair is no longer compatible; anything else (no such
            # session, another request's, Redis away) is answered with the refusal itself
            args = self._open_args(req, deadline, now, "")
            try:
                res = await self.store.open(args, actor, cred, now, existing_only=True)
            except Unavailable:
                raise refused from None
            if res.status not in ("same", "same_expired"):
                raise
        else:
            args = self._open_args(req, deadline, now, negotiation_json(n.negotiation))
            res = await self.store.open(args, actor, cred, now)
        if res.status == "conflict":
            raise AlreadyExists(
                f"request id {req.request_id!r} already has session {res.detail} with other "
                "workers or another size"
            )
        if res.status == "gone":
            raise NotFound("worker", res.detail)
        self._raise_auth(res, actor, "")
        assert res.session is not None
        if res.status in ("created", "same_expired"):
            metrics.observe_change(res.session)
        if res.status == "same_expired":
            log.info(
                "kv_session_expired", session_id=res.session.session_id, reason=res.session.reason
            )
        return res.session, res.status == "created"

    def _open_args(self, req: OpenRequest, deadline: int, now: int, negotiation: str) -> OpenArgs:
        return OpenArgs(
            session_id=self._new_id(now),
            request_id=req.request_id,
            source_worker_id=req.source_worker_id,
            destination_worker_id=req.destination_worker_id,
            expected_bytes=req.expected_bytes,
            deadline_ms=deadline,
            lease_ttl_ms=self._clamp_lease(req.lease_ttl_ms, deadline),
            negotiation_json=negotiation,
        )

    def _raise_auth(self, res: Result, actor: str, session_id: str) -> None:
        if res.status == "missing":
            raise NotFound("session", session_id)
        if res.status == "denied":
            raise PermissionDenied(
                f"credential does not match worker {actor!r}, or its registry lease has expired"
            )
        if res.status == "not_party":
            raise PermissionDenied(f"worker {actor!r} is not a party to this session")

    async def _transition(
        self,
        session_id: str,
        op: Op,
        caller: Caller,
        bytes_done: int | None = None,
        reason: str = "",
    ) -> Session:
        check_id("session_id", session_id)
        actor, cred = authenticate(caller, op, self.settings)
        res = await self.store.transition(
            session_id, op.value, actor, cred, self.clock.now_ms(), bytes_done, reason
        )
        self._raise_auth(res, actor, session_id)
        s = res.session
        assert s is not None
        if res.status == "expired_first":
            metrics.observe_change(s)
            log.info("kv_session_expired", session_id=session_id, reason=s.reason)
            raise FailedPrecondition(f"session {session_id!r} expired ({s.reason})")
        if res.status == "illegal":
            raise FailedPrecondition(f"cannot {_OP_VERB[op]} a session in state {s.state.value}")
        if res.status == "backwards":
            raise FailedPrecondition(
                f"bytes_done {bytes_done} is below the {s.bytes_done} already reported: "
                "bytes never go backwards"
            )
        if res.status == "overflow":
            raise InvalidArgument("bytes_done", f"exceeds expected_bytes {s.expected_bytes}")
        if res.status == "applied":
            metrics.observe_change(s)
            if s.state.terminal and s.state is not SessionState.COMPLETE:
                log.info(
                    "kv_session_ended", session_id=session_id, state=s.state.value, reason=s.reason
                )
        return s

    async def report(
        self, session_id: str, caller: Caller, state: SessionState, bytes_done: int, reason: str
    ) -> Session:
        """A worker's progress report: TRANSFERRING (bytes), RESERVED or FAILED (reason)."""
        if state is SessionState.TRANSFERRING:
            return await self._transition(session_id, Op.PROGRESS, caller, bytes_done)
        if state is SessionState.RESERVED:
            return await self._transition(session_id, Op.RESERVE, caller, bytes_done)
        if state is SessionState.FAILED:
            check_reason("reason", reason, required=True)
            return await self._transition(session_id, Op.FAIL, caller, reason=reason)
        raise InvalidArgument("state", "must be TRANSFERRING, RESERVED or FAILED")

    async def complete(
        self, session_id: str, caller: Caller, all_bytes_arrived: bool = False
    ) -> Session:
        """Every byte arrived: from TRANSFERRING, or with ``all_bytes_arrived`` also from
        NEGOTIATED / RESERVED (progress and completion in one call)."""
        op = Op.FINISH if all_bytes_arrived else Op.COMPLETE
        return await self._transition(session_id, op, caller)

    async def abort(self, session_id: str, caller: Caller, reason: str) -> Session:
        check_reason("reason", reason)
        return await self._transition(session_id, Op.ABORT, caller, reason=reason or "aborted")

    # -- background loops -------------------------------------------------------------------

    async def sweep_once(self) -> SweepResult:
        result = await self.store.sweep(self.clock.now_ms())
        for s in result.changed:
            metrics.observe_change(s)
            event = "kv_session_" + s.state.value.lower()
            log.info(event, session_id=s.session_id, reason=s.reason)
        metrics.OPEN_SESSIONS.set(result.open_sessions)
        return result

    async def _sweeper(self) -> None:
        interval_s = self.settings.sweep_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep_once()
            except Unavailable as exc:
                log.warning("sweep_failed", error=str(exc))
            except Exception:  # a bug or a Redis refusal must not end the sweeps for good
                log.exception("sweep_error")


@contextlib.asynccontextmanager
async def running(service: KvBrokerService, sweeper: bool = True) -> AsyncIterator[KvBrokerService]:
    """Starts the service's loops for the duration of a block (tests, tools)."""
    await service.start(sweeper)
    try:
        yield service
    finally:
        await service.stop()
