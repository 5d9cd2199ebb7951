"""The nouns the policy core decides over: workers, load reports, requests and tiers.

These are plain frozen values, built by the scheduler service from its informer's view of the
registry, or by the simulator from its own state. Nothing here performs I/O or reads a clock:
a load report's ``reported_at_ms`` and a decision's ``now_s`` are on whatever clock the caller
uses (wall clock in the service, simulated clock in the simulator); only differences between
them matter. The load report and the network location are the ones every layer shares
(``hpd_common.worker_model``).

Units are in the names: ``_bytes``, ``_ms``, ``_s``, ``_gbps`` (10^9 bit/s).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpd_common.kvformat import KvFormat
from hpd_common.worker_model import Health, LoadReport, NetworkLocation, WorkerSpec
from hpd_common.worker_model import Stage as DeclaredStage

from .errors import InvalidInputError

__all__ = [
    "SCHEDULABLE_HEALTH",
    "DecisionKind",
    "Health",
    "LearnedSpeed",
    "LoadReport",
    "Mode",
    "NetworkLocation",
    "Request",
    "ResourceNeed",
    "Role",
    "Stage",
    "Tier",
    "WorkerSpec",
    "WorkerView",
    "declared_stages",
]


class Stage(enum.StrEnum):
    """Which stages a worker serves."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def serves(self, role: Role) -> bool:
        """True when a worker of this stage can play ``role`` in a plan."""
        return self is _BOTH or str.__eq__(self, role)  # str compare: enum .value is slow


class Role(enum.StrEnum):
    """The role a worker plays in one plan."""

    PREFILL = "prefill"
    DECODE = "decode"


_BOTH = Stage.BOTH


SCHEDULABLE_HEALTH: frozenset[Health] = frozenset({Health.HEALTHY, Health.SUSPECT})


class ResourceNeed(enum.StrEnum):
    """The dominant resource pressure of a request (seed 000, classification)."""

    PREFILL = "prefill"
    DECODE = "decode"
    SHARED = "shared"


class Mode(enum.StrEnum):
    """How the decode worker obtains the prompt's KV cache.

    TRANSFER: the prefill worker computes it and ships it over the link.
    RECOMPUTE: the decode worker runs the prefill itself (KV incompatible, or the link is
    slower than recomputing).
    SAME_POOL: one worker that serves both stages does both; nothing crosses a link.
    """

    TRANSFER = "transfer"
    RECOMPUTE = "recompute"
    SAME_POOL = "same_pool"


class DecisionKind(enum.StrEnum):
    """Primary route, a reroute away from the normal path, or a rejection."""

    PRIMARY = "primary"
    REROUTE = "reroute"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class LearnedSpeed:
    """A worker's prefill speed as measured, not as declared (the scheduler's learner,
    ``hpd_scheduler.policy.learning``, fits it from reported outcomes; the simulator the same way).

    The prefill phase of a request (from the moment it is sent to the engine to its first
    token, queue included) takes ``fixed_ms x (1 + queue_share x ahead) + scale x
    nominal_ms``:
    ``nominal_ms`` is the declared cost model's time for the work queued ahead plus the
    request's own, ``ahead`` the requests queued ahead (the queued prompt tokens at the
    traffic's mean prompt), ``fixed_ms`` what the engine spends per request whatever its
    length (HTTP, tokenizing, scheduling, the sampler; on a small model nearly all of it),
    ``scale`` how many times slower than declared it computes, ``queue_share`` the share of
    a request's fixed cost each request queued ahead adds (1: the engine prefills one
    request at a time; less: it batches the prefills of several into one step).
    ``samples``: how many outcomes the fit rests on. The planner uses the figures in place
    of the declared ones with no clamp (the learner bounds them, with its reasons)."""

    fixed_ms: float
    scale: float
    samples: int
    queue_share: float = 1.0

    def __post_init__(self) -> None:
        if not (self.fixed_ms >= 0 and self.scale > 0 and 0.0 <= self.queue_share <= 1.0):
            raise InvalidInputError(
                "learned",
                "fixed_ms must be >= 0, scale > 0 and queue_share within [0, 1], got "
                f"{self.fixed_ms}, {self.scale}, {self.queue_share}",
            )


