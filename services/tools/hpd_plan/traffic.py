"""The traffic `hpd plan` sizes a fleet for: a trace (or a rate and a prompt/output mix made
into one), its tiers with their SLOs, and the traffic cut into buckets.

**Tiers.** Requests are given tiers by weight (``--tier interactive=0.3,standard=0.7``), as
the simulator assigns them; each tier's SLO defaults to the policy profile's targets for it
(``Tier.ttft_ms`` / ``tpot_ms``) and may be overridden.

**Buckets** (Mélange's request-size buckets): per tier, the requests are cut by prompt
length and by output length at the 50th, 80th and 95th percentiles of each (equal edges
merge, so a mix of a few exact sizes gives one bucket per size), at most 16 buckets a tier.
A bucket's arrival rate is ``trace rate x (share of the requests in it) x tier weight``.
Costs are computed on the requests themselves (an evenly spaced sample of at most
``SAMPLE`` of them), never on a bucket's midpoint, so the long tail of a bucket is counted.

**Prefix hits** (traces with prefix-block ids): a request's cached tokens are the longest
prefix of its blocks that some earlier request of the trace already had (``BLOCK_TOKENS``
a block, at most ``prompt - 1``): the hit rate of one cache shared by the whole fleet, an
upper bound of what per-worker caches reach; the verification in the simulator, whose
workers keep their own caches, is the check on it.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpd_scheduler.policy import Profile
from hpd_sim.metrics import Slo
from hpd_sim.traces import Trace, TraceRequest

__all__ = [
    "BLOCK_TOKENS",
    "QUANTILES",
    "SAMPLE",
    "Bucket",
    "TierSpec",
    "buckets",
    "mix_trace",
    "parse_mix",
    "parse_tiers",
    "prefix_hits",
    "tier_specs",
]

SAMPLE = 5000
"""Requests at most that bucket statistics are computed over (evenly spaced)."""
QUANTILES = (0.5, 0.8, 0.95)
"""Bucket edges: these percentiles of prompt and of output length."""
BLOCK_TOKENS = 512
"""Prefix-block size of the traces' ``hash_ids`` (the simulator's ``prefix_block_tokens``)."""


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A tier of the traffic: its weight as given, its share of the requests and its SLO."""

    name: str
    weight: float
    share: float
    slo: Slo


@dataclass(frozen=True, slots=True)
class Bucket:
    """Requests of one tier within a prompt and an output length range.

    ``reqs``: the sampled requests as ``(prompt tokens, cached prompt tokens, output
    tokens)``; ``rate_rps``: this bucket's arrivals per second; ``tier_share``: its share
    of its tier's requests."""

    tier: str
    slo: Slo
    prompt_hi: int
    output_hi: int
    rate_rps: float
    tier_share: float
    reqs: tuple[tuple[int, int, int], ...]

    @property
    def label(self) -> str:
        """``interactive p<=1020 o<=129``."""
        return f"{self.tier} p<={self.prompt_hi} o<={self.output_hi}"

    @property
    def decode_tokens(self) -> float:
        """Mean tokens decoded after the first: ``E[max(output - 1, 0)]``."""
        return sum(max(o - 1, 0) for _, _, o in self.reqs) / len(self.reqs)

    @property
    def decode_ctx(self) -> float:
        """Token-weighted mean context of a decode step,
        ``sum_r sum_{k=1}^{o_r-1} (p_r + k) / sum_r (o_r - 1)`` (the prompt if nothing is
        decoded)."""
        num = sum((o - 1) * p + (o - 1) * o / 2.0 for p, _, o in self.reqs if o > 1)
        den = sum(o - 1 for _, _, o in self.reqs if o > 1)
        return num / den if den else sum(p for p, _, _ in self.reqs) / len(self.reqs)

    @property
    def seq_tokens(self) -> float:
        """Mean KV a sequence reserves on its decode worker: ``E[prompt + output]``."""
        return sum(p + o for p, _, o in self.reqs) / len(self.reqs)


