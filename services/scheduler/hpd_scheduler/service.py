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
import dataclasses
import os
import random
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import yaml

from hpd_common import auth, native
from hpd_common.clock import Clock
from hpd_common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from hpd_common.logging import get_logger
from hpd_common.redis_conn import refuse_when_full
from hpd_common.server import ServerSettings
from hpd_common.yamlsafe import YamlLimitError, load_bounded
from hpd_registry.domain import Directive, DirectiveKind, WorkerRecord
from hpd_registry.informer import FleetChange, FleetInformer
from hpd_registry.keys import RegistryKeys
from hpd_scheduler import metrics
from hpd_scheduler.broker_client import KvSessionOpener, NoKvBroker, SessionRefused
from hpd_scheduler.explanations import ExplanationWriter
from hpd_scheduler.feedback import ObservedEstimates, observation_from
from hpd_scheduler.group_commit import GroupCommit, GroupCommitSettings
from hpd_scheduler.keys import SchedulerKeys
from hpd_scheduler.kv_events import KvEventFollower
from hpd_scheduler.policy import (
    Action,
    BatchRecommendation,
    ConfigError,
    Decision,
    DecisionKind,
    Fleet,
    InvalidInputError,
    LinkModel,
    Mode,
    Planner,
    Profile,
    Protects,
    RebalancePlan,
    RejectClass,
    Request,
    Role,
    ServingAction,
    WorkerView,
    adapt_batch_size,
    builtin_profile_names,
    parse_profile,
    rebalance_plan,
)
from hpd_scheduler.policy.fleet import PromptMix, WorkerState
from hpd_scheduler.policy.prefix import PrefixIndex
from hpd_scheduler.prefill_due import PrefillDue
from hpd_scheduler.records import as_recompute, head_of, request_digest
from hpd_scheduler.registry_client import DirectiveSender, GrpcDirectiveSender
from hpd_scheduler.store import (
    ReservationAsk,
    ReserveEntry,
    ReserveStatus,
    SchedulerStore,
    StoredRecord,
    Totals,
)
from hpd_scheduler.views import link_model, view_of

log = get_logger("scheduler")

_ZERO = Totals()


