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
class WorkerView:
    """One worker as the planner sees it: the worker's own spec (the one worker model,
    ``hpd_common.worker_model``, as the registry holds it) and what the scheduler knows
    beside it: health, the last load report, free KV memory, its own reservations.

    ``kv_available_bytes``: free KV memory on the worker (all its GPUs together), of the
    spec's ``kv_memory_total_bytes``. ``pending_*``: reservations the scheduler holds against
    this worker that the load report cannot show yet (requests planned but not started);
    they count as load. ``hard_max_batch_size`` is the ceiling adaptive batching may raise
    the cap to (0: the spec's ``max_batch_size`` is also the hard ceiling).

    Fixed at construction from the spec, for the planner's hot path: ``stage`` (the spec's
    stages as one value: prefill, decode or both) and ``labels`` (as a mapping). The other
    figures are the spec's, read through it; ``peak_tflops`` / ``hbm_gbps`` are None when the
    spec gives none (the GPU profile table's figures apply then).
    """

    spec: WorkerSpec
    kv_available_bytes: int
    health: Health = Health.HEALTHY
    load: LoadReport | None = None
    hard_max_batch_size: int = 0
    pending_requests: int = 0
    pending_kv_bytes: int = 0
    pending_prefill_tokens: int = 0
    stage: Stage = field(init=False)
    labels: Mapping[str, str] = field(init=False)

    def __post_init__(self) -> None:
        stages = self.spec.stages
        pre, dec = DeclaredStage.PREFILL in stages, DeclaredStage.DECODE in stages
        stage = Stage.BOTH if pre and dec else Stage.PREFILL if pre else Stage.DECODE
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "labels", dict(self.spec.labels))

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def pool_id(self) -> str:
        return self.spec.pool_id

    @property
    def model_id(self) -> str:
        return self.spec.model_id

    @property
    def model_revision(self) -> str:
        return self.spec.model_revision

    @property
    def kv_format(self) -> KvFormat:
        return self.spec.kv_format

    @property
    def endpoint(self) -> str:
        return self.spec.endpoint

    @property
    def gpu_type(self) -> str:
        return self.spec.gpu_type

    @property
    def gpu_count(self) -> int:
        return max(1, self.spec.gpu_count)

    @property
    def tp_size(self) -> int:
        return max(1, self.spec.tp_size)

    @property
    def kv_memory_total_bytes(self) -> int:
        return self.spec.kv_memory_total_bytes

    @property
    def max_batch_size(self) -> int:
        return max(1, self.spec.max_batch_size)

    @property
    def network(self) -> NetworkLocation:
        return self.spec.network

    @property
    def peak_tflops(self) -> float | None:
        return self.spec.peak_tflops or None

    @property
    def hbm_gbps(self) -> float | None:
        return self.spec.hbm_gbps or None


def declared_stages(stage: Stage) -> tuple[DeclaredStage, ...]:
    """The stages a worker's spec lists for what it serves (the inverse of
    :attr:`WorkerView.stage`): for a worker made up by the simulator or a test."""
    if stage is Stage.BOTH:
        return (DeclaredStage.PREFILL, DeclaredStage.DECODE)
    return (DeclaredStage.PREFILL,) if stage is Stage.PREFILL else (DeclaredStage.DECODE,)


MAX_PREFIX_BLOCKS = 8192  # 1M tokens at 128 per block
MAX_PREFIX_BLOCK_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class Request:
    """One request to place.

    ``prefix_hints``: worker ids or pool ids known to hold a cached prefix of this prompt.
    ``prefix_blocks``: the prompt's block-chain keys (``policy.prefix``), each standing for
    ``prefix_block_tokens`` tokens; a worker's cached tokens for the request are its longest
    held prefix of them, and its prefill estimate counts only the rest.
    ``preferred_pool``: a pool the caller wants (sticky routing); when it cannot execute the
    request the decision is a REROUTE and the record says why.
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
