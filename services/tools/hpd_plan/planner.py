"""The planning loop: size the fleet with the integer program, verify the cheapest few
fleets in the simulator, keep the cheapest that holds; tighten the headroom of the side
that missed when none does.

**Headroom** (default ``DEFAULT_HEADROOM`` = 0.8 of a worker's capacity): the integer
program loads no worker past it. Chosen from queueing, not from a trace: at utilisation
``u`` a single M/D/1 server's mean wait is ``u / (2 (1 - u))`` service times, 2 at 0.8 and
4.5 at 0.9, the knee past which waits (and so TTFT) grow out of proportion; it is also the
saturation threshold llm-d's autoscaler uses (0.8) and near HexGen-3's target utilisation
(0.75).

**Miss budget**: a tier may have ``(1 - target)`` of its requests miss; the program may
spend ``MISS_SHARE`` of that on requests the cost model expects to miss (a prompt too long
to prefill within TTFT), leaving the rest to queueing tails; and a bucket is planned only
on groups that miss at most that much more of it than its best placement
(``CostModel.table``).

**Rounds**: each round solves for up to ``candidates`` fleets (the cheapest, then the next
cheapest distinct mixes, ``milp.best_candidates``), adds each kind's cheapest fleet on its
own where that is cheaper than the last of them (the placement rule above is relative to
the catalogue: a bucket a kind serves with more misses than another kind is not planned on
it, so a catalogue of more kinds rules out placements that the kind alone may use; with
its own fleet among the candidates, adding kinds to a catalogue never yields a dearer
plan in the first round), and simulates them cheapest first,
stopping at the first whose every tier reaches the target. When none does, the side that
missed in the cheapest fleet's run (TTFT: prefill, TPOT: decode; both-stage workers share
either) gets its headroom multiplied by ``TIGHTEN`` and the program is solved again, up to
``rounds`` rounds; a fleet already simulated is not simulated again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from hpd_common import perfmodel
from hpd_scheduler.policy import Profile
from hpd_sim.traces import Trace

from .capacity import CostModel, Group, Headroom, groups
from .catalogue import Catalogue
from .milp import Candidate, Pool, Problem, best_candidates, max_alpha
from .traffic import Bucket, TierSpec, buckets
from .verify import Progress, Verdict, cluster_doc, to_cluster, verify

__all__ = [
    "DEFAULT_HEADROOM",
    "MISS_SHARE",
    "TIGHTEN",
    "Infeasible",
    "PlanInputs",
    "PlanResult",
    "Tried",
    "fleet_text",
    "plan",
]

DEFAULT_HEADROOM = 0.8
"""The share of a worker's capacity the program may load (module docstring: why 0.8)."""
MISS_SHARE = 0.5
"""The share of a tier's allowed misses (``1 - target``) the program may spend on requests
the cost model expects to miss; the rest is left to queueing tails."""
TIGHTEN = 0.85
"""Each round without a fleet that holds takes 15 % off the failing side's headroom."""
MIN_HEADROOM = 0.2
"""No side is planned below this share of its capacity."""


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What a plan is made from."""

    trace: Trace
    tiers: tuple[TierSpec, ...]
    catalogue: Catalogue
    model: perfmodel.ModelSpec
    profile: Profile
    headroom: float = DEFAULT_HEADROOM
    target: float = 0.9
    candidates: int = 3
    rounds: int = 4
    seed: int = 0
    verify_all: bool = False
    admit: Callable[[Group], bool] | None = None
    """Only the groups it admits may hold workers (a baseline's restriction; None: all)."""


@dataclass(frozen=True, slots=True)
class Tried:
    """A fleet simulated: the candidate, its run, and the round and headroom it came from."""

    candidate: Candidate
    verdict: Verdict
    round: int
    headroom: Headroom


@dataclass(frozen=True, slots=True)
class Infeasible:
    """No fleet within the catalogue meets the SLOs at the headroom: what binds (a tier's
    name, ``memory`` or ``availability``), why, the most traffic a fleet carries, and that
    fleet's run on the whole traffic."""

    binding: str
    reason: str
    alpha: float = 0.0
    best: Tried | None = None


@dataclass(slots=True)
class PlanResult:
    """The plan: the fleet kept (None if none held), every fleet simulated, the problem of
    the last round, and the diagnosis when the program had no solution."""

    chosen: Tried | None
    tried: list[Tried]
    problem: Problem
    infeasible: Infeasible | None = None
    solve_s: float = 0.0
    verify_s: float = 0.0


def fleet_text(pools: Mapping[Pool, int]) -> str:
    """``2 x H100-SXM prefill + 3 x L40S decode`` (``tpN`` shown above one GPU a worker)."""
    parts = []
    for (kind, tp, role), n in sorted(pools.items()):
        size = f" tp{tp}" if tp > 1 else ""
        parts.append(f"{n} x {kind}{size} {role}")
    return " + ".join(parts) or "(no workers)"


def _problem(
    inputs: PlanInputs, cm: CostModel, bs: list[Bucket], gs: list[Group], h: Headroom
) -> Problem:
    budget = (1.0 - inputs.target) * MISS_SHARE
    return Problem(
        buckets=bs,
        groups=gs,
        costs=cm.table(gs, bs, h, slack=budget),
        headroom=h,
        miss_budget=budget,
        available={k.name: k.available for k in inputs.catalogue.kinds},
    )


def _with_single_kinds(
    inputs: PlanInputs,
    cm: CostModel,
    bs: list[Bucket],
    gs: list[Group],
    h: Headroom,
    cands: list[Candidate],
) -> list[Candidate]:
    """``cands`` and, cheaper than the last of them, each kind's cheapest fleet on its own
    (module docstring), cheapest first; a kind's fleet carries the full problem's indices."""
    if not cands or len(inputs.catalogue.kinds) < 2:
        return cands
    out = list(cands)
    seen = {tuple(sorted(c.pools.items())) for c in cands}
    limit = cands[-1].price_per_hour
    for kind in inputs.catalogue.kinds:
        sub = [j for j, g in enumerate(gs) if g.kind is kind]
        if not sub:
            continue
        alone = best_candidates(_problem(inputs, cm, bs, [gs[j] for j in sub], h), 1)
        if not alone or alone[0].price_per_hour >= limit - 1e-9:
            continue
        c = alone[0]
        if tuple(sorted(c.pools.items())) in seen:
            continue
        counts = [0] * len(gs)
        for k, j in enumerate(sub):
            counts[j] = c.counts[k]
        shares = {(i, sub[k]): x for (i, k), x in c.shares.items()}
        out.append(Candidate(tuple(counts), c.pools, c.price_per_hour, shares, 1.0, kind.name))
    return sorted(out, key=lambda c: c.price_per_hour)


def _tighten(h: Headroom, v: Verdict, target: float) -> Headroom:
    """The next round's headroom (module docstring)."""
    ttft = min(t.ttft_ok for t in v.per_tier.values())
    tpot = min(t.tpot_ok for t in v.per_tier.values())
    short_p, short_d = ttft < target, tpot < target
    if not short_p and not short_d:  # each side alone holds, together they do not
        short_p, short_d = ttft <= tpot, tpot < ttft
    return Headroom(
        prefill=max(MIN_HEADROOM, h.prefill * (TIGHTEN if short_p else 1.0)),
        decode=max(MIN_HEADROOM, h.decode * (TIGHTEN if short_d else 1.0)),
        both=max(MIN_HEADROOM, h.both * TIGHTEN),
    )


def _run(
    inputs: PlanInputs, cand: Candidate, label: str, progress: Progress, stop: bool
) -> Verdict:
    doc = cluster_doc(cand.pools, inputs.catalogue, inputs.model, "plan")
    progress.start(label)
    v = verify(
        to_cluster(doc),
        inputs.profile,
        inputs.trace,
        inputs.tiers,
        inputs.target,
        inputs.seed,
        progress,
        stop_early=stop,
    )
    worst = f"{v.worst * 100:.1f}%" + (" or less (stopped early)" if v.stopped_early else "")
    progress.end(f"{'holds' if v.passed else 'misses'}: lowest tier attainment {worst}")
    return v


def plan(inputs: PlanInputs, progress: Progress | None = None) -> PlanResult:
    """Plan (module docstring). Raises ``milp.SolverMissing`` without highspy."""
    progress = progress or Progress(enabled=False)
    cm = CostModel(inputs.model)
    bs = buckets(inputs.trace, inputs.tiers)
    gs = [g for g in groups(inputs.catalogue) if inputs.admit is None or inputs.admit(g)]
    h = Headroom(inputs.headroom, inputs.headroom, inputs.headroom)
    seen: dict[tuple[tuple[Pool, int], ...], Verdict] = {}
    result = PlanResult(None, [], _problem(inputs, cm, bs, gs, h))
    for rnd in range(1, inputs.rounds + 1):
        t0 = time.perf_counter()
        problem = result.problem if rnd == 1 else _problem(inputs, cm, bs, gs, h)
        result.problem = problem
        cands = best_candidates(problem, inputs.candidates)
        cands = _with_single_kinds(inputs, cm, bs, gs, h, cands)
        result.solve_s += time.perf_counter() - t0
        if not cands:
            result.infeasible = _diagnose(inputs, problem, progress, result)
            return result
        first: Verdict | None = None
        for n, cand in enumerate(cands, start=1):
            key = tuple(sorted(cand.pools.items()))
            t1 = time.perf_counter()
            if key not in seen:
                label = (
                    f"round {rnd} fleet {n}/{len(cands)} ${cand.price_per_hour:.2f}/h "
                    f"({fleet_text(cand.pools)})"
                )
                seen[key] = _run(inputs, cand, label, progress, stop=True)
            result.verify_s += time.perf_counter() - t1
            tried = Tried(cand, seen[key], rnd, h)
            result.tried.append(tried)
            first = first or tried.verdict
            if tried.verdict.passed and result.chosen is None:
                result.chosen = tried  # the cheapest that holds: candidates come cheapest first
                if not inputs.verify_all:
                    return result
        if result.chosen is not None:
            return result
        assert first is not None
        h = _tighten(h, first, inputs.target)
    return result


def _structural(p: Problem) -> tuple[str, str, float] | None:
    """(binding, reason, the least share of a tier's requests that miss) when some tier
    misses more than its budget, or some bucket fits nowhere, whatever the fleet's size."""
    worst: dict[str, float] = {}
    culprit: dict[str, tuple[float, Bucket]] = {}
    for i, b in enumerate(p.buckets):
        sides: dict[str, float] = {}
        for role in ("prefill", "decode", "both"):
            ms = [c.miss for (bi, j), c in p.costs.items() if bi == i and p.groups[j].role == role]
            sides[role] = min(ms) if ms else 2.0
        best = min(sides["both"], sides["prefill"] + sides["decode"])
        if best >= 2.0:
            return (
                "memory",
                (
                    f"no kind's workers hold the KV of {b.label} "
                    f"(~{b.seq_tokens:.0f} tokens a sequence): add a larger worker size (tp)"
                ),
                1.0,
            )
        worst[b.tier] = worst.get(b.tier, 0.0) + b.tier_share * min(best, 1.0)
        if b.tier_share * best > culprit.get(b.tier, (0.0, b))[0]:
            culprit[b.tier] = (b.tier_share * best, b)
    tier, miss = max(worst.items(), key=lambda kv: kv[1])
    if miss <= p.miss_budget + 1e-9:
        return None
    b = culprit[tier][1]
    return (
        tier,
        (
            f"tier {tier}: {miss * 100:.1f}% of its requests miss TTFT {b.slo.ttft_ms:g} ms "
            f"/ TPOT {b.slo.tpot_ms:g} ms on every kind however many (so its attainment is "
            f"at most {(1 - miss) * 100:.1f}%; the plan may leave {p.miss_budget * 100:.1f}% "
            f"to such misses), most of them {b.label}: relax the SLO, allow larger worker "
            f"sizes (tp) or faster kinds"
        ),
        miss,
    )


def _at_limit(inputs: PlanInputs, p: Problem, cand: Candidate) -> list[str]:
    """The kinds whose every available GPU the fleet uses."""
    out = []
    for k in inputs.catalogue.kinds:
        used = sum(n * g.tp for n, g in zip(cand.counts, p.groups, strict=True) if g.kind is k)
        if k.available is not None and used >= k.available:
            out.append(k.name)
    return sorted(out)


def _diagnose(inputs: PlanInputs, p: Problem, progress: Progress, result: PlanResult) -> Infeasible:
    """Why the program has no solution, and the best a fleet within the catalogue reaches:
    with a tier that misses structurally, the cheapest fleet when that tier may miss that
    much more; else the fleet that carries the most traffic; either simulated on the whole
    traffic."""
    found = _structural(p)
    if found is not None and found[0] == "memory":
        return Infeasible(found[0], found[1])
    q = p if found is None else replace(p, miss_budget=found[2] + p.miss_budget)
    cands = best_candidates(q, 1) if found is not None else []
    cand = cands[0] if cands else max_alpha(q)
    if cand is None:
        return Infeasible("availability", "no fleet within the catalogue carries any traffic")
    if found is not None:
        binding, reason = found[0], found[1]
    else:
        binding = "availability"
        reason = (
            f"availability binds: the catalogue's GPUs carry at most {cand.alpha * 100:.0f}% "
            f"of the traffic at headroom {p.headroom.prefill:.2f}/{p.headroom.decode:.2f} "
            f"(prefill/decode); at their limit: {', '.join(_at_limit(inputs, p, cand)) or '-'}"
        )
    label = f"best reachable ${cand.price_per_hour:.2f}/h ({fleet_text(cand.pools)})"
    v = _run(inputs, cand, label, progress, stop=False)
    best = Tried(cand, v, 0, p.headroom)
    result.tried.append(best)
    return Infeasible(binding, reason, cand.alpha, best)