@dataclass(frozen=True, slots=True)
class LearnedStep:
    """A worker's decode step as measured, not as declared (the learner fits it from the
    TPOT the gateway measures, ``hpd_scheduler.policy.learning``): a step with ``n``
    sequences in the batch takes ``scale x nominal_ms + seq_ms x n``, ``nominal_ms`` the
    declared cost model's step for the batch's context (the weights and KV read), ``scale``
    how many times slower than declared it reads them, ``seq_ms`` what each sequence adds
    whatever its context (sampling, the engine's bookkeeping; on an engine that computes
    rather than reads, most of it). ``samples``: how many outcomes it rests on. The
    planner uses it in place of the report's clamped correction."""

    scale: float
    seq_ms: float
    samples: int

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.seq_ms >= 0):
            raise InvalidInputError(
                "learned_step", f"scale must be > 0, seq_ms >= 0, got {self.scale}, {self.seq_ms}"
            )


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the planner sees it: the worker's own spec (the one worker model,
    ``hpd_common.worker_model``, as the registry holds it) and what the scheduler knows
    beside it: health, the last load report, free KV memory, its own reservations.

    ``kv_available_bytes``: free KV memory on the worker (all its GPUs together), of the
    spec's ``kv_memory_total_bytes``. ``pending_*``: reservations the scheduler holds against
    this worker that the load report cannot show yet (requests planned but not started,
    and the prompt tokens of prefills planned here); they count as load
    (``WorkerState.backlog_tokens``; ``Fleet.build`` says which reported prefills they
    stand for). ``learned``: the prefill speed measured from outcomes, ``learned_step`` the
    decode step (each None until there are enough; the declared GPU figures and the report
    then apply).
    ``hard_max_batch_size`` is the ceiling adaptive batching may raise
    the cap to (0: the spec's ``max_batch_size`` is also the hard ceiling).

    The spec's figures the planner reads are set from the spec at construction (never
    passed in), under the spec's names: ``stage`` is its stages as one value (prefill,
    decode or both), ``labels`` a mapping, ``gpu_count`` / ``tp_size`` / ``max_batch_size``
    at least 1, ``peak_tflops`` / ``hbm_gbps`` None when the spec gives none (the GPU profile
    table's figures apply then).
    """

    spec: WorkerSpec
    kv_available_bytes: int
    health: Health = Health.HEALTHY
    load: LoadReport | None = None
    hard_max_batch_size: int = 0
    pending_requests: int = 0
    pending_kv_bytes: int = 0
    pending_prefill_tokens: int = 0
    learned: LearnedSpeed | None = None
    learned_step: LearnedStep | None = None
    # the spec's figures as the planner reads them, set from ``spec`` alone (class docstring)
    stage: Stage = field(init=False)
    labels: Mapping[str, str] = field(init=False)
    worker_id: str = field(init=False)
    pool_id: str = field(init=False)
    model_id: str = field(init=False)
    model_revision: str = field(init=False)
    kv_format: KvFormat = field(init=False)
    endpoint: str = field(init=False)
    gpu_type: str = field(init=False)
    gpu_count: int = field(init=False)
    tp_size: int = field(init=False)
    kv_memory_total_bytes: int = field(init=False)
    max_batch_size: int = field(init=False)
    network: NetworkLocation = field(init=False)
    peak_tflops: float | None = field(init=False)
    hbm_gbps: float | None = field(init=False)

    def __post_init__(self) -> None:
        # copies, not a second model: a view is built from a spec and nothing else, and the
        # planner reads these per candidate on every decision (through the spec each read
        # cost a quarter more per decision, bench/policy_decision.py)
        spec = self.spec
        stages = spec.stages
        pre, dec = DeclaredStage.PREFILL in stages, DeclaredStage.DECODE in stages
        put = object.__setattr__
        put(self, "stage", Stage.BOTH if pre and dec else Stage.PREFILL if pre else Stage.DECODE)
        put(self, "labels", dict(spec.labels))
        put(self, "worker_id", spec.worker_id)
        put(self, "pool_id", spec.pool_id)
        put(self, "model_id", spec.model_id)
        put(self, "model_revision", spec.model_revision)
        put(self, "kv_format", spec.kv_format)
        put(self, "endpoint", spec.endpoint)
        put(self, "gpu_type", spec.gpu_type)
        put(self, "gpu_count", max(1, spec.gpu_count))
        put(self, "tp_size", max(1, spec.tp_size))
        put(self, "kv_memory_total_bytes", spec.kv_memory_total_bytes)
        put(self, "max_batch_size", max(1, spec.max_batch_size))
        put(self, "network", spec.network)
        put(self, "peak_tflops", spec.peak_tflops or None)
        put(self, "hbm_gbps", spec.hbm_gbps or None)


def declared_stages(stage: Stage) -> tuple[DeclaredStage, ...]:
    """The stages a worker's spec lists for what it serves (the inverse of
    :attr:`WorkerView.stage`): for a worker made up by the simulator or a test."""
    if stage is Stage.BOTH:
        return (DeclaredStage.PREFILL, DeclaredStage.DECODE)
    return (DeclaredStage.PREFILL,) if stage is Stage.PREFILL else (DeclaredStage.DECODE,)


MAX_PREFIX_BLOCKS = 8192  # 1M tokens at 128 per block
MAX_PREFIX_BLOCK_TOKENS = 4096
MAX_AVOID_WORKERS = 16  # a re-plan names the few workers its failed chain ran on


@dataclass(frozen=True, slots=True)
class Request:
    """One request to place.

    ``prefix_hints``: worker ids or pool ids known to hold a cached prefix of this prompt.
    ``prefix_blocks``: the prompt's block-chain keys (``policy.prefix``), each standing for
    ``prefix_block_tokens`` tokens; a worker's cached tokens for the request are its longest
    held prefix of them, and its prefill estimate counts only the rest.
    ``preferred_pool``: a pool the caller wants (sticky routing); when it cannot execute the
    request the decision is a REROUTE and the record says why.
    ``avoid_workers``: workers the caller just saw fail for this request; no step of the plan
    runs on them (they are dropped as ``failed_for_this_request``).
    """

    request_id: str
    model_id: str
    prompt_tokens: int
    expected_output_tokens: int
    tier: str = "standard"
    prefix_hints: tuple[str, ...] = ()
    model_revision: str = ""
    preferred_pool: str = ""
    prefix_blocks: tuple[int, ...] = ()
    prefix_block_tokens: int = 0
    avoid_workers: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise :class:`InvalidInputError` naming the first bad field."""
        if not self.request_id:
            raise InvalidInputError("request_id", "must not be empty")
        if not self.model_id:
            raise InvalidInputError("model_id", "must not be empty")
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int):
            raise InvalidInputError("prompt_tokens", "must be an integer")
        if self.prompt_tokens < 1:
            raise InvalidInputError("prompt_tokens", f"must be >= 1, got {self.prompt_tokens}")
        if isinstance(self.expected_output_tokens, bool) or not isinstance(
            self.expected_output_tokens, int
        ):
            raise InvalidInputError("expected_output_tokens", "must be an integer")
        if self.expected_output_tokens < 0:
            raise InvalidInputError(
                "expected_output_tokens", f"must be >= 0, got {self.expected_output_tokens}"
            )
        if self.prefix_blocks:
            if not 1 <= self.prefix_block_tokens <= MAX_PREFIX_BLOCK_TOKENS:
                raise InvalidInputError(
                    "prefix_block_tokens",
                    f"must be 1..{MAX_PREFIX_BLOCK_TOKENS} with prefix_blocks",
                )
            if len(self.prefix_blocks) > MAX_PREFIX_BLOCKS:
                raise InvalidInputError("prefix_blocks", f"at most {MAX_PREFIX_BLOCKS} blocks")
        if len(self.avoid_workers) > MAX_AVOID_WORKERS:
            raise InvalidInputError("avoid_workers", f"at most {MAX_AVOID_WORKERS} worker ids")


@dataclass(frozen=True, slots=True)
class Tier:
    """A named SLO class.

    ``ttft_ms`` / ``tpot_ms``: targets the scorers aim at (TPOT is the per-token interval, the
    ITL target of seed 001 made per tier). ``queue_budget_ms``: the longest queue wait the tier
    accepts before the serving action turns to routing or throttling. ``priority``: higher is
    more important; the lowest-priority tier that ``may_shed`` is shed first.
    ``hard_ttft_ms``: a route whose estimated TTFT exceeds it is not an executable alternative
    (None: no hard limit).
    """

    name: str
    ttft_ms: float
    tpot_ms: float
    queue_budget_ms: float
    priority: int = 1
    may_throttle: bool = False
    may_shed: bool = False
    hard_ttft_ms: float | None = None

    def validate(self, key_path: str = "tier") -> None:
        """Raise :class:`InvalidInputError` when a target is not positive."""
        for name in ("ttft_ms", "tpot_ms", "queue_budget_ms"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidInputError(f"{key_path}.{name}", f"must be > 0, got {value}")
        if self.hard_ttft_ms is not None and self.hard_ttft_ms < self.ttft_ms:
            raise InvalidInputError(f"{key_path}.hard_ttft_ms", "must be >= ttft_ms")
