"""The scheduler's fleet snapshot and its reservation mirror (see `service.py`'s docstring).

The snapshot (`policy.Fleet`) is rebuilt from the informer's in-memory view by a
background loop; the mirror keeps, per worker, the Redis reservation totals this replica
last saw (exact for its own reservations, refreshed for other replicas'), and the snapshot
counts them so scoring sees planned-but-not-started work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from hpd_common.clock import Clock
from hpd_common.errors import Unavailable
from hpd_common.logging import get_logger
from hpd_registry.domain import WorkerRecord
from hpd_registry.informer import FleetChange, FleetInformer
from hpd_scheduler import metrics
from hpd_scheduler.explanations import ExplanationWriter
from hpd_scheduler.feedback import ObservedEstimates
from hpd_scheduler.group_commit import GroupCommit
from hpd_scheduler.learn_store import LearnStore
from hpd_scheduler.learning_queue import LearningQueue
from hpd_scheduler.policy import Fleet, LearnedSpeed, LearnedStep, LinkModel, WorkerView
from hpd_scheduler.policy.learning import prefill_key, step_key
from hpd_scheduler.policy.prefix import PrefixIndex
from hpd_scheduler.policy.worker_state import PromptMix
from hpd_scheduler.prefill_due import PrefillDue
from hpd_scheduler.registry_client import DirectiveSender
from hpd_scheduler.settings import PolicyState, SchedulerSettings
from hpd_scheduler.store import ReservationAsk, SchedulerStore, Totals
from hpd_scheduler.views import link_model, view_of

log = get_logger("scheduler")

_ZERO = Totals()


class SchedulerState:
    """What the parts of the scheduler service share: the attributes `SchedulerService`
    sets up, declared once so each part's methods are checked against them."""

    # the state the parts share (set by SchedulerService.__init__)
    settings: SchedulerSettings
    client: aioredis.Redis
    clock: Clock
    store: SchedulerStore
    commits: GroupCommit
    informer: FleetInformer
    observed: ObservedEstimates
    learn_store: LearnStore
    learning: LearningQueue
    _incarnations: dict[str, int]
    explanations: ExplanationWriter
    directives: DirectiveSender
    prefix: PrefixIndex
    prompt_mix: PromptMix
    output_mix: PromptMix
    prefill_due: PrefillDue
    on_view_synced: Callable[[], None] | None
    _policy: PolicyState
    _views: dict[str, tuple[int, tuple[int, int], WorkerView]]
    _links: tuple[int, LinkModel]
    _fleet: Fleet | None
    _changed: asyncio.Event
    _totals: dict[str, Totals]
    _applied: dict[str, Totals]
    _in_flight: dict[int, ReservationAsk]  # counted provisionally (``_provisional``)
    _batch_caps: dict[str, int]
    _stopping: bool

    def ready(self) -> bool:
        raise NotImplementedError


