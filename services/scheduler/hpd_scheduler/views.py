"""Registry records as the planner's worker views, with observed figures folded in. Pure.

Health is taken from the registry's flags (unhealthy, suspect, draining, cordoned), not
re-derived from heartbeat timestamps here: the registry owns liveness, announces expiry
as a deletion, and a worker heartbeating without a load report produces no feed event,
so a local clock comparison would wrongly call it suspect.

Free KV memory is ``total x free blocks / total blocks`` from the last load report, or the
whole total when the worker has not reported yet.

Observed estimates (``feedback.py``) fill the figures the worker's own report lacks: a
report's ``prefill_tokens_per_s`` / ``itl_p50_ms`` of 0 means "not measured" and is replaced
by the outcome-fed average; a worker that never reported gets a report carrying only those
averages, dated when the last outcome arrived, so the planner's staleness confidence
applies to them exactly as to a report. The learner's fitted prefill speed, when it has
one, is the view's ``learned`` figure, which the planner takes over both; a worker without
one gets ``prior``, its model's measured workers' median (``SpeedLearner.prior``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hpd_registry.domain import WorkerRecord, flag_health
from hpd_scheduler.feedback import Ewma, ObservedEstimates
from hpd_scheduler.policy import (
    Health,
    LearnedSpeed,
    LearnedStep,
    Link,
    LinkModel,
    LoadReport,
    WorkerView,
)

__all__ = ["health_of", "link_model", "view_of"]


def health_of(rec: WorkerRecord) -> Health:
    """The registry's flags as a policy health, by the registry's precedence."""
    st = rec.state
    flagged = flag_health(
        unhealthy=st.unhealthy, suspect=st.suspect, draining=st.draining, cordoned=st.cordoned
    )
    return flagged


def view_of(
    rec: WorkerRecord,
    observed: ObservedEstimates | None = None,
    prior: LearnedSpeed | None = None,
    step_prior: LearnedStep | None = None,
) -> WorkerView:
    """The planner's view of one registry record (module docstring); ``prior`` and
    ``step_prior`` the speeds a worker without fits of its own is planned at."""
    spec = rec.spec
    total = spec.kv_memory_total_bytes
    free = total
    load: LoadReport | None = None
    r = rec.load
    tps_obs: Ewma | None = None
    itl_obs: Ewma | None = None
    if observed is not None:
        tps_obs = observed.prefill_tps.get(spec.worker_id)
        itl_obs = observed.itl_ms.get(spec.worker_id)
    if r is not None:
        if r.kv_blocks_total > 0:
            free = int(total * min(1.0, max(0.0, r.kv_blocks_free / r.kv_blocks_total)))
        load = r
        if (not r.prefill_tokens_per_s and tps_obs) or (not r.itl_p50_ms and itl_obs):
            load = replace(
                r,
                prefill_tokens_per_s=r.prefill_tokens_per_s or (tps_obs.value if tps_obs else 0.0),
                itl_p50_ms=r.itl_p50_ms or (itl_obs.value if itl_obs else 0.0),
            )
    elif tps_obs is not None or itl_obs is not None:
        when = max(
            tps_obs.updated_at_s if tps_obs else 0.0, itl_obs.updated_at_s if itl_obs else 0.0
        )
        load = LoadReport(
            reported_at_ms=round(when * 1000),
            itl_p50_ms=itl_obs.value if itl_obs else 0.0,
            prefill_tokens_per_s=tps_obs.value if tps_obs else 0.0,
        )
    learner = observed.learner if observed is not None else None
    learned = (learner.prefill(spec.worker_id) if learner is not None else None) or prior
    step = (learner.step(spec.worker_id) if learner is not None else None) or step_prior
    return WorkerView(
        spec,
        kv_available_bytes=free,
        health=health_of(rec),
        load=load,
        learned=learned,
        learned_step=step,
    )


def link_model(
    observed: Mapping[tuple[str, str], Ewma], base: LinkModel | None = None
) -> LinkModel:
    """The link model with observed pool-pair rates as overrides (latency folded into the
    rate, so 0 ms)."""
    base = base or LinkModel()
    overrides = dict(base.pool_overrides)
    for pair, ewma in observed.items():
        if ewma.samples and ewma.value > 0:
            overrides[pair] = Link(gbps=ewma.value, latency_ms=0.0)
    return LinkModel(classes=base.classes, pool_overrides=overrides)
