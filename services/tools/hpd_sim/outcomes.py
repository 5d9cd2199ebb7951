"""What a simulation run takes and gives (``hpd_sim.engine``): its knobs (:class:`SimConfig`),
each request's outcome (:class:`RequestOutcome`: its times, mode and placement) and the
run's result (:class:`SimResult`), and the per-token gap figure (:func:`tbt_ms`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["Judge", "RequestOutcome", "SimConfig", "SimResult", "tbt_ms"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Knobs of one run. ``tiers``: tier names with weights, assigned per request from the
    seeded RNG (a single tier by default); ``report_interval_s``: see the module docstring;
    ``util_tau_s``: time constant of the GPU-utilisation average."""

    seed: int = 0
    tiers: tuple[tuple[str, float], ...] = (("standard", 1.0),)
    report_interval_s: float = 0.0
    util_tau_s: float = 1.0
    keep_gaps: bool = False
    prefix_cache: bool = True
    prefix_block_tokens: int = 512  # the Mooncake trace's block (its hash_ids)
    # the scheduler's learner fed from outcomes (hpd_sim.learning); None: only when some
    # pool runs otherwise than it declares (engines that run as declared teach a scale of
    # about 1, at a fit's cost per request)
    learn: bool | None = None


@dataclass(slots=True)
class RequestOutcome:
    """What happened to one request. Times in seconds on the simulated clock; ``first_s`` and
    ``finish_s`` are NaN for a rejected request. ``tbt_ms``: mean of the longest 10 % of its
    token gaps (0 for a single-token output)."""

    index: int
    tier: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    rejected: bool = False
    reject_reason: str = ""
    kind: str = ""
    mode: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    first_s: float = math.nan
    finish_s: float = math.nan
    tbt_ms: float = 0.0
    gaps_ms: tuple[float, ...] = ()

    @property
    def ttft_ms(self) -> float:
        """Time to first token in ms (NaN if rejected)."""
        return (self.first_s - self.arrival_s) * 1e3

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first, in ms (0 for one output token)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_s) * 1e3 / (self.output_tokens - 1)

    @property
    def latency_s(self) -> float:
        """End-to-end latency (arrival to last token), seconds."""
        return self.finish_s - self.arrival_s


@dataclass(slots=True)
class SimResult:
    """The outcomes of one run plus run-level figures."""

    policy: str
    cluster: str
    rate_scale: float
    outcomes: list[RequestOutcome]
    sim_end_s: float
    wall_s: float
    decisions: int
    events: int
    fleet_builds: int
    modes: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    reject_reasons: dict[str, int] = field(default_factory=dict)
    busy_fraction: dict[str, float] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens prefills did not compute (prefix hits)
    prompt_tokens: int = 0  # prompt tokens of every prefill run
    prefix_blocks_max: int = 0  # the largest per-worker prefix index (blocks) at the end
    stopped_early: bool = False
    """The run stopped once its attainment could no longer reach the share it was asked to
    decide (``Simulator(stop_below=..)``); requests not finished by then have NaN times."""


class Judge(Protocol):
    """Whether a request met its targets (``metrics.Slo`` is one): what a run that may stop
    early (``Simulator(stop_below=..)``) counts its certain misses by."""

    def met(self, o: RequestOutcome) -> bool:
        """The finished (or rejected) request kept every target."""
        ...

    def ttft_missed(self, o: RequestOutcome) -> bool:
        """The request's first token (``first_s`` set) came too late, whatever follows."""
        ...


def tbt_ms(gaps: Sequence[float]) -> float:
    """Mooncake's TBT: the mean of the longest 10 % of a request's token gaps (at least one
    gap; ms)."""
    if not gaps:
        return 0.0
    k = max(1, len(gaps) // 10)
    # a sort in C beats heapq.nlargest's Python-level loop at every length a request has;
    # the same values in the same (descending) order, so the same sum
    top = sorted(gaps, reverse=True)[:k]
    return sum(top) / k