class FleetSnapshot(SchedulerState):
    """The snapshot and the reservation mirror (module docstring)."""

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
        fresh: dict[str, tuple[int, tuple[int, int], WorkerView]] = {}
        views: list[WorkerView] = []
        workers: dict[str, WorkerRecord] = self.informer.workers
        incarnations = self._incarnations
        learner = obs.learner
        for wid, rec in workers.items():
            inc = rec.state.registered_at_ms
            if incarnations.get(wid) != inc:
                incarnations[wid] = inc  # a new engine: its predecessor's speed is not its
                learner.forget_incarnation(wid, inc)
        priors: dict[str, tuple[LearnedSpeed | None, LearnedStep | None]] = {}
        for wid, rec in workers.items():
            # a worker without a fit follows every fit of its model (the prior)
            own = prefill_key(wid) in learner.fits and step_key(wid) in learner.fits
            ver = (obs.version_of(wid), 0 if own else learner.generation)
            hit = cache.get(wid)
            if hit is not None and hit[0] == rec.revision and hit[1] == ver:
                entry = hit
            else:
                model = rec.spec.model_id
                if model not in priors:
                    peers = [w for w, r in workers.items() if r.spec.model_id == model]
                    priors[model] = (learner.prior(peers), learner.step_prior(peers))
                entry = (rec.revision, ver, view_of(rec, obs, *priors[model]))
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
        now_ms = self.clock.now_ms()
        due = self.prefill_due
        due.expire(now_ms)
        known: dict[str, int] | None = None
        inbound: dict[str, int] | None = None
        if len(due):
            reported = {v.worker_id: v.load.reported_at_ms for v in views if v.load is not None}
            known, inbound = due.counts(reported)
        fleet = Fleet.build(
            views,
            now_ms / 1000.0,
            links=self._links[1],
            previous=self._fleet,
            ref_prompt_tokens=self.prompt_mix.ref_tokens(),
            ref_output_tokens=self.output_mix.ref_tokens(),
            prefix=prefix.entries,
            prefix_heads=prefix.heads,
            known_prefills=known,
            inbound_transfers=inbound,
        )
        applied: dict[str, Totals] = {}
        for wid in self._totals:
            t = applied[wid] = self._effective(wid)
            fleet.reserve(wid, t.kv_bytes, t.prefill_tokens, t.requests)
        self._applied = applied
        for ask in self._in_flight.values():  # reservations whose scripts are in flight
            self._count(fleet, ask, +1)
        self._fleet = fleet
        metrics.FLEET_REBUILD_SECONDS.observe(time.perf_counter() - start)
        metrics.FLEET_WORKERS.set(len(views))
        metrics.export_pools(views)
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
        """Purge lapsed reservations, then mirror every replica's totals; and take in the
        learner's samples when another replica added some."""
        await self.store.purge(self.clock.now_ms())
        totals = await self.store.totals()
        for wid in set(self._totals) | set(totals):
            self._set_totals(wid, totals.get(wid, _ZERO))
        await self.sync_learned()

    def incarnations(self) -> dict[str, int]:
        """Each known worker's incarnation (its registration time)."""
        return {w: r.state.registered_at_ms for w, r in self.informer.workers.items()}

    async def sync_learned(self) -> None:
        stored = await self.learn_store.read_if_changed()
        if stored is not None:
            self.observed.learner.replace(stored, self.incarnations())
            metrics.export_learned(self.observed.learner.fits)
            self._changed.set()

    async def _sync_loop(self) -> None:
        while not self._stopping:
            try:
                await self.sync_reservations()
            except Unavailable as exc:
                log.debug("reservation_sync_failed", error=str(exc))
            except Exception:  # keep mirroring: a failed round must not end the loop
                log.exception("reservation_sync_error")
            await asyncio.sleep(self.settings.reservation_sync_interval_ms / 1000)

    def _provisional(self, fleet: Fleet, ask: ReservationAsk, sign: int) -> None:
        """Count (``sign`` +1) or uncount (-1) a reservation whose script is in flight, in
        the current snapshot (``fleet``, the one the request was planned on, is used only
        before the first snapshot): a snapshot rebuilt while scripts are in flight counts
        them again (``rebuild``), so a burst planned across a rebuild still spreads. Before,
        the new snapshot lost them and the burst piled onto the workers planned before it
        (a burst of 100 on 8 equal workers landed 15 / 8 under a loaded machine)."""
        key = id(ask)
        if sign > 0:
            self._in_flight[key] = ask
        elif self._in_flight.pop(key, None) is None:
            return  # counted by no snapshot (never held)
        self._count(self._fleet if self._fleet is not None else fleet, ask, sign)

    @staticmethod
    def _count(fleet: Fleet, ask: ReservationAsk, sign: int) -> None:
        op = fleet.reserve if sign > 0 else fleet.release
        same = ask.prefill_worker_id == ask.decode_worker_id
        op(ask.decode_worker_id, ask.kv_bytes, ask.prefill_tokens if same else 0, 1)
        if not same and ask.prefill_tokens:
            op(ask.prefill_worker_id, 0, ask.prefill_tokens, 0)

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
