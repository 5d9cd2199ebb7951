"""Run policies over a trace on a cluster: single points, rate sweeps and goodput searches,
shared by ``hpd sim`` and ``bench/goodput.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpd_scheduler.policy import Profile, builtin_profile, builtin_profile_names, load_profile
from hpd_sim.traces import Trace, reshape

from .cluster import ClusterSpec
from .engine import SimConfig, simulate
from .goodput import search_goodput
from .metrics import Slo, Summary, TierSlos, summarize

__all__ = ["POLICY_ALIASES", "PolicyRun", "resolve_policy", "run_point", "run_policy"]

POLICY_ALIASES: dict[str, str] = {"ours": "default", "least-loaded": "least_loaded"}
"""Extra names accepted for the built-in profiles (``ours`` is the default profile)."""

Progress = Callable[[str, int, int], None]


def resolve_policy(name: str) -> Profile:
    """A built-in profile by name (or alias), or a profile YAML file by path."""
    key = POLICY_ALIASES.get(name, name).replace("-", "_")
    if key in builtin_profile_names():
        return builtin_profile(key)
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return load_profile(path)
    known = sorted({*builtin_profile_names(), *POLICY_ALIASES})
    raise ValueError(f"unknown policy {name!r}; built-in: {', '.join(known)} or a YAML path")


def run_point(
    cluster: ClusterSpec,
    profile: Profile,
    trace: Trace,
    scale: float,
    slo: Slo,
    config: SimConfig,
    tier_slos: dict[str, Slo] | None = None,
    progress: Callable[[int, int], None] | None = None,
    stop_below: float = 0.0,
) -> Summary:
    """Simulate ``trace`` at ``scale`` x its rate and summarise against ``slo``.

    ``stop_below`` > 0: the caller only needs to know whether the attainment reaches that
    share; the run stops as soon as it cannot (``Summary.stopped_early``, whose attainment is
    then a lower bound below ``stop_below``). Whether it reaches the share is the same answer
    a whole run gives."""
    reqs = reshape(trace, rate_scale=scale)
    judge = TierSlos(slo, tier_slos) if tier_slos else slo
    result = simulate(cluster, profile, reqs.requests, config, scale, progress, judge, stop_below)
    return summarize(result, slo, tier_slos, base_rate_rps=trace.mean_rate)


@dataclass(slots=True)
class PolicyRun:
    """Every point evaluated for one policy and, when searched, its goodput."""

    policy: str
    points: list[Summary] = field(default_factory=list)
    goodput_scale: float | None = None
    goodput_rps: float | None = None

    def to_dict(self, gpus: int, price_per_hour: float) -> dict[str, Any]:
        """JSON-ready dict; goodput per GPU (req/s) and per dollar (requests per USD)."""
        out: dict[str, Any] = {
            "policy": self.policy,
            "points": [p.to_dict() for p in sorted(self.points, key=lambda p: p.rate_scale)],
        }
        if self.goodput_rps is not None:
            out["goodput_scale"] = self.goodput_scale
            out["goodput_rps"] = self.goodput_rps
            out["goodput_rps_per_gpu"] = self.goodput_rps / gpus if gpus else 0.0
            out["goodput_requests_per_usd"] = (
                self.goodput_rps * 3600.0 / price_per_hour if price_per_hour > 0 else 0.0
            )
        return out


def run_policy(
    cluster: ClusterSpec,
    policy: str | Profile,
    trace: Trace,
    slo: Slo,
    config: SimConfig,
    scales: list[float] | None = None,
    search: bool = False,
    target: float = 0.9,
    start: float = 1.0,
    rel_tol: float = 0.02,
    tier_slos: dict[str, Slo] | None = None,
    progress: Progress | None = None,
    early_stop: bool = False,
) -> PolicyRun:
    """Evaluate ``policy`` (a name for :func:`resolve_policy`, or a profile) at each of
    ``scales`` and, with ``search``, find its goodput.

    ``early_stop``: the search's own points stop once they cannot reach ``target``
    (:func:`run_point`'s ``stop_below``): the same goodput, in less time, but a failed
    point's attainment is then only a lower bound (``Summary.stopped_early``); the points of
    ``scales`` always run whole."""
    profile = policy if isinstance(policy, Profile) else resolve_policy(policy)
    name = policy if isinstance(policy, str) else profile.name
    run = PolicyRun(name)
    seen: dict[float, Summary] = {}

    def at(scale: float, stop_below: float = 0.0) -> float:
        if scale not in seen:
            label = f"{name} x{scale:.3g}"
            cb = (lambda d, n: progress(label, d, n)) if progress else None
            seen[scale] = run_point(
                cluster, profile, trace, scale, slo, config, tier_slos, cb, stop_below
            )
            run.points.append(seen[scale])
        return seen[scale].attainment

    for s in scales or []:
        at(s)
    if search:
        stop = target if early_stop else 0.0
        found = search_goodput(lambda s: at(s, stop), target=target, start=start, rel_tol=rel_tol)
        run.goodput_scale = found.scale
        run.goodput_rps = found.scale * trace.mean_rate
    return run
