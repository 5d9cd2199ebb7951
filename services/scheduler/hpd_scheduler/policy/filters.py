"""The built-in filters: each drops, with its reason, the workers that cannot or must not
take a request for a role (``Filter``; registered with the other plugins in
``plugins.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .domain import Role
from .errors import InvalidInputError
from .fleet import WorkerState
from .framework import Filter, RequestContext
from .mechanisms import memory_reason, revision_reason, stage_reason

__all__ = [
    "DecodeMemoryFilter",
    "ExecutionGateFilter",
    "LabelSelectorFilter",
    "ProbeFilter",
    "QueueCapacityFilter",
    "StalenessFilter",
]

_PREFILL = frozenset({Role.PREFILL})
_DECODE = frozenset({Role.DECODE})


class ExecutionGateFilter(Filter):
    """Execution compatibility per request: the stage is served (``unsupported_stage``,
    `mechanisms.stage_reason`) and, when the request pins a model revision, the worker runs
    it (``model_revision_mismatch``, `mechanisms.revision_reason`). Health, model and GPU
    are gated once per snapshot by the fleet index (`mechanisms.health_reason`)."""

    type_name: ClassVar[str] = "execution-gate-filter"

    def drop_reason(self, ws: WorkerState, role: Role, ctx: RequestContext) -> str | None:
        view = ws.view
        reason = stage_reason(view.stage, role)
        if reason is None:
            reason = revision_reason(ctx.request.model_revision, view.model_revision)
        return reason


@dataclass(frozen=True, slots=True)
class MemoryParams:
    """``headroom``: required free KV = request KV x headroom (seed: 1.2)."""

    headroom: float = 1.2

    def __post_init__(self) -> None:
        if not self.headroom >= 1.0:
            raise InvalidInputError("headroom", f"must be >= 1, got {self.headroom}")


class DecodeMemoryFilter(Filter):
    """Seed decode gate: drop (``insufficient_memory``, `mechanisms.memory_reason`) when
    ``available KV - reservations < (prompt + output) x bytes/token x headroom``."""

    type_name: ClassVar[str] = "decode-memory-filter"
    Params = MemoryParams
    roles: ClassVar[frozenset[Role]] = _DECODE

    def drop_reason(self, ws: WorkerState, role: Role, ctx: RequestContext) -> str | None:
        r = ctx.request
        need = (r.prompt_tokens + r.expected_output_tokens) * ws.cap.kv_bytes_per_token
        return memory_reason(ws.available_kv(), need, self.params.headroom)


class QueueCapacityFilter(Filter):
    """Drop (``queue_full``) when the worker declared a queue bound and its queue (with
    reservations) has reached it."""

    type_name: ClassVar[str] = "queue-capacity-filter"

    def drop_reason(self, ws: WorkerState, role: Role, ctx: RequestContext) -> str | None:
        if ws.queue_max > 0 and ws.queue_depth() >= ws.queue_max:
            return "queue_full"
        return None


@dataclass(frozen=True, slots=True)
class StalenessParams:
    """``max_age_s``: older reports drop the worker; ``require_report``: drop workers that
    never reported."""

    max_age_s: float = 30.0
    require_report: bool = False

    def __post_init__(self) -> None:
        if not self.max_age_s > 0:
            raise InvalidInputError("max_age_s", f"must be > 0, got {self.max_age_s}")


class StalenessFilter(Filter):
    """Drop (``stale_load_report``) when ``now - reported_at > max_age_s``; below that bound
    staleness only lowers the score (``staleness-scorer``)."""

    type_name: ClassVar[str] = "staleness-filter"
    Params = StalenessParams

    def drop_reason(self, ws: WorkerState, role: Role, ctx: RequestContext) -> str | None:
        if ws.reported_at_s is None:
            return "no_load_report" if self.params.require_report else None
        if ctx.now_s - ws.reported_at_s > self.params.max_age_s:
            return "stale_load_report"
        return None


@dataclass(frozen=True, slots=True)
class LabelParams:
    """``match``: comma-separated ``key=value`` pairs every kept worker must carry."""

    match: str = ""

    def __post_init__(self) -> None:
        for raw in self.match.split(","):
            part = raw.strip()
            if part and "=" not in part:
                raise InvalidInputError("match", f"expected key=value, got {part!r}")


class LabelSelectorFilter(Filter):
    """Keep workers whose labels contain every ``key=value`` of ``match``
    (``label_mismatch`` otherwise)."""

    type_name: ClassVar[str] = "label-selector-filter"
    Params = LabelParams

    def __init__(self, name: str, params: LabelParams | None = None) -> None:
        super().__init__(name, params)
        pairs = [p.strip().split("=", 1) for p in self.params.match.split(",") if p.strip()]
        self._pairs = [(k.strip(), v.strip()) for k, v in pairs]

    def drop_reason(self, ws: WorkerState, role: Role, ctx: RequestContext) -> str | None:
        labels = ws.view.labels
        for k, v in self._pairs:
            if labels.get(k) != v:
                return "label_mismatch"
        return None


@dataclass(frozen=True, slots=True)
class ProbeParams:
    """``max_in_flight``: the requests a worker not yet measured may hold at once."""

    max_in_flight: int = 1

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise InvalidInputError("max_in_flight", f"must be >= 1, got {self.max_in_flight}")


class ProbeFilter(Filter):
    """Drop (``probing``) a worker planned at its measured peers' speed (its view's
    ``learned`` figures are the fleet's prior: 0 samples of its own) while it already
    holds ``max_in_flight`` requests (queued or reserved).

    Why: a worker not yet measured is planned like the measured workers of its model
    (``learner.SpeedLearner.prior``), which is right far more often than not, but when it
    is wrong the planner learns it only from outcomes, and a burst can send it many
    requests before the first comes back: on real engines, a quarter-core engine planned at
    its fast peer's speed took 8 of a burst of 16 and served them in 0.6-0.8 s where 0.06 s
    was planned (tests/real_engine/test_unequal.py). Probed one request at a time it is
    measured within ``learning.MIN_SAMPLES`` requests, each on an idle engine (the sample
    the speed fit takes, not a queued one), and at most one request at a time pays for a
    wrong prior. A worker with a fit of its own, and a fleet with no fit at all (planned as
    declared), are not held. Prefill only: a decode worker batches sequences by design, and
    its admission is priced by its own terms."""

    type_name: ClassVar[str] = "probe-filter"
    roles: ClassVar[frozenset[Role]] = _PREFILL
    Params = ProbeParams

    def drop_reason(self, ws: WorkerState, role: Role, ctx: RequestContext) -> str | None:
        learned = ws.view.learned
        prior = learned is not None and learned.samples == 0
        if prior and ws.queue_depth() >= self.params.max_in_flight:
            return "probing"
        return None
