"""Latency metrics and SLO attainment, with the definitions the papers use.

* **TTFT**: arrival to first token (ms).
* **TPOT**: ``(last token - first token) / (output tokens - 1)`` (ms), DistServe's
  time per output token; 0 for a one-token output.
* **TBT** (Mooncake): per request, the mean of the longest 10 % of its token gaps
  (``max(1, floor(gaps / 10))`` gaps), a tail measure of stalls that TPOT averages away.
* **SLO attainment**: the share of *all* requests (rejected ones count as misses) whose TTFT
  and TPOT both meet their targets (DistServe); reported per tier and overall, alongside the
  TTFT-only and TPOT-only shares.
* **Percentiles**: nearest-rank on the completed requests (``ceil(p/100 x n)``-th smallest).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .engine import RequestOutcome, SimResult, tbt_ms

__all__ = ["Slo", "Summary", "TierSlos", "attainment", "percentile", "summarize", "tbt_ms"]


@dataclass(frozen=True, slots=True)
class Slo:
    """TTFT and TPOT targets in ms (optionally TBT; None: not checked)."""

    ttft_ms: float
    tpot_ms: float
    tbt_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.ttft_ms > 0 or not self.tpot_ms > 0:
            raise ValueError("SLO targets must be > 0")
        if self.tbt_ms is not None and not self.tbt_ms > 0:
            raise ValueError("tbt_ms must be > 0")

    def met(self, o: RequestOutcome) -> bool:
        """True when the request completed within every target (one a run that stopped early
        left unfinished, its times NaN, did not)."""
        if o.rejected:
            return False
        if not (o.ttft_ms <= self.ttft_ms and o.tpot_ms <= self.tpot_ms):
            return False
        return self.tbt_ms is None or o.tbt_ms <= self.tbt_ms

    def ttft_missed(self, o: RequestOutcome) -> bool:
        """The first token came later than the TTFT target (the request misses, whatever its
        TPOT will be)."""
        return o.ttft_ms > self.ttft_ms

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``ttft=1000,tpot=50[,tbt=200]`` (ms)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            if not sep or key.strip() not in ("ttft", "tpot", "tbt"):
                raise ValueError(f"bad SLO term {part!r}; expected ttft=MS,tpot=MS[,tbt=MS]")
            values[key.strip()] = float(val)
        if "ttft" not in values or "tpot" not in values:
            raise ValueError("an SLO needs both ttft and tpot")
        return cls(values["ttft"], values["tpot"], values.get("tbt"))


@dataclass(frozen=True, slots=True)
class TierSlos:
    """Each request judged by its tier's SLO, ``default`` for a tier not in ``by_tier``
    (what :func:`summarize` does), as an ``outcomes.Judge``."""

    default: Slo
    by_tier: Mapping[str, Slo]

    def of(self, tier: str) -> Slo:
        """The SLO a request of ``tier`` is judged by."""
        return self.by_tier.get(tier, self.default)

    def met(self, o: RequestOutcome) -> bool:
        return self.of(o.tier).met(o)

    def ttft_missed(self, o: RequestOutcome) -> bool:
        return self.of(o.tier).ttft_missed(o)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (NaN for no values)."""
    if not values:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def attainment(outcomes: Iterable[RequestOutcome], slo: Slo) -> float:
    """Share of requests meeting both TTFT and TPOT (and TBT if set); 0 for none."""
    n = met = 0
    for o in outcomes:
        n += 1
        met += slo.met(o)
    return met / n if n else 0.0


@dataclass(frozen=True, slots=True)
class Summary:
    """Figures of one run under one SLO set (``slos`` per tier, ``default`` otherwise)."""

    policy: str
    rate_scale: float
    rate_rps: float
    requests: int
    rejected: int
    attainment: float
    attainment_ttft: float
    attainment_tpot: float
    per_tier: Mapping[str, float]
    ttft_ms: Mapping[str, float]
    tpot_ms: Mapping[str, float]
    tbt_ms: Mapping[str, float]
    modes: Mapping[str, int]
    kinds: Mapping[str, int]
    reject_reasons: Mapping[str, int]
    wall_s: float
    stopped_early: bool = False
    """The run stopped once ``attainment`` could no longer reach the share it had to decide
    (``run_point(stop_below=..)``): the attainment then counts every unfinished request as a
    miss (a lower bound; the run's answer, below the share, is exact), percentiles are over
    the finished requests."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "policy": self.policy,
            "rate_scale": self.rate_scale,
            "rate_rps": self.rate_rps,
            "requests": self.requests,
            "rejected": self.rejected,
            "slo_attainment": self.attainment,
            "slo_attainment_ttft": self.attainment_ttft,
            "slo_attainment_tpot": self.attainment_tpot,
            "slo_attainment_per_tier": dict(self.per_tier),
            "ttft_ms": dict(self.ttft_ms),
            "tpot_ms": dict(self.tpot_ms),
            "tbt_ms": dict(self.tbt_ms),
            "modes": dict(self.modes),
            "decision_kinds": dict(self.kinds),
            "reject_reasons": dict(self.reject_reasons),
            "sim_wall_s": self.wall_s,
            "stopped_early": self.stopped_early,
        }


def _pcts(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def summarize(
    result: SimResult,
    slo: Slo,
    tier_slos: Mapping[str, Slo] | None = None,
    base_rate_rps: float = 0.0,
) -> Summary:
    """Summarise a run. Each request is judged by its tier's SLO when ``tier_slos`` has it,
    by ``slo`` otherwise. ``base_rate_rps``: the unscaled trace's mean rate (the rate
    reported is ``base x rate_scale``)."""
    judge = TierSlos(slo, tier_slos or {})
    outs = result.outcomes
    done = [o for o in outs if not o.rejected and not math.isnan(o.finish_s)]
    n = len(outs)
    met = met_ttft = met_tpot = 0
    tier_n: dict[str, int] = {}
    tier_met: dict[str, int] = {}
    for o in outs:
        s = judge.of(o.tier)
        ok = s.met(o)
        met += ok
        if not o.rejected:
            met_ttft += o.ttft_ms <= s.ttft_ms
            met_tpot += o.tpot_ms <= s.tpot_ms
        tier_n[o.tier] = tier_n.get(o.tier, 0) + 1
        tier_met[o.tier] = tier_met.get(o.tier, 0) + ok
    return Summary(
        policy=result.policy,
        rate_scale=result.rate_scale,
        rate_rps=base_rate_rps * result.rate_scale,
        requests=n,
        rejected=sum(1 for o in outs if o.rejected),
        attainment=met / n if n else 0.0,
        attainment_ttft=met_ttft / n if n else 0.0,
        attainment_tpot=met_tpot / n if n else 0.0,
        per_tier={t: tier_met[t] / c for t, c in sorted(tier_n.items())},
        ttft_ms=_pcts([o.ttft_ms for o in done]),
        tpot_ms=_pcts([o.tpot_ms for o in done if o.output_tokens > 1]),
        tbt_ms=_pcts([o.tbt_ms for o in done if o.output_tokens > 1]),
        modes=result.modes,
        kinds=result.kinds,
        reject_reasons=result.reject_reasons,
        wall_s=result.wall_s,
        stopped_early=result.stopped_early,
    )
