"""Seed 000's mechanisms, each one rule in one function, which the planner applies per
worker and per (prefill, decode) pair and seed 000's pool-level test cases call as well:

* request classification (:func:`classify_need`; ``planner.py``);
* the hand-off choice (:func:`handoff_mode`: transfer when
  ``transfer_ms <= recompute_ms``, a tie transfers; ``pairing.py``, both strategies), with
  the transfer time from the link (``links.Link``: ``bytes x 8 / (Gb/s x 10^6) + latency``);
* the execution gate, one check per cause: health (:func:`health_reason`, applied once per
  snapshot by the fleet index, ``fleet.py``), stage (:func:`stage_reason`) and pinned model
  revision (:func:`revision_reason`; the ``execution-gate-filter``), KV memory
  (:func:`memory_reason`; the ``decode-memory-filter``); :func:`execution_reasons` lists
  every one that fails, in that order;
* the KV gate over the negotiation of the two KV formats (``hpd_common.kvformat.negotiate``)
  and the connectors' direction: :func:`kv_transferable` decides whether the KV can cross
  at all and :func:`kv_reasons` says why it cannot be taken as it is
  (``Fleet.handoff_terms``);
* :class:`Capability`, the two gates' answer for one worker (or a pool of alike workers):
  execution reasons first, then KV reasons.

The pool-level fallback walk of the seed (primary pool, then fallbacks in order) is composed
from these gates by its test adapter; the planner walks workers, ranked, not pools
(``planner.py``: a preferred pool that cannot execute makes the decision a REROUTE, and a
model with no executable worker a REJECT with ``no_executable_pool``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpd_common.kvformat import Negotiation

from .domain import SCHEDULABLE_HEALTH, Health, Mode, ResourceNeed, Role, Stage
from .errors import InvalidInputError
from .factors import MEMORY_HEADROOM, memory_gate_ok

__all__ = [
    "KV_CONNECTOR_DIRECTION",
    "Capability",
    "classify_need",
    "execution_reasons",
    "handoff_mode",
    "health_reason",
    "kv_reasons",
    "kv_transferable",
    "memory_reason",
    "revision_reason",
    "stage_reason",
]

KV_CONNECTOR_DIRECTION = "kv_connector_direction"
"""KV reason: the engines' KV connectors do not move KV from the one to the other
(``fleet.kv_can_flow``)."""


def classify_need(
    prompt_tokens: int,
    output_tokens: int,
    long_prompt_threshold: int = 2048,
    long_decode_threshold: int = 256,
) -> ResourceNeed:
    """Dominant pressure of a request.

    PREFILL when ``prompt > long_prompt_threshold`` and ``output <= long_decode_threshold``;
    DECODE when ``output > long_decode_threshold`` and ``prompt <= long_prompt_threshold``;
    SHARED otherwise (both long or both short). Thresholds are exclusive: a prompt of exactly
    the threshold is not long. The three classes are mutually exclusive by construction.
    """
    if prompt_tokens < 0:
        raise InvalidInputError("prompt_tokens", f"must be >= 0, got {prompt_tokens}")
    if output_tokens < 0:
        raise InvalidInputError("decode_tokens", f"must be >= 0, got {output_tokens}")
    if long_prompt_threshold < 0 or long_decode_threshold < 0:
        raise InvalidInputError("threshold", "thresholds must be >= 0")
    long_prompt = prompt_tokens > long_prompt_threshold
    long_decode = output_tokens > long_decode_threshold
    if long_prompt and not long_decode:
        return ResourceNeed.PREFILL
    if long_decode and not long_prompt:
        return ResourceNeed.DECODE
    return ResourceNeed.SHARED


# -- hand-off -------------------------------------------------------------------------------


def handoff_mode(transfer_ms: float, recompute_ms: float) -> Mode:
    """TRANSFER when ``transfer_ms <= recompute_ms``, RECOMPUTE otherwise.

    ``transfer_ms``: the whole hand-off, link time plus any conversion of the KV
    (``bytes x (8 / (Gb/s x 10^6) + conversion ms per byte) + latency``); ``recompute_ms``:
    the decode worker's own prefill of the prompt. A tie transfers: it leaves the decode
    worker's compute to its running batch. Both in ms; no check here (the planner's figures
    are non-negative by construction, callers with outside input check theirs).
    """
    if transfer_ms <= recompute_ms:
        return Mode.TRANSFER
    return Mode.RECOMPUTE


# -- execution gate -------------------------------------------------------------------------


def health_reason(health: Health) -> str | None:
    """None for a worker that receives new work (HEALTHY or SUSPECT, ``SCHEDULABLE_HEALTH``);
    otherwise its health in lower case: ``unhealthy``, ``expired``, ``draining``,
    ``cordoned``."""
    if health in SCHEDULABLE_HEALTH:
        return None
    return str(health.value).lower()


def stage_reason(stage: Stage, role: Role) -> str | None:
    """``unsupported_stage`` when a worker serving ``stage`` cannot play ``role``."""
    if stage.serves(role):
        return None
    return "unsupported_stage"


def revision_reason(pinned: str, served: str) -> str | None:
    """``model_revision_mismatch`` when the request pins a revision (``pinned`` not empty)
    and the worker serves another; a request that pins none runs on any revision."""
    if pinned and served != pinned:
        return "model_revision_mismatch"
    return None


def memory_reason(
    available_bytes: float, need_bytes: float, headroom: float = MEMORY_HEADROOM
) -> str | None:
    """``insufficient_memory`` when ``available < need x headroom`` (equal passes;
    ``factors.memory_gate_ok``). Both sides in the same unit."""
    if memory_gate_ok(available_bytes, need_bytes, headroom):
        return None
    return "insufficient_memory"


def execution_reasons(
    health: Health,
    stage: Stage,
    role: Role,
    pinned_revision: str,
    served_revision: str,
    available_bytes: float,
    need_bytes: float,
    headroom: float = MEMORY_HEADROOM,
) -> tuple[str, ...]:
    """Every execution-gate check that fails, in order: health, stage, model revision,
    memory (``need_bytes``: the KV the worker must hold for the request, 0 for a role that
    holds none). Empty: the worker can run the request."""
    found = (
        health_reason(health),
        stage_reason(stage, role),
        revision_reason(pinned_revision, served_revision),
        memory_reason(available_bytes, need_bytes, headroom),
    )
    return tuple(r for r in found if r is not None)


# -- KV gate --------------------------------------------------------------------------------


def kv_transferable(neg: Negotiation, flows: bool = True) -> bool:
    """Whether a prefill worker's KV can reach a decode worker at all: the formats negotiate
    (COMPATIBLE, or CONVERTIBLE with its conversion priced in the hand-off) and the engines'
    connectors move KV that way (``flows``). Otherwise the decode worker recomputes: it
    stays usable, KV-incompatible is not unable to execute."""
    return flows and neg.transferable


def kv_reasons(neg: Negotiation, flows: bool = True) -> tuple[str, ...]:
    """Why the KV cannot be taken as it is: the negotiation's reasons (one per conversion
    step when CONVERTIBLE, e.g. ``kv_dtype_mismatch``, ``kv_layout_mismatch``; the rules no
    conversion meets when INCOMPATIBLE), then ``kv_connector_direction`` when the
    connectors do not move it. Empty: taken as it is (COMPATIBLE, connectors willing)."""
    reasons = tuple(str(r) for r in neg.reasons)
    if flows:
        return reasons
    return (*reasons, KV_CONNECTOR_DIRECTION)


@dataclass(frozen=True, slots=True)
class Capability:
    """The two gates' answer for one worker (or a pool of alike workers).

    ``can_execute``: no execution reason. ``can_accept_kv``: it can execute and takes the
    KV as it is (no KV reason); it implies ``can_execute``. A worker that can execute but
    not take the KV as is stays usable: the KV crosses after a conversion where one exists
    (:func:`kv_transferable`, its cost in the hand-off), else the worker recomputes.
    ``reasons``: execution reasons first, then KV reasons.
    """

    execution_reasons: tuple[str, ...]
    kv_reasons: tuple[str, ...]

    @property
    def can_execute(self) -> bool:
        """No execution reason."""
        return not self.execution_reasons

    @property
    def can_accept_kv(self) -> bool:
        """Executable and the KV taken as it is."""
        return not self.execution_reasons and not self.kv_reasons

    @property
    def reasons(self) -> tuple[str, ...]:
        """Every failing check, execution ones first."""
        return self.execution_reasons + self.kv_reasons
