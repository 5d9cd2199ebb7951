"""The scheduler's slower side: the policy in force and its reload, the rebalance and
batch-size recommendations over the current snapshot, and the directives they turn into
(sent through the registry, only on change and rate-limited)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hpd_common.errors import InvalidArgument, Unavailable
from hpd_common.logging import get_logger
from hpd_registry.domain import Directive, DirectiveKind
from hpd_scheduler import metrics
from hpd_scheduler.policy import (
    BatchRecommendation,
    ConfigError,
    LearnedSpeed,
    LearnedStep,
    Planner,
    Profile,
    RebalancePlan,
    Role,
    adapt_batch_size,
    builtin_profile_names,
    rebalance_plan,
)
from hpd_scheduler.policy.fleet import WorkerState
from hpd_scheduler.settings import PolicyState, parse_policy, profile_document
from hpd_scheduler.snapshot import FleetSnapshot
from hpd_scheduler.store import Totals

log = get_logger("scheduler")


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
    learned: LearnedSpeed | None = None
    learned_step: LearnedStep | None = None


@dataclass(frozen=True, slots=True)
class Recommendations:
    models: tuple[ModelRecommendation, ...]
    workers: tuple[WorkerFigures, ...]
    links: tuple[tuple[str, str, float, int], ...]
    computed_at_ms: int


def worker_load(ws: WorkerState) -> float:
    """Capacity-normalised load of a decode worker in [0, 1]: the fullest of its KV memory
    (reservations included), its queue against its declared bound, and its batch against
    its cap."""
    v = ws.view
    load = ws.kv_used_fraction()
    rep = v.load
    if rep is not None:
        if rep.queue_max > 0:
            load = max(load, min(1.0, ws.queue_depth() / rep.queue_max))
        load = max(load, min(1.0, rep.batch_size / max(1, v.max_batch_size)))
    return load


class PolicyAndDirectives(FleetSnapshot):
    """Policy reload, recommendations and directives (module docstring)."""

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
        learned = {k[2:] for k in obs.learner.fits if k[:2] in ("p:", "d:")}
        ids = sorted(
            set(obs.prefill_tps)
            | set(obs.itl_ms)
            | set(self._totals)
            | set(loads_by_worker)
            | learned
        )
        workers = tuple(
            WorkerFigures(
                wid,
                obs.prefill_tps[wid].value if wid in obs.prefill_tps else 0.0,
                obs.itl_ms[wid].value if wid in obs.itl_ms else 0.0,
                obs.samples(wid),
                self.reserved(wid),
                loads_by_worker.get(wid, 0.0),
                obs.learner.prefill(wid),
                obs.learner.step(wid),
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
