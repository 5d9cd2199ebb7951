"""Scheduler use cases: async, owns the store, the clock, the RNG and the background loops.

The hot path of `schedule` reads no network: the fleet snapshot (`policy.Fleet`) is
rebuilt from the informer's in-memory view by a background loop, at most once per
`fleet_rebuild_interval_ms` however many changes arrive (changes coalesce), and at least
every `fleet_refresh_ms` (load-report confidence ages with time). A request then costs
the planner (microseconds, bounded by top-k, not by fleet size) plus ONE Redis round
trip: the script that checks and takes the reservation, writes the record head and the
idempotency key together (`store.py`).

Reservations as the planner sees them: a local mirror of the Redis totals per worker.
It is exact for this replica's own reservations (each script returns the worker's new
totals) and refreshed from Redis every `reservation_sync_interval_ms` for the other
replicas'. The mirror only steers scoring (so a burst spreads instead of piling onto
one worker between heartbeats); the Redis check is what guarantees no over-commit.

Redis away: `schedule` answers UNAVAILABLE. A plan without a written reservation could
over-commit a decode worker (another replica cannot see it), and a plan without its
record could not be replayed on retry, so we do not hand one out; read-only RPCs served
from memory (policy, recommendations) keep working, and the health check reports
NOT_SERVING until Redis is back. Registry away: decisions continue from the last view
while it is younger than `staleness_bound_ms` (bookmarks keep an idle view fresh), then
`schedule` answers UNAVAILABLE and health is NOT_SERVING until the informer reconnects.

Reservations are deliberately conservative: a running request's KV shows in its worker's
load report and stays reserved until its outcome is reported (or the TTL lapses), so the
same bytes can count twice for a while. That errs towards refusing, never over-commit.

Background loops: fleet rebuild, reservation sync + purge of lapsed reservations,
explanation writer (route record explanations, batched, off the hot path), directives
(imbalance and batch-size recommendations sent through the registry's SendDirective,
only on change and rate-limited).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from hpd_common import native
from hpd_common.clock import Clock
from hpd_common.errors import (
    InvalidArgument,
    Unavailable,
)
from hpd_common.logging import get_logger
from hpd_common.redis_conn import refuse_when_full
from hpd_common.tracing import current_trace_id
from hpd_registry.informer import FleetInformer
from hpd_registry.keys import RegistryKeys
from hpd_scheduler import metrics
from hpd_scheduler.answers import ScheduleAnswers, ScheduleResult, caller_name
from hpd_scheduler.broker_client import KvSessionOpener, NoKvBroker, SessionRefused
from hpd_scheduler.directives import PolicyAndDirectives
from hpd_scheduler.explanations import ExplanationWriter
from hpd_scheduler.feedback import ObservedEstimates
from hpd_scheduler.group_commit import GroupCommit
from hpd_scheduler.keys import SchedulerKeys
from hpd_scheduler.kv_events import KvEventFollower
from hpd_scheduler.learn_store import LearnStore
from hpd_scheduler.learning_queue import LearningQueue
from hpd_scheduler.outcomes import OutcomeReports
from hpd_scheduler.policy import (
    ConfigError,
    Decision,
    FallbackStep,
    Fleet,
    LinkModel,
    Mode,
    Planner,
    RejectClass,
    Request,
    RoutePlan,
    WorkerView,
)
from hpd_scheduler.policy.fleet import WorkerState
from hpd_scheduler.policy.prefix import PrefixIndex
from hpd_scheduler.policy.worker_state import PromptMix
from hpd_scheduler.prefill_due import PrefillDue
from hpd_scheduler.record_queries import RouteRecords
from hpd_scheduler.records import as_recompute, head_of
from hpd_scheduler.registry_client import DirectiveSender, GrpcDirectiveSender
from hpd_scheduler.settings import PolicyState, SchedulerSettings, parse_policy, profile_document
from hpd_scheduler.spans import note_decision
from hpd_scheduler.store import (
    ReservationAsk,
    ReserveEntry,
    ReserveResult,
    ReserveStatus,
    SchedulerStore,
    Totals,
)

log = get_logger("scheduler")


def session_request_id(request_id: str, attempt: int) -> str:
    """The broker's idempotency key for one planning attempt's KV session.

    Attempt 0 uses the request id, so a retried Schedule finds the same session. A later
    attempt (the previous reservation came back FULL and its session is being aborted)
    gets a key of its own: reusing the request id would hand it the aborted session, or
    ALREADY_EXISTS for a different pair. Keys stay within the broker's 128 characters.
    """
    if attempt == 0:
        return request_id
    suffix = f":a{attempt}"
    return request_id[: 128 - len(suffix)] + suffix


class SchedulerService(PolicyAndDirectives, OutcomeReports, RouteRecords, ScheduleAnswers):
    """The scheduler's use cases; the gRPC servicer is a thin layer over this.

    Split by responsibility: this module holds the set-up, the lifecycle and the hot path
    (`schedule`); refusals and replays are `answers.py`, the snapshot and reservation
    mirror `snapshot.py`, outcomes `outcomes.py`, reading route records
    `record_queries.py`, policy reload, recommendations and directives `directives.py`,
    settings and the policy document `settings.py`."""

    def __init__(
        self,
        settings: SchedulerSettings,
        client: aioredis.Redis,
        clock: Clock,
        rng: random.Random | None = None,
        opener: KvSessionOpener | None = None,
        informer: FleetInformer | None = None,
    ) -> None:
        settings.validate()
        self.settings = settings
        self.client = client
        self.clock = clock
        self.rng = rng or random.Random(settings.seed)
        self.opener: KvSessionOpener = opener or NoKvBroker()
        self.store = SchedulerStore(client, SchedulerKeys(settings.key_prefix))
        self.commits = GroupCommit(self.store, settings.group_commit(), settings.record_index_cap)
        self.scheduler_id = settings.scheduler_id or f"{socket.gethostname()}:{os.getpid()}"
        self.informer = informer or FleetInformer(
            settings.registry_target,
            clock=clock,
            max_backoff_s=settings.informer_max_backoff_ms / 1000,
            identity=settings.call_identity(),
        )
        self.informer.on_change = self._on_change
        self.on_view_synced: Callable[[], None] | None = None
        """Called when the fleet view (re)syncs (the server re-checks readiness)."""
        tiers_text = ""
        if settings.tiers_file:
            try:
                tiers_text = Path(settings.tiers_file).read_text(encoding="utf-8")
            except OSError as exc:
                raise InvalidArgument("tiers_file", f"cannot read: {exc.strerror}") from None
        try:
            profile, text = parse_policy(profile_document(settings.profile), tiers_text)
        except ConfigError as exc:
            raise InvalidArgument(f"profile.{exc.key_path}", exc.message) from None
        self._policy = PolicyState(profile, Planner(profile), text, 1, clock.now_ms())
        self.observed = ObservedEstimates(settings.ewma_alpha)
        self._changed = asyncio.Event()
        self.learn_store = LearnStore(client, SchedulerKeys(settings.key_prefix))
        self.learning = LearningQueue(self.observed.learner, self.learn_store, self._changed.set)
        self._incarnations: dict[str, int] = {}
        self._views: dict[str, tuple[int, tuple[int, int], WorkerView]] = {}
        self._links: tuple[int, LinkModel] = (-1, LinkModel())
        self._fleet: Fleet | None = None
        self._totals: dict[str, Totals] = {}
        self._applied: dict[str, Totals] = {}  # what the snapshot counts (_effective)
        self._in_flight: dict[int, ReservationAsk] = {}  # reservation scripts under way
        self._batch_caps: dict[str, int] = {}
        self.explanations = ExplanationWriter(self.store)
        self._tasks: list[asyncio.Task[None]] = []
        self.directives: DirectiveSender = GrpcDirectiveSender(
            settings.registry_target, identity=settings.call_identity()
        )
        self._bg: set[asyncio.Future[None]] = set()
        self._stopping = False
        # which worker's engine holds which prompt prefix (policy.prefix), followed from
        # the registry's KV event feed; and the prompt mix queued requests are priced at
        self.prefix = PrefixIndex()
        self.kv_events = KvEventFollower(client, RegistryKeys(settings.key_prefix), self.prefix)
        self.prompt_mix = PromptMix()
        # and the outputs' mix: how long a running sequence lives (decode admission waits)
        self.output_mix = PromptMix(initial_tokens=None)
        # this replica's reserved prompt tokens still waiting to be prefilled (token-true
        # prefill queues: a reservation lasts until the outcome, a prefill does not)
        self.prefill_due = PrefillDue()

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        compiled = native.status()
        log.info("policy_core", compiled=compiled.active, why=compiled.reason)
        await self.informer.start()
        self._tasks = [
            asyncio.create_task(self._rebuild_loop(), name="scheduler-fleet"),
            asyncio.create_task(self.kv_events.run(), name="scheduler-kv-events"),
            asyncio.create_task(self._sync_loop(), name="scheduler-reservations"),
            asyncio.create_task(self.explanations.run(), name="scheduler-explanations"),
        ]
        self.learning.start()
        if self.settings.directive_interval_ms > 0:
            self._tasks.append(
                asyncio.create_task(self._directive_loop(), name="scheduler-directives")
            )

    async def stop(self) -> None:
        self._stopping = True
        self.explanations.stop()
        self._changed.set()
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            # a cancel landing inside a Redis call can be absorbed by the client's retry
            # logic; the loops also watch `_stopping`, so give them a moment to notice
            await asyncio.wait(self._tasks, timeout=1.0)
        self._tasks = []
        await self.learning.stop()  # what still waits is learned and shared
        await self.commits.close()
        with contextlib.suppress(Exception):
            await self.explanations.flush()
        await self._stop_informer()
        await self.opener.close()
        await self.directives.close()

    async def _stop_informer(self) -> None:
        """Stop the informer (``FleetInformer.stop`` cancels until its task has ended)."""
        await self.informer.stop()

    def ready(self) -> bool:
        """Serving only while the fleet view is within the staleness bound."""
        age = self.informer.age_s()
        metrics.VIEW_AGE_SECONDS.set(min(age, 1e9))
        return age * 1000 <= self.settings.staleness_bound_ms

    # -- Schedule ---------------------------------------------------------------------------

    def _check_fresh(self) -> None:
        age = self.informer.age_s()
        if age * 1000 > self.settings.staleness_bound_ms:
            what = "no fleet view yet" if age == float("inf") else f"fleet view is {age:.1f}s old"
            raise Unavailable(
                f"{what} (staleness bound {self.settings.staleness_bound_ms} ms); "
                "the registry is unreachable"
            )

    @staticmethod
    def _capacity(ws: WorkerState | None) -> tuple[int, int]:
        """(KV bytes, queue slots) the decode worker can take, as this replica knows it:
        its reported free KV memory and free queue slots (-1 = no declared bound)."""
        if ws is None:
            return 0, 0
        v = ws.view
        slots = -1
        if v.load is not None and v.load.queue_max > 0:
            slots = max(0, v.load.queue_max - v.load.queue_depth)
        return v.kv_available_bytes, slots

    async def schedule(self, req: Request) -> ScheduleResult:
        """Plan, reserve and record one request (module docstring)."""
        self._check_fresh()
        refuse_when_full(self.client, self.settings.redis_memory_limit_ratio, "plans")
        s = self.settings
        pol = self._policy
        req.validate()  # InvalidInputError: an InvalidArgument naming the field
        tier = pol.profile.tier(req.tier)
        self.prompt_mix.observe(req.prompt_tokens)
        self.output_mix.observe(req.expected_output_tokens)
        fleet = self.fleet()
        for wid in self.prefill_due.expire(self.clock.now_ms()):
            self._apply(wid)  # its plans presumed prefilled by now stop counting as queued
        resynced = False
        for attempt in range(s.max_plan_attempts):
            now_ms = self.clock.now_ms()
            decision = pol.planner.plan(req, fleet, now_ms / 1000.0, self.rng)
            plan, chain = decision.plan, decision.fallbacks
            if plan is None and self._worth_resync(decision, resynced):
                # our mirror may hold reservations another replica has since released:
                # read the totals once (refusal path only) and plan again
                resynced = True
                await self.sync_reservations()
                continue
            if plan is None:
                replayed = await self._record_reject(decision, req, tier.name, now_ms)
                if replayed is not None:
                    return replayed
                self.explanations.add(req.request_id, decision)
                raise self._refusal(decision, tier.queue_budget_ms)
            plan, chain, session, mode_reason = await self._open_session(
                plan, chain, req.request_id, attempt
            )
            res, head, ask = await self._reserve(
                fleet, decision, req, tier.name, plan, chain, session, mode_reason, now_ms
            )
            fleet = self.fleet()
            if res.status is ReserveStatus.REPLAY:
                prior = (res.head or {}).get("plan") or {}
                if session and prior.get("kv_session_id") != session:
                    self._background(self.opener.abort(session, "duplicate_schedule"))
                return self._replay(res.head or head, req)
            self._mirror(ask, res.decode, res.prefill_tokens)
            if res.status is ReserveStatus.FULL:
                resynced = True  # the script just told us the worker's true totals
                metrics.RESERVATION_CONFLICTS.inc()
                if session:
                    self._background(self.opener.abort(session, "decode_worker_full"))
                continue
            metrics.DECISIONS.labels(decision=decision.kind.value, mode=plan.mode.value).inc()
            self._note_learned(decision, plan)
            self.explanations.add(req.request_id, decision)
            # its prompt counts as queued prefill work until its predicted prefill end
            self.prefill_due.add(
                req.request_id,
                plan.prefill_worker_id,
                plan.prefill_tokens,
                now_ms + int(plan.prefill_end_ms),
                now_ms + s.reservation_ttl_ms,
                now_ms,
                plan.decode_worker_id,  # the prefill worker's own for a local prefill
            )
            note_decision(decision, plan, session, mode_reason)  # the span's (none while off)
            return ScheduleResult(head, False)
        return await self._refuse_fully_reserved(decision, req, tier.name, tier.queue_budget_ms)

    async def _reserve(
        self,
        fleet: Fleet,
        decision: Decision,
        req: Request,
        tier_name: str,
        plan: RoutePlan,
        chain: tuple[FallbackStep, ...],
        session: str,
        mode_reason: str,
        now_ms: int,
    ) -> tuple[ReserveResult, dict[str, Any], ReservationAsk]:
        """Take the plan's reservation and write its record head (one script call, batched
        with concurrent ones by group commit); a Redis away aborts the plan's KV session."""
        s = self.settings
        kv_cap, slot_cap = self._capacity(fleet.worker(plan.decode_worker_id))
        ask = ReservationAsk(
            plan.decode_worker_id,
            plan.decode_kv_bytes,
            kv_cap,
            slot_cap,
            plan.prefill_worker_id,
            plan.prefill_tokens,
        )
        head = head_of(
            decision, req, tier_name, now_ms, self.scheduler_id, plan, chain,
            session, mode_reason, now_ms + s.reservation_ttl_ms, caller_name(),
            current_trace_id(),
        )  # fmt: skip
        # count the reservation in the snapshot while the script runs, so concurrent
        # requests planned meanwhile see it (a burst spreads); undone when the script
        # answers, and replaced by the totals it returns
        self._provisional(fleet, ask, +1)
        try:
            res = await self.commits.reserve(ReserveEntry(
                req.request_id, head, decision.kind.value, ask, now_ms,
                s.reservation_ttl_ms, s.record_ttl_ms,
            ))  # fmt: skip
        except Unavailable:
            if session:
                self._background(self.opener.abort(session, "reservation_failed"))
            raise
        finally:
            self._provisional(fleet, ask, -1)
        return res, head, ask

    async def _open_session(
        self, plan: RoutePlan, chain: tuple[FallbackStep, ...], request_id: str, attempt: int
    ) -> tuple[RoutePlan, tuple[FallbackStep, ...], str, str]:
        """A transfer's KV session with the broker: (plan, fallbacks, session id, why the
        mode changed). A broker that refuses the pair turns the plan into a recompute."""
        session, mode_reason = "", ""
        if plan.mode is Mode.TRANSFER and self.opener.enabled:
            try:
                session = await self.opener.open(
                    session_request_id(request_id, attempt),
                    plan.prefill_worker_id,
                    plan.decode_worker_id,
                    plan.estimates.kv_bytes,
                )
            except SessionRefused as exc:
                plan, chain = as_recompute(plan, chain)
                mode_reason = exc.reason
                metrics.BROKER_FALLBACKS.labels(reason=exc.reason).inc()
        return plan, chain, session, mode_reason

    def _note_learned(self, decision: Decision, plan: RoutePlan) -> None:
        """The explanation says which speed the plan's prefill worker was planned at: its
        learned figures (``policy/learning.py``), its model's measured workers' (``prior``:
        it has none of its own yet), or its declaration (no worker of its model has any)."""
        if decision.record is None:
            return
        wid = plan.prefill_worker_id
        ws = self.fleet().worker(wid)
        got = ws.view.learned if ws is not None else None
        how = "learned" if got is not None and got.samples else "prior"
        decision.record.notes.append(
            f"prefill_speed:{wid}:declared"
            if got is None
            else f"prefill_speed:{wid}:{how}:fixed_ms={got.fixed_ms:.1f}"
            f":scale={got.scale:.3g}:queue_share={got.queue_share:.2f}:samples={got.samples}"
        )
        dws = self.fleet().worker(plan.decode_worker_id)
        step = dws.view.learned_step if dws is not None else None
        if step is not None:
            how = "learned" if step.samples else "prior"
            decision.record.notes.append(
                f"decode_step:{plan.decode_worker_id}:{how}:scale={step.scale:.3g}"
                f":seq_ms={step.seq_ms:.2f}:samples={step.samples}"
            )

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _worth_resync(self, decision: Decision, resynced: bool) -> bool:
        return (
            not resynced
            and bool(self._totals)
            and decision.reject_class != RejectClass.NO_CAPABLE_WORKER
        )