@dataclass(frozen=True, slots=True)
class SchedulerSettings(ServerSettings):
    port: int = field(default=50052, metadata={"help": "gRPC port of the scheduler"})
    key_prefix: str = field(
        default="hpd", metadata={"help": "prefix of the scheduler's Redis keys"}
    )
    registry_target: str = field(
        default="127.0.0.1:50051", metadata={"help": "registry host:port (fleet feed, directives)"}
    )
    broker_target: str = field(
        default="",
        metadata={"help": "KV broker host:port; empty = plan transfers without sessions"},
    )
    broker_token: str = field(
        default="", metadata={"help": "scheduler token the KV broker expects (if it has one)"}
    )
    broker_timeout_ms: int = field(
        default=250, metadata={"help": "OpenSession deadline; past it the plan recomputes"}
    )
    profile: str = field(
        default="default", metadata={"help": "built-in profile name or path of a profile YAML"}
    )
    tiers_file: str = field(
        default="", metadata={"help": "YAML of serving tiers replacing the profile's `tiers`"}
    )
    staleness_bound_ms: int = field(
        default=5_000, metadata={"help": "older fleet view: NOT_SERVING and Schedule UNAVAILABLE"}
    )
    reservation_ttl_ms: int = field(
        default=120_000, metadata={"help": "a reservation lapses unless released before"}
    )
    record_ttl_ms: int = field(
        default=3_600_000, metadata={"help": "route records (and idempotency) are kept this long"}
    )
    record_index_cap: int = field(
        default=100_000,
        metadata={
            "help": "most route records kept: older ones are deleted (never one younger "
            "than reservation_ttl_ms), so Redis holds at most about this many"
        },
    )
    fleet_rebuild_interval_ms: int = field(
        default=20, metadata={"help": "fleet changes coalesce into one rebuild per interval"}
    )
    fleet_refresh_ms: int = field(
        default=1_000, metadata={"help": "rebuild at least this often (report confidence ages)"}
    )
    reservation_sync_interval_ms: int = field(
        default=250, metadata={"help": "how often other replicas' reservations are read"}
    )
    max_plan_attempts: int = field(
        default=4, metadata={"help": "re-plans when the chosen worker was fully reserved"}
    )
    ewma_alpha: float = field(
        default=0.2, metadata={"help": "weight of a new outcome in the decaying averages"}
    )
    directive_interval_ms: int = field(
        default=10_000, metadata={"help": "how often recommendations become directives (0 = off)"}
    )
    directive_repeat_ms: int = field(
        default=300_000, metadata={"help": "an unchanged directive is not resent within this"}
    )
    directive_max_per_cycle: int = field(
        default=32, metadata={"help": "most directives sent per cycle"}
    )
    informer_max_backoff_ms: int = field(
        default=2_000, metadata={"help": "longest wait between registry reconnects"}
    )
    group_commit_max_batch: int = field(
        default=64,
        metadata={
            "help": "most Schedule reservations written in one script call (group commit; "
            "1 = off, every call its own)"
        },
    )
    group_commit_wait_us: int = field(
        default=200,
        metadata={
            "help": "longest a reservation waits for the batch in flight before a second "
            "batch goes (0 = only when the batch in flight answers or the batch is full)"
        },
    )
    stream_max_in_flight: int = field(
        default=256,
        metadata={
            "help": "most requests of one ScheduleStream decided at a time (no more are read "
            "until one is answered)"
        },
    )
    processes: int = field(
        default=1,
        metadata={
            "help": "scheduler processes serving this port (SO_REUSEPORT), one per core: each "
            "with its own fleet view, sharing Redis like replicas; needs a fixed --port; "
            "metrics of process i on metrics_port + i"
        },
    )
    scheduler_id: str = field(default="", metadata={"help": "replica name in route records"})
    seed: int = field(default=0, metadata={"help": "seed of the planner's tie-breaking RNG"})

    def validate(self) -> None:
        """Refuse inconsistent settings at start-up, naming the setting."""
        positive = (
            "staleness_bound_ms",
            "reservation_ttl_ms",
            "record_ttl_ms",
            "record_index_cap",
            "fleet_refresh_ms",
            "reservation_sync_interval_ms",
            "max_plan_attempts",
            "broker_timeout_ms",
            "stream_max_in_flight",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise InvalidArgument(name, "must be > 0")
        if self.fleet_rebuild_interval_ms < 0 or self.directive_interval_ms < 0:
            raise InvalidArgument("fleet_rebuild_interval_ms", "must be >= 0")
        if self.record_ttl_ms < self.reservation_ttl_ms:
            raise InvalidArgument(
                "record_ttl_ms", "must be >= reservation_ttl_ms (the record is the idempotency key)"
            )
        if not 0 < self.ewma_alpha <= 1:
            raise InvalidArgument("ewma_alpha", "must be in (0, 1]")
        if not 1 <= self.processes <= 256:
            raise InvalidArgument("processes", "must be within 1..256")
        try:
            self.group_commit().validate()
        except ValueError as exc:
            name = str(exc).split()[0]
            raise InvalidArgument(name, str(exc).removeprefix(name).strip()) from None

    def group_commit(self) -> GroupCommitSettings:
        return GroupCommitSettings(self.group_commit_max_batch, self.group_commit_wait_us)


@dataclass(frozen=True, slots=True)
class PolicyState:
    """The profile in force, its planner and where it came from."""

    profile: Profile
    planner: Planner
    source_yaml: str
    generation: int
    loaded_at_ms: int


@dataclass(frozen=True, slots=True)
class ScheduleResult:
    head: dict[str, Any]
    replayed: bool


@dataclass(frozen=True, slots=True)
class RecordQuery:
    """Filters of ListRouteRecords; empty / zero / None = any."""

    since_ms: int = 0
    until_ms: int = 0
    tier: str = ""
    worker_id: str = ""
    decision: str = ""
    mode: str = ""
    model_id: str = ""

    def matches(self, head: dict[str, Any]) -> bool:
        if self.tier and head.get("tier") != self.tier:
            return False
        if self.decision and head.get("decision") != self.decision:
            return False
        if self.model_id and head.get("model_id") != self.model_id:
            return False
        plan = head.get("plan") or {}
        if self.mode and plan.get("mode") != self.mode:
            return False
        return not (
            self.worker_id
            and self.worker_id not in (plan.get("prefill_worker_id"), plan.get("decode_worker_id"))
        )


@dataclass(frozen=True, slots=True)
class ModelRecommendation:
    model_id: str
    rebalance: RebalancePlan
    batch: tuple[tuple[str, int, BatchRecommendation, float, float], ...]
    """(worker id, current max, recommendation, ITL p99 compared, target ITL)."""


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    worker_id: str
    prefill_tokens_per_s: float
    itl_ms: float
    samples: int
    reserved: Totals
    load: float


@dataclass(frozen=True, slots=True)
class Recommendations:
    models: tuple[ModelRecommendation, ...]
    workers: tuple[WorkerFigures, ...]
    links: tuple[tuple[str, str, float, int], ...]
    computed_at_ms: int


def profile_document(ref: str) -> str:
    """The YAML text of a built-in profile name or a profile file path."""
    if ref in builtin_profile_names():
        res = resources.files("hpd_scheduler.policy") / "profiles" / f"{ref}.yaml"
        return res.read_text(encoding="utf-8")
    try:
        return Path(ref).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            "profile", f"no built-in profile or readable file {ref!r}: {exc.strerror}"
        ) from None


