"""Goodput (DistServe): the highest request rate at which at least 90 % of requests meet both
their TTFT and TPOT SLOs; found by search over the trace's rate scale. And the fluid
capacity bound: the rate the cluster could sustain with no queueing at all.

**Search** (:func:`search_goodput`): attainment is taken to fall with the rate scale. From a
start scale, double while the target is met (halve while it is not) to bracket the
threshold, then bisect until ``(fail - pass) / pass <= rel_tol``. The goodput is the last
scale that passed (times the trace's mean rate for requests/s); every point evaluated is
returned for the attainment-vs-rate plot.

**Fluid bound** (:func:`fluid_bound`), from the performance model alone, per worker w:

* prefill rate ``mu_p(w) = 1 / E[prefill_s_w(prompt)]`` requests/s, the expectation over the
  trace's prompts (``perfmodel.prefill_ms`` on w's GPU and TP);
* decode rate ``mu_d(w) = max_B B / step_s_w(B, B x c) / E[output - 1]`` requests/s over
  batch sizes ``B <= max_batch`` with ``step_ms_w(B, B x c) <= TPOT SLO`` (the SLO caps the
  batch) and ``B x E[prompt + output] <= KV capacity`` (each sequence reserves its final
  context), where ``c`` is the token-weighted mean context of a decode step,
  ``sum_r sum_{k=1}^{o_r - 1} (p_r + k) / sum_r (o_r - 1)``;
* a worker serving both stages: ``mu_b(w) = 1 / (E[prefill_s] + E[output - 1] x
  step_s(B*) / B*)`` at the decode optimum ``B*`` (it time-shares its GPU);

``bound = min(sum of mu_p over prefill-only workers, sum of mu_d over decode-only workers)
+ sum of mu_b over both-stage workers`` requests/s. Links, queueing and the TTFT SLO are
ignored, so no policy can beat it by much; its ratio to a policy's goodput says how much
capacity the policy leaves unused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpd_common import perfmodel
from hpd_scheduler.policy import Stage
from hpd_sim.traces import TraceRequest

from .cluster import ClusterSpec

__all__ = ["FluidBound", "GoodputSearch", "fluid_bound", "search_goodput"]


@dataclass(slots=True)
class GoodputSearch:
    """Result of a search: the best passing scale (0 if none passed) and every point
    ``(scale, attainment)`` evaluated, in evaluation order."""

    scale: float
    points: list[tuple[float, float]] = field(default_factory=list)


def search_goodput(
    attainment_at: Callable[[float], float],
    target: float = 0.9,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 64,
    max_scale: float = 1024.0,
    max_evals: int = 30,
) -> GoodputSearch:
    """Bracket then bisect the rate scale at which ``attainment_at`` crosses ``target``
    (module docstring). ``attainment_at`` is called once per evaluated scale."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    if not rel_tol > 0 or not start > 0:
        raise ValueError("rel_tol and start must be > 0")
    out = GoodputSearch(0.0)
    cache: dict[float, float] = {}

    def ok(scale: float) -> bool:
        if scale not in cache:
            cache[scale] = attainment_at(scale)
            out.points.append((scale, cache[scale]))
        return cache[scale] >= target

    lo: float | None = None
    hi: float | None = None
    s = start
    if ok(s):
        lo = s
        while len(out.points) < max_evals:
            s *= 2.0
            if s > max_scale:
                out.scale = lo
                return out
            if ok(s):
                lo = s
            else:
                hi = s
                break
    else:
        hi = s
        while len(out.points) < max_evals:
            s /= 2.0
            if s < min_scale:
                return out
            if ok(s):
                lo = s
                break
            hi = s
    if lo is None:
        return out
    if hi is None:
        out.scale = lo
        return out
    while (hi - lo) / lo > rel_tol and len(out.points) < max_evals:
        mid = (lo + hi) / 2.0
        if ok(mid):
            lo = mid
        else:
            hi = mid
    out.scale = lo
    return out