def parse_tiers(text: str) -> tuple[tuple[str, float], ...]:
    """``interactive=0.3,standard=0.7`` (a name alone weighs 1) -> ((name, weight), ...)."""
    out: list[tuple[str, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        w = float(weight) if weight else 1.0
        if not w > 0:
            raise ValueError(f"tier {name!r}: weight must be > 0")
        out.append((name.strip(), w))
    if not out:
        raise ValueError("--tier needs at least one tier name")
    if len({n for n, _ in out}) != len(out):
        raise ValueError("--tier names a tier twice")
    return tuple(out)


def tier_specs(
    tiers: Sequence[tuple[str, float]],
    profile: Profile,
    overrides: Mapping[str, Slo],
) -> tuple[TierSpec, ...]:
    """Each tier with its share and SLO: ``overrides[name]``, else ``overrides['*']``, else
    the profile's tier targets (ValueError naming the tier when none applies)."""
    total = sum(w for _, w in tiers)
    out: list[TierSpec] = []
    for name, w in tiers:
        slo = overrides.get(name) or overrides.get("*")
        if slo is None:
            tier = profile.tiers.get(name)
            if tier is None:
                known = ", ".join(sorted(profile.tiers))
                raise ValueError(
                    f"tier {name!r} is not in the policy's tiers ({known}): give its SLO "
                    f"with --slo {name}:ttft=MS,tpot=MS"
                )
            slo = Slo(tier.ttft_ms, tier.tpot_ms)
        out.append(TierSpec(name, w, w / total, slo))
    unknown = set(overrides) - {n for n, _ in tiers} - {"*"}
    if unknown:
        raise ValueError(f"--slo names tiers not in --tier: {', '.join(sorted(unknown))}")
    return tuple(out)


def parse_mix(text: str) -> tuple[tuple[int, int, float], ...]:
    """``1024:128=0.7,8000:300=0.3`` -> ((prompt, output, weight), ...); a class without
    ``=W`` weighs 1."""
    out: list[tuple[int, int, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        sizes, _, weight = part.partition("=")
        p, sep, o = sizes.partition(":")
        if not sep:
            raise ValueError(f"bad mix class {part!r}; expected PROMPT:OUTPUT[=WEIGHT]")
        prompt, output, w = int(p), int(o), float(weight) if weight else 1.0
        if prompt < 1 or output < 1 or not w > 0:
            raise ValueError(f"mix class {part!r}: lengths must be >= 1 and the weight > 0")
        out.append((prompt, output, w))
    if not out:
        raise ValueError("--mix needs at least one PROMPT:OUTPUT class")
    return tuple(out)


def mix_trace(
    rate_rps: float, mix: Sequence[tuple[int, int, float]], n: int, seed: int = 0
) -> Trace:
    """``n`` requests arriving as a Poisson process of ``rate_rps``, each of one mix class
    drawn by weight (exactly that class's prompt and output lengths)."""
    if not rate_rps > 0:
        raise ValueError(f"--rate must be > 0, got {rate_rps}")
    if n < 2:
        raise ValueError(f"--requests must be >= 2, got {n}")
    rng = random.Random(f"plan-mix:{seed}")
    total = sum(w for _, _, w in mix)
    cum: list[float] = []
    acc = 0.0
    for _, _, w in mix:
        acc += w / total
        cum.append(acc)
    t = 0.0
    rows: list[TraceRequest] = []
    for i in range(n):
        if i:
            t += rng.expovariate(rate_rps)
        k = min(bisect.bisect_left(cum, rng.random()), len(mix) - 1)
        rows.append(TraceRequest(t, mix[k][0], mix[k][1]))
    name = "mix-" + "+".join(f"{p}x{o}" for p, o, _ in mix)
    return Trace(name, tuple(rows))


def prefix_hits(requests: Sequence[TraceRequest], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Per request, its cached prompt tokens as one fleet-wide cache would have them (module
    docstring): ``min(k x block_tokens, prompt - 1)`` for the longest prefix of ``k`` of its
    blocks seen in an earlier request; 0 without block ids."""
    seen: set[int] = set()
    out: list[int] = []
    for r in requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        out.append(min(k * block_tokens, max(r.prompt_tokens - 1, 0)))
        seen.update(r.hash_ids)
    return out


def _edges(values: Sequence[int]) -> list[int]:
    """Upper edges of the length ranges: the ``QUANTILES`` of ``values`` and their maximum,
    duplicates merged."""
    ordered = sorted(values)
    n = len(ordered)
    cuts = {ordered[min(n - 1, int(q * n))] for q in QUANTILES} | {ordered[-1]}
    return sorted(cuts)


def buckets(trace: Trace, tiers: Sequence[TierSpec]) -> list[Bucket]:
    """The trace cut into buckets per tier (module docstring)."""
    if len(trace) < 2 or trace.mean_rate <= 0:
        raise ValueError("the traffic needs at least two requests over a positive duration")
    cached = prefix_hits(trace.requests)
    step = max(1, len(trace) // SAMPLE)
    rows = [
        (r.prompt_tokens, cached[i], r.output_tokens)
        for i, r in enumerate(trace.requests)
        if i % step == 0
    ]
    p_edges = _edges([p for p, _, _ in rows])
    o_edges = _edges([o for _, _, o in rows])
    cells: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for row in rows:
        key = (bisect.bisect_left(p_edges, row[0]), bisect.bisect_left(o_edges, row[2]))
        cells.setdefault(key, []).append(row)
    out: list[Bucket] = []
    for tier in tiers:
        for (pi, oi), reqs in sorted(cells.items()):
            share = len(reqs) / len(rows)
            out.append(
                Bucket(
                    tier=tier.name,
                    slo=tier.slo,
                    prompt_hi=p_edges[pi],
                    output_hi=o_edges[oi],
                    rate_rps=trace.mean_rate * share * tier.share,
                    tier_share=share,
                    reqs=tuple(reqs),
                )
            )
    return out