def parse_policy(text: str, tiers_text: str = "") -> tuple[Profile, str]:
    """Validate a profile document (with optional tiers replacing its own). Raises
    ConfigError naming the offending key."""
    try:
        doc = load_bounded(text)
        if tiers_text:
            tiers = load_bounded(tiers_text)
            if not isinstance(tiers, dict):
                raise ConfigError("tiers", "the tiers file must hold a mapping")
            if not isinstance(doc, dict):
                raise ConfigError("profile", "must be a mapping")
            doc["tiers"] = tiers.get("tiers", tiers)
            text = yaml.safe_dump(doc, sort_keys=False)
    except YamlLimitError as exc:
        raise ConfigError("profile", f"refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError("profile", f"invalid YAML: {exc}") from None
    try:
        return parse_profile(doc), text
    except InvalidInputError as exc:
        raise ConfigError(exc.field, exc.message) from None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("profile", f"malformed document: {exc}") from None


def worker_load(ws: WorkerState) -> float:
    """Capacity-normalised load of a decode worker in [0, 1]: the fullest of its KV memory
    (reservations included), its queue against its declared bound, and its batch against
    its cap."""
    v = ws.view
    load = ws.kv_used_fraction()
    rep = v.load
    if rep is not None:
        if rep.max_queue_depth > 0:
            load = max(load, min(1.0, ws.queue_depth() / rep.max_queue_depth))
        load = max(load, min(1.0, rep.batch_size / max(1, v.max_batch_size)))
    return load


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


def _caller() -> str:
    """The name of the caller being served (auth on), else ''."""
    who = auth.current()
    return who.name if who is not None else ""


class SchedulerService:
    """The scheduler's use cases; the gRPC servicer is a thin layer over this."""

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
        self._views: dict[str, tuple[int, int, WorkerView]] = {}
        self._links: tuple[int, LinkModel] = (-1, LinkModel())
        self._fleet: Fleet | None = None
        self._changed = asyncio.Event()
        self._totals: dict[str, Totals] = {}
        self._applied: dict[str, Totals] = {}  # what the snapshot counts (_effective)
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
        await self.commits.close()
        with contextlib.suppress(Exception):
            await self.explanations.flush()
        await self._stop_informer()
        await self.opener.close()
        await self.directives.close()

    async def _stop_informer(self) -> None:
        """Stop the informer (``FleetInformer.stop`` cancels until its task has ended)."""
        await self.informer.stop()

    def view_age_s(self) -> float:
        return self.informer.age_s()

    def ready(self) -> bool:
        """Serving only while the fleet view is within the staleness bound."""
        age = self.informer.age_s()
        metrics.VIEW_AGE_SECONDS.set(min(age, 1e9))
        return age * 1000 <= self.settings.staleness_bound_ms

    # -- fleet snapshot ---------------------------------------------------------------------

    def _on_change(self, change: FleetChange) -> None:
        self._changed.set()
        if change.kind == "resync" and self.on_view_synced is not None:
            self.on_view_synced()

    def rebuild(self) -> Fleet:
        """A new snapshot from the informer's view (views cached per record revision and
        estimate version, so only changed workers are converted), with the reservation
        mirror applied."""
        start = time.perf_counter()
        obs = self.observed
        cache = self._views
        fresh: dict[str, tuple[int, int, WorkerView]] = {}
        views: list[WorkerView] = []
        workers: dict[str, WorkerRecord] = self.informer.workers
        for wid, rec in workers.items():
            ver = obs.version.get(wid, 0)
            hit = cache.get(wid)
            if hit is not None and hit[0] == rec.revision and hit[1] == ver:
                entry = hit
            else:
                entry = (rec.revision, ver, view_of(rec, obs))
            fresh[wid] = entry
            views.append(entry[2])
        self._views = fresh
        if self._links[0] != obs.links_version:
            self._links = (obs.links_version, link_model(obs.link_gbps))
        prefix = self.prefix
        if self.informer.synced:
            for wid in [w for w in prefix.entries if w not in workers]:
                prefix.forget(wid)  # left the fleet: its engine's cache went with it
        for wid, (bt, _) in list(prefix.entries.items()):
            held_by = workers.get(wid)
            if held_by is not None and bt > 0:
                # an engine holds at most its KV memory in blocks: the index no more
                per_block = held_by.spec.kv_format.bytes_per_token() * bt
                cap = held_by.spec.kv_memory_total_bytes // per_block if per_block > 0 else 0
                if cap > 0 and prefix.capacity(wid) != cap:
                    prefix.set_capacity(wid, cap)
        fleet = Fleet.build(
            views,
            self.clock.now_ms() / 1000.0,
            links=self._links[1],
            previous=self._fleet,
            ref_prompt_tokens=self.prompt_mix.ref_tokens(),
            prefix=prefix.entries,
            prefix_heads=prefix.heads,
        )
        self.prefill_due.expire(self.clock.now_ms())
        applied: dict[str, Totals] = {}
        for wid in self._totals:
            t = applied[wid] = self._effective(wid)
            fleet.reserve(wid, t.kv_bytes, t.prefill_tokens, t.requests)
        self._applied = applied
        self._fleet = fleet
        metrics.FLEET_REBUILD_SECONDS.observe(time.perf_counter() - start)
        metrics.FLEET_WORKERS.set(len(views))
        return fleet

    def fleet(self) -> Fleet:
        """The current snapshot (built now if there is none yet)."""
        return self._fleet if self._fleet is not None else self.rebuild()

    async def _rebuild_loop(self) -> None:
        s = self.settings
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(s.fleet_refresh_ms / 1000):
                    await self._changed.wait()
            self._changed.clear()
            if self.informer.synced:
                try:
                    self.rebuild()
                except Exception:  # a bad record must not stop the loop; old snapshot stays
                    log.exception("fleet_rebuild_failed")
            await asyncio.sleep(s.fleet_rebuild_interval_ms / 1000)

    # -- reservation mirror -----------------------------------------------------------------

    def _set_totals(self, worker_id: str, new: Totals) -> None:
        old = self._totals.get(worker_id, _ZERO)
        if new == old:
            return
        if new == _ZERO:
            self._totals.pop(worker_id, None)
        else:
            self._totals[worker_id] = new
        self._apply(worker_id)

    def _effective(self, worker_id: str) -> Totals:
        """What the snapshot counts against a worker: the mirrored totals, less the prompt
        tokens of this replica's plans presumed prefilled already (``prefill_due``)."""
        t = self._totals.get(worker_id, _ZERO)
        done = self.prefill_due.done_tokens(worker_id)
        if not done:
            return t
        return Totals(t.kv_bytes, t.requests, max(0, t.prefill_tokens - done))

    def _apply(self, worker_id: str) -> None:
        """Bring the snapshot's count for a worker to its effective totals (by difference
        from what was applied last, so provisional reservations in flight stay counted)."""
        fleet = self._fleet
        if fleet is None:
            return
        new = self._effective(worker_id)
        old = self._applied.get(worker_id, _ZERO)
        if new == old:
            return
        if new == _ZERO:
            self._applied.pop(worker_id, None)
        else:
            self._applied[worker_id] = new
        dk = new.kv_bytes - old.kv_bytes
        dn = new.requests - old.requests
        dt = new.prefill_tokens - old.prefill_tokens
        fleet.reserve(worker_id, max(dk, 0), max(dt, 0), max(dn, 0))
        fleet.release(worker_id, max(-dk, 0), max(-dt, 0), max(-dn, 0))

    def reserved(self, worker_id: str) -> Totals:
        """Live reservations against a worker as this replica last saw them."""
        return self._totals.get(worker_id, _ZERO)

    async def sync_reservations(self) -> None:
        """Purge lapsed reservations, then mirror every replica's totals."""
        await self.store.purge(self.clock.now_ms())
        totals = await self.store.totals()
        for wid in set(self._totals) | set(totals):
            self._set_totals(wid, totals.get(wid, _ZERO))

    async def _sync_loop(self) -> None:
        while not self._stopping:
            try:
                await self.sync_reservations()
            except Unavailable as exc:
                log.debug("reservation_sync_failed", error=str(exc))
            except Exception:  # keep mirroring: a failed round must not end the loop
                log.exception("reservation_sync_error")
            await asyncio.sleep(self.settings.reservation_sync_interval_ms / 1000)

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
        if v.load is not None and v.load.max_queue_depth > 0:
            slots = max(0, v.load.max_queue_depth - v.load.queue_depth)
        return v.kv_available_bytes, slots

    def _refusal(self, decision: Decision, tier_budget_ms: float) -> Exception:
        reasons = ", ".join(decision.reject_reasons) or "no_executable_pool"
        cls = decision.reject_class or RejectClass.SATURATED
        metrics.REJECTIONS.labels(reject_class=cls).inc()
        if cls == RejectClass.NO_CAPABLE_WORKER:
            pools = decision.record.rejected_pools
            detail = "; ".join(f"{k}: {','.join(v)}" for k, v in sorted(pools.items()))
            lead = {
                "no_worker_for_model": "the model has no worker in the fleet",
                "no_decode_worker_for_model": (
                    "the model has prefill workers but no worker that can decode"
                ),
            }.get(decision.reject_reasons[0] if decision.reject_reasons else "")
            return FailedPrecondition(
                f"{lead or 'no worker can serve this request'} ({reasons})"
                + (f" [{detail}]" if detail else ""),
                {k: list(v) for k, v in pools.items()},
            )
        retry = decision.retry_after_ms if decision.retry_after_ms is not None else tier_budget_ms
        return ResourceExhausted(f"{cls}: {reasons}", retry_after_ms=max(1, int(retry)))

    async def schedule(self, req: Request) -> ScheduleResult:
        """Plan, reserve and record one request (module docstring)."""
        self._check_fresh()
        refuse_when_full(self.client, self.settings.redis_memory_limit_ratio, "plans")
        s = self.settings
        pol = self._policy
        try:
            req.validate()
            tier = pol.profile.tier(req.tier)
        except InvalidInputError as exc:
            raise InvalidArgument(exc.field, exc.message) from None
        self.prompt_mix.observe(req.prompt_tokens)
        fleet = self.fleet()
        for wid in self.prefill_due.expire(self.clock.now_ms()):
            self._apply(wid)  # its plans presumed prefilled by now stop counting as queued
        resynced = False
        for attempt in range(s.max_plan_attempts):
            now_ms = self.clock.now_ms()
            try:
                decision = pol.planner.plan(req, fleet, now_ms / 1000.0, self.rng)
            except InvalidInputError as exc:
                raise InvalidArgument(exc.field, exc.message) from None
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
            session, mode_reason = "", ""
            if plan.mode is Mode.TRANSFER and self.opener.enabled:
                try:
                    session = await self.opener.open(
                        session_request_id(req.request_id, attempt),
                        plan.prefill_worker_id,
                        plan.decode_worker_id,
                        plan.estimates.kv_bytes,
                    )
                except SessionRefused as exc:
                    plan, chain = as_recompute(plan, chain)
                    mode_reason = exc.reason
                    metrics.BROKER_FALLBACKS.labels(reason=exc.reason).inc()
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
                decision, req, tier.name, now_ms, self.scheduler_id, plan, chain,
                session, mode_reason, now_ms + s.reservation_ttl_ms, _caller(),
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
            self.explanations.add(req.request_id, decision)
            # its prompt counts as queued prefill work until its predicted first token
            self.prefill_due.add(
                req.request_id,
                plan.prefill_worker_id,
                plan.prefill_tokens,
                now_ms + int(plan.estimates.ttft_ms),
                now_ms + s.reservation_ttl_ms,
            )
            return ScheduleResult(head, False)
        # every attempt found its decode worker full: refused, and recorded as refused like
        # any other reject (a refused request always has its REJECT record)
        retry_ms = max(1, int(tier.queue_budget_ms))
        refused = dataclasses.replace(
            decision,
            kind=DecisionKind.REJECT,
            plan=None,
            fallbacks=(),
            action=ServingAction(Action.REJECT, Protects.LATENCY),
            reject_reasons=("decode_workers_fully_reserved",),
            reject_class=RejectClass.SATURATED,
            retry_after_ms=float(retry_ms),
        )
        replayed = await self._record_reject(refused, req, tier.name, self.clock.now_ms())
        if replayed is not None:
            return replayed
        metrics.REJECTIONS.labels(reject_class=RejectClass.SATURATED).inc()
        raise ResourceExhausted(
            "saturated: every capable decode worker is fully reserved",
            retry_after_ms=retry_ms,
        )

    async def _record_reject(
        self, decision: Decision, req: Request, tier: str, now_ms: int
    ) -> ScheduleResult | None:
        """Write a refusal's REJECT record (a refused request always has one; a Redis that
        cannot take it is logged, the refusal stands). Returns the stored answer instead
        when the request id was already decided (a retry)."""
        s = self.settings
        head = head_of(decision, req, tier, now_ms, self.scheduler_id, caller=_caller())
        try:
            res = await self.commits.reserve(ReserveEntry(
                req.request_id, head, "reject", None, now_ms,
                s.reservation_ttl_ms, s.record_ttl_ms,
            ))  # fmt: skip
        except Unavailable:
            log.warning("reject_record_lost", request_id=req.request_id)
            return None
        if res.status is ReserveStatus.REPLAY and res.head is not None:
            return self._replay(res.head, req)
        return None

    @staticmethod
    def _replay(head: dict[str, Any], req: Request) -> ScheduleResult:
        """The stored answer to a retried request id; ALREADY_EXISTS when the retry asks
        for something else (a different body under the same id is a caller's bug, and the
        old plan would silently answer the wrong question). Records written before the
        digest was kept replay as before."""
        stored = head.get("request_digest")
        if stored and stored != request_digest(req):
            raise AlreadyExists(
                f"request id {req.request_id!r} was scheduled with a different request "
                "(model, tokens, tier, hints, revision or pool); use a new id"
            )
        metrics.REPLAYS.inc()
        return ScheduleResult(head, True)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    @staticmethod
    def _provisional(fleet: Fleet, ask: ReservationAsk, sign: int) -> None:
        op = fleet.reserve if sign > 0 else fleet.release
        same = ask.prefill_worker_id == ask.decode_worker_id
        op(ask.decode_worker_id, ask.kv_bytes, ask.prefill_tokens if same else 0, 1)
        if not same and ask.prefill_tokens:
            op(ask.prefill_worker_id, 0, ask.prefill_tokens, 0)

    def _worth_resync(self, decision: Decision, resynced: bool) -> bool:
        return (
            not resynced
            and bool(self._totals)
            and decision.reject_class != RejectClass.NO_CAPABLE_WORKER
        )

    def _mirror(self, ask: ReservationAsk, decode: Totals, prefill_tokens: int) -> None:
        dw, pw = ask.decode_worker_id, ask.prefill_worker_id
        if pw == dw:
            self._set_totals(dw, Totals(decode.kv_bytes, decode.requests, prefill_tokens))
            return
        self._set_totals(
            dw, Totals(decode.kv_bytes, decode.requests, self.reserved(dw).prefill_tokens)
        )
        if ask.prefill_tokens > 0:
            old = self.reserved(pw)
            self._set_totals(pw, Totals(old.kv_bytes, old.requests, prefill_tokens))

    # -- route records ----------------------------------------------------------------------

    async def get_record(self, request_id: str) -> StoredRecord:
        await self.explanations.write_now(request_id)  # a waiting explanation: now
        rec = await self.store.get(request_id)
        if rec is None:
            raise NotFound("route record", request_id)
        return rec

    async def list_records(
        self, query: RecordQuery, page_size: int, token: str, scan_limit: int = 5_000
    ) -> tuple[list[StoredRecord], str]:
        """Newest first. The token is ``<created ms>:<request id>`` of the last entry
        looked at; members with equal scores come in descending id order, so the next
        page resumes strictly after it. At most ``scan_limit`` index entries are examined
        per call (a sparse filter returns a short page and a token to continue)."""
        after: tuple[int, str] | None = None
        if token:
            t_ms, sep, t_rid = token.partition(":")
            if not sep or not t_ms.isdigit() or not t_rid or len(t_ms) > 15:
                raise InvalidArgument("page_token", "malformed")
            after = (int(t_ms), t_rid)
        top: int | None = query.until_ms or None
        if after is not None:
            top = after[0] if top is None else min(top, after[0])
        out: list[StoredRecord] = []
        scanned = 0
        last: tuple[int, str] | None = None
        skip = 0
        while len(out) < page_size and scanned < scan_limit:
            batch = min(256, scan_limit - scanned)
            rows = await self.store.index_page(top, query.since_ms, batch + skip)
            rows = rows[skip:]
            if not rows:
                return out, ""
            fresh = [
                (rid, ms)
                for rid, ms in rows
                if after is None or ms < after[0] or (ms == after[0] and rid < after[1])
            ]
            if not fresh:
                skip += len(rows)
                continue
            skip = 0
            heads = await self.store.heads([rid for rid, _ in fresh])
            for (rid, ms), rec in zip(fresh, heads, strict=True):
                scanned += 1
                last = (ms, rid)
                if rec is not None and query.matches(rec.head):
                    out.append(rec)
                    if len(out) >= page_size:
                        break
            assert last is not None
            after = last
            top = last[0]
            if len(rows) < batch:
                if len(out) < page_size:
                    return out, ""
                break
        return out, (f"{last[0]}:{last[1]}" if last else "")

    # -- outcomes ---------------------------------------------------------------------------

    async def report_outcome(self, request_id: str, outcome: dict[str, Any]) -> tuple[bool, bool]:
        """Release the reservation, attach the outcome, learn from it (once).
        Returns (released, first_report)."""
        now_ms = self.clock.now_ms()
        outcome = {**outcome, "reported_at_ms": now_ms}
        who = auth.current()
        owner = "" if who is None or who.operator else who.name
        res = await self.store.report_outcome(request_id, outcome, owner)
        if res.not_owner:
            raise PermissionDenied(
                f"request {request_id!r} was scheduled by another caller; "
                "only it (or an operator) may report its outcome"
            )
        if not res.record_found and not res.released:
            raise NotFound("route record", request_id)
        plan = (res.head or {}).get("plan") or {}
        if res.released and plan:
            dw = str(plan.get("decode_worker_id", ""))
            pw = str(plan.get("prefill_worker_id", ""))
            kv = int(plan.get("reserved_kv_bytes") or 0)
            tokens = int(plan.get("prefill_tokens") or 0)
            # forgotten first, so the totals' release below leaves the snapshot's count of
            # queued tokens right whether or not they were presumed prefilled already
            self.prefill_due.release(request_id)
            old = self.reserved(dw)
            self._set_totals(
                dw,
                Totals(
                    max(0, old.kv_bytes - kv),
                    max(0, old.requests - 1),
                    max(0, old.prefill_tokens - (tokens if pw == dw else 0)),
                ),
            )
            if pw != dw and tokens:
                old = self.reserved(pw)
                self._set_totals(
                    pw,
                    Totals(old.kv_bytes, old.requests, max(0, old.prefill_tokens - tokens)),
                )
            self._apply(pw)
            self._apply(dw)
        metrics.OUTCOMES.labels(success=str(bool(outcome.get("success"))).lower()).inc()
        if res.first_report and plan:
            obs = observation_from(plan, outcome)
            if obs is not None:
                self.observed.observe(obs, now_ms / 1000.0)
                self._changed.set()
        return res.released, res.first_report

    # -- policy -----------------------------------------------------------------------------

    @property
    def policy(self) -> PolicyState:
        return self._policy

    async def reload_policy(self, builtin: str, yaml_text: str, dry_run: bool) -> PolicyState:
        """Validate and (unless dry_run) install a new profile. A bad one raises
        InvalidArgument naming the key; the current profile stays. The document is parsed
        on a worker thread (bounded first: :mod:`hpd_common.yamlsafe`), so heartbeats and
        plans on the event loop do not wait for it."""
        profile, text = await asyncio.to_thread(self._parse_policy, builtin, yaml_text)
        old = self._policy
        state = PolicyState(
            profile, Planner(profile), text, old.generation + 1, self.clock.now_ms()
        )
        if dry_run:
            return state
        self._policy = state
        log.info("policy_reloaded", profile=profile.name, generation=state.generation)
        return state

    @staticmethod
    def _parse_policy(builtin: str, yaml_text: str) -> tuple[Profile, str]:
        try:
            if builtin:
                if builtin not in builtin_profile_names():
                    raise InvalidArgument(
                        "builtin_profile",
                        f"unknown profile {builtin!r}; known: {builtin_profile_names()}",
                    )
                text = profile_document(builtin)
            elif yaml_text:
                text = yaml_text
            else:
                raise InvalidArgument("source", "give builtin_profile or profile_yaml")
            return parse_policy(text)
        except ConfigError as exc:
            field = "profile_yaml" if yaml_text else "builtin_profile"
            raise InvalidArgument(f"{field}.{exc.key_path}", exc.message) from None

    # -- recommendations and directives ---------------------------------------------------

    def recommendations(self, model_id: str = "") -> Recommendations:
        """Rebalance plans and batch-size recommendations per model over the decode
        workers of the current snapshot (pure functions of seed 001, fed with capacity-
        normalised loads and, where a worker reports no ITL, the observed one)."""
        fleet = self.fleet()
        pol = self._policy
        target = pol.profile.tier("").tpot_ms
        models: list[ModelRecommendation] = []
        loads_by_worker: dict[str, float] = {}
        for (mid, role), index in sorted(fleet.indexes.items()):
            if role is not Role.DECODE or (model_id and mid != model_id):
                continue
            loads = {ws.worker_id: worker_load(ws) for ws in index.workers}
            loads_by_worker.update(loads)
            caps = {ws.worker_id: max(ws.cap.hbm_gbps_total, 1e-6) for ws in index.workers}
            queued = {ws.worker_id: ws.queue_depth() for ws in index.workers}
            plan = rebalance_plan(loads, caps, queued)
            batch: list[tuple[str, int, BatchRecommendation, float, float]] = []
            for ws in index.workers:
                v = ws.view
                itl = v.load.itl_p99_ms if v.load is not None else 0.0
                if itl <= 0:
                    seen = self.observed.itl_ms.get(ws.worker_id)
                    itl = seen.value if seen else 0.0
                if itl <= 0:
                    continue
                current = min(
                    self._batch_caps.get(ws.worker_id, v.max_batch_size), v.max_batch_size
                )
                rec = adapt_batch_size(current, v.max_batch_size, itl, target, ws.queue_depth())
                batch.append((ws.worker_id, current, rec, itl, target))
            models.append(ModelRecommendation(mid, plan, tuple(batch)))
        obs = self.observed
        ids = sorted(
            set(obs.prefill_tps) | set(obs.itl_ms) | set(self._totals) | set(loads_by_worker)
        )
        workers = tuple(
            WorkerFigures(
                wid,
                obs.prefill_tps[wid].value if wid in obs.prefill_tps else 0.0,
                obs.itl_ms[wid].value if wid in obs.itl_ms else 0.0,
                obs.samples(wid),
                self.reserved(wid),
                loads_by_worker.get(wid, 0.0),
            )
            for wid in ids
        )
        links = tuple(
            (src, dst, e.value, e.samples) for (src, dst), e in sorted(obs.link_gbps.items())
        )
        return Recommendations(tuple(models), workers, links, self.clock.now_ms())

    async def send_directives(self) -> int:
        """Turn the current recommendations into directives: SET_MAX_BATCH_SIZE for a
        changed batch cap, MIGRATE for each rebalance move; each only when it differs from
        the last one of its kind sent to that worker by any replica within
        `directive_repeat_ms`, and at most `directive_max_per_cycle`. Returns how many."""
        s = self.settings
        recs = self.recommendations()
        wanted: list[tuple[str, str, str, Directive]] = []
        for m in recs.models:
            for wid, _current, b, itl, tgt in m.batch:
                if b.change.value == "keep":
                    continue
                d = Directive(
                    kind=DirectiveKind.SET_MAX_BATCH_SIZE,
                    max_batch_size=b.max_batch_size,
                    reason=f"{b.reason}: itl_p99 {itl:.1f} ms vs target {tgt:.1f} ms",
                    issuer="scheduler",
                )
                wanted.append((wid, "batch", str(b.max_batch_size), d))
            for mv in m.rebalance.moves:
                frac = round(min(1.0, mv.fraction), 2)
                if frac <= 0:
                    continue
                d = Directive(
                    kind=DirectiveKind.MIGRATE,
                    target_worker_id=mv.dst,
                    fraction=frac,
                    reason=f"rebalance: mean load {m.rebalance.mean_load:.2f}",
                    issuer="scheduler",
                )
                wanted.append((mv.src, "migrate", f"{mv.dst}:{frac}", d))
        sent = 0
        for wid, kind, value, d in wanted:
            if sent >= s.directive_max_per_cycle:
                break
            if not await self.store.directive_changed(wid, kind, value, s.directive_repeat_ms):
                continue
            refused = await self.directives.send(wid, d)
            if refused is not None:
                log.warning("directive_not_sent", worker_id=wid, kind=kind, code=refused)
                continue
            if kind == "batch":
                self._batch_caps[wid] = d.max_batch_size
            metrics.DIRECTIVES_SENT.labels(kind=kind).inc()
            log.info("directive_sent", worker_id=wid, kind=kind, value=value)
            sent += 1
        return sent

    async def _directive_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.settings.directive_interval_ms / 1000)
            if not self.ready():
                continue
            try:
                await self.send_directives()
            except Unavailable as exc:
                log.warning("directives_skipped", error=str(exc))
            except Exception:  # skip this round, keep sending later ones
                log.exception("directives_error")