@dataclass(frozen=True, slots=True)
class FluidBound:
    """The fluid capacity bound and its parts, requests/s."""

    rps: float
    prefill_rps: float
    decode_rps: float
    both_rps: float
    per_worker: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "rps": self.rps,
            "prefill_rps": self.prefill_rps,
            "decode_rps": self.decode_rps,
            "both_rps": self.both_rps,
            "per_worker_rps": dict(self.per_worker),
        }


def _decode_opt(
    cluster: ClusterSpec,
    gpu: Any,
    tp: int,
    max_batch: int,
    kv_cap: int,
    ctx: float,
    seq_tokens: float,
    tpot_ms: float,
    dtype: Any,
) -> tuple[float, int]:
    """(best tokens/s, its batch) under the TPOT and memory caps; (0, 0) if even B=1 fails."""
    best = (0.0, 0)
    b_mem = int(kv_cap // seq_tokens) if seq_tokens > 0 else max_batch
    for b in range(1, min(max_batch, b_mem) + 1):
        step = perfmodel.decode_step_ms(
            cluster.model, gpu, tp, b, round(b * ctx), cluster.efficiency, dtype
        )
        if step > tpot_ms:
            break
        rate = b / step * 1e3
        if rate > best[0]:
            best = (rate, b)
    return best


def fluid_bound(
    cluster: ClusterSpec,
    requests: Sequence[TraceRequest],
    tpot_ms: float,
    sample: int = 4000,
) -> FluidBound:
    """The fluid capacity bound of ``cluster`` for the request mix of ``requests`` at the
    TPOT SLO ``tpot_ms`` (module docstring). Expectations use an evenly spaced sample of at
    most ``sample`` requests."""
    if not requests:
        raise ValueError("fluid_bound needs at least one request")
    step = max(1, len(requests) // sample)
    reqs = list(requests[::step])
    n = len(reqs)
    mean_dec = sum(max(r.output_tokens - 1, 0) for r in reqs) / n
    mean_seq = sum(r.prompt_tokens + r.output_tokens for r in reqs) / n
    dec_tokens = sum(max(r.output_tokens - 1, 0) for r in reqs)
    ctx_sum = sum(
        (r.output_tokens - 1) * r.prompt_tokens + (r.output_tokens - 1) * r.output_tokens / 2.0
        for r in reqs
        if r.output_tokens > 1
    )
    ctx = ctx_sum / dec_tokens if dec_tokens else 0.0
    prefill_rps = decode_rps = both_rps = 0.0
    per_worker: dict[str, float] = {}
    for pool in cluster.pools:
        mean_prefill_s = (
            sum(
                perfmodel.prefill_ms(
                    cluster.model, pool.gpu, pool.tp, r.prompt_tokens, cluster.efficiency
                )
                for r in reqs
            )
            / n
            * 1e-3
        )
        kv_cap = perfmodel.max_kv_tokens(
            cluster.model, pool.gpu, pool.tp, pool.memory_fraction, pool.kv_dtype
        )
        tok_s, b = _decode_opt(
            cluster,
            pool.gpu,
            pool.tp,
            pool.max_batch_size,
            kv_cap,
            ctx,
            mean_seq,
            tpot_ms,
            pool.kv_dtype,
        )
        mu_p = 1.0 / mean_prefill_s if mean_prefill_s > 0 else math.inf
        mu_d = tok_s / mean_dec if mean_dec > 0 else math.inf
        if pool.stage is Stage.PREFILL:
            mu = mu_p
            prefill_rps += mu * pool.count
        elif pool.stage is Stage.DECODE:
            mu = mu_d
            decode_rps += mu * pool.count
        else:
            dec_s = mean_dec / tok_s if tok_s > 0 else math.inf
            mu = 1.0 / (mean_prefill_s + dec_s) if b > 0 else 0.0
            both_rps += mu * pool.count
        for i in range(pool.count):
            per_worker[f"{pool.pool_id}-{i}"] = mu
    disagg = min(prefill_rps, decode_rps)
    return FluidBound(disagg + both_rps, prefill_rps, decode_rps, both_rps, per_worker)
