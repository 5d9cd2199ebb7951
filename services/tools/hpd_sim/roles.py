"""Deployment advice: which stages a fleet's pools should serve for a given traffic mix.

Routing chooses, per request, between a transfer, a recompute and a decode worker's own
prefill, but it cannot make a prefill-only worker decode: where the declared split does not
fit the traffic (short prompts are decode-bound; a slow link separates prefill GPUs from most
decode GPUs), the deployment, not the router, sets the ceiling. Every engine can be started
able to serve both stages (vLLM's NIXL connector with ``kv_role: kv_both``), so the split is
an operator's choice, and this module makes it the way DistServe places its phases: simulate
each candidate deployment on a sample of the traffic and keep the one with the most goodput.

Candidates (:data:`DEPLOYMENTS`):

* ``as_declared``: the pools as the cluster file declares them; the planner chooses per
  request between transfer, recompute and a decode worker's own prefill;
* ``both_stages``: every pool serves both stages and the planner still chooses per request
  whether to disaggregate (a prefill on a worker that decodes is priced by the stall it puts
  on that worker's batch);
* ``colocated``: every pool serves both stages and every request runs on one worker (the
  profile's ``pairing: colocated``);
* ``colocated_weights``: the same deployment, each request's worker ranked by the weighted
  load factors alone (the built-in ``colocated`` profile, no SLO objective). On a fleet
  where every request runs whole on one worker, ranking by predicted TTFT and TPOT can lose
  to plain load balancing: measured on the suite's decode-heavy cluster with long prompts
  (2,000-request samples, two seeds), 5.75-5.87 req/s with the objective against 6.60-6.85
  by weights, and 2-15 % less on the homogeneous cluster's Mooncake slices; on most other cells
  they are within a search step of each other. Which one a fleet should run is measured,
  like the deployment.

The sample must not be the traffic the advice is then judged on: :func:`advise` takes it as
given, and the suite (:mod:`.suite`) draws it from a disjoint slice of a trace or another
seed of a synthetic generator. Ties keep the earlier candidate, so a deployment is changed
only for a measured gain (the search's own step, ``rel_tol``, is the resolution).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpd_scheduler.policy import Profile, builtin_profile
from hpd_sim.traces import Trace

from .cluster import ClusterSpec
from .engine import SimConfig
from .metrics import Slo
from .runner import run_point, run_policy

__all__ = ["DEPLOYMENTS", "Advice", "Deployment", "advise", "deployment"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """A way to run a fleet: whether every pool serves both stages, and whether requests
    may be split across two workers at all."""

    name: str
    description: str
    every_pool_both: bool
    colocated: bool
    routing: str = ""
    """A built-in profile that routes this deployment instead of the base profile ('': the
    base profile, with this deployment's pairing)."""

    def cluster(self, spec: ClusterSpec) -> ClusterSpec:
        """The cluster as this deployment runs it."""
        if not self.every_pool_both:
            return spec
        both = spec.colocated()
        return replace(both, name=f"{spec.name}-{self.name}")

    def profile(self, base: Profile) -> Profile:
        """``base`` as this deployment runs it (the pairing, nothing else), or the built-in
        profile it names in ``routing``."""
        if self.routing:
            return builtin_profile(self.routing)
        return replace(base, pairing="colocated") if self.colocated else base


DEPLOYMENTS = (
    Deployment(
        "as_declared",
        "pools as declared; per request: transfer, recompute or the decode worker's own prefill",
        every_pool_both=False,
        colocated=False,
    ),
    Deployment(
        "both_stages",
        "every pool serves both stages; per request: disaggregate or not",
        every_pool_both=True,
        colocated=False,
    ),
    Deployment(
        "colocated",
        "every pool serves both stages; every request on one worker",
        every_pool_both=True,
        colocated=True,
    ),
    Deployment(
        "colocated_weights",
        "every pool serves both stages; every request on one worker, by the weighted factors",
        every_pool_both=True,
        colocated=True,
        routing="colocated",
    ),
)


def deployment(name: str) -> Deployment:
    """A candidate by name; ``ValueError`` naming the known ones."""
    for d in DEPLOYMENTS:
        if d.name == name:
            return d
    known = ", ".join(d.name for d in DEPLOYMENTS)
    raise ValueError(f"unknown deployment {name!r}; known: {known}")


@dataclass(frozen=True, slots=True)
class Advice:
    """The chosen deployment and what the sample showed of each candidate: its goodput
    (req/s), or for a candidate that could not beat the leader of its turn, ``None`` with the
    rate it failed at in ``failed_at_rps``."""

    chosen: Deployment
    goodput_rps: dict[str, float | None]
    failed_at_rps: dict[str, float]
    sample_requests: int

    def to_dict(self) -> dict[str, object]:
        return {
            "deployment": self.chosen.name,
            "sample_goodput_rps": self.goodput_rps,
            "sample_failed_at_rps": self.failed_at_rps,
            "sample_requests": self.sample_requests,
        }


def advise(
    spec: ClusterSpec,
    profile: Profile,
    sample: Trace,
    slo: Slo,
    config: SimConfig,
    start: float = 1.0,
    rel_tol: float = 0.1,
    candidates: tuple[Deployment, ...] = DEPLOYMENTS,
    target: float = 0.9,
) -> Advice:
    """Choose the candidate deployment of ``spec`` with the highest goodput for ``profile``
    over ``sample`` (module docstring).

    The first candidate's goodput is searched; each later one is first tried at the leader's
    goodput plus the search's resolution (``rel_tol``): one that misses the attainment
    ``target`` there cannot win by a measurable margin and is left at that (one simulation
    instead of a search), one that keeps it is searched from there and leads if it ends
    higher. The choice is the one a search of every candidate would make wherever attainment
    falls with the rate."""
    if not candidates:
        raise ValueError("advise needs at least one candidate deployment")
    goodput: dict[str, float | None] = {}
    failed: dict[str, float] = {}
    best: Deployment | None = None
    best_scale = start
    for d in candidates:
        fleet, prof = d.cluster(spec), d.profile(profile)
        begin = start
        if best is not None and best_scale > 0:
            begin = best_scale * (1.0 + rel_tol)
            probe = run_point(fleet, prof, sample, begin, slo, config, stop_below=target)
            if probe.attainment < target:
                goodput[d.name] = None
                failed[d.name] = begin * sample.mean_rate
                continue
        run = run_policy(
            fleet, prof, sample, slo, config, search=True, start=begin, rel_tol=rel_tol,
            target=target, early_stop=True,
        )  # fmt: skip
        goodput[d.name] = run.goodput_rps or 0.0
        if best is None or (run.goodput_scale or 0.0) > best_scale:
            best, best_scale = d, run.goodput_scale or 0.0
    assert best is not None
    return Advice(best, goodput, failed, len(sample))
