"""What `hpd plan` says: why each pool of the kept fleet is of its kind, the table, and the
JSON document.

**Why a kind** (:func:`why`): for the requests a pool serves in the program's solution
(bucket rates ``w_i = lam_i x sum of its groups' x_ij``), each kind of the catalogue is
priced at ``$ per 1,000 requests = price per worker-hour x t / 3.6`` with ``t`` the
worker-seconds a request takes in the pool's role on average over ``w`` (``P`` prefill or
``D`` decode; a both-stage worker ``max(P / rho, D / (1 - rho))``, the side its prefill
share binds), at the kind's cheapest group of that role and worker size that serves every
one of those buckets within the SLO (kinds with none left out). The pool's kind is the
cheapest of them, or a cheaper one is at its availability limit, or whole workers (integer
counts) made the cheaper one dearer for this remainder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .milp import Candidate, Pool, Problem
from .planner import PlanResult, Tried, fleet_text
from .traffic import TierSpec

__all__ = ["plan_doc", "render", "why"]

_SIDE = {"prefill": "prefill", "decode": "decode", "both": "request (both stages)"}


def _served(p: Problem, cand: Candidate, pool: Pool) -> dict[int, float]:
    """Bucket index -> requests/s the pool serves in the solution."""
    out: dict[int, float] = {}
    for (i, j), x in cand.shares.items():
        if p.groups[j].pool == pool and cand.counts[j] > 0:
            out[i] = out.get(i, 0.0) + p.buckets[i].rate_rps * x
    return out


def _per_k(p: Problem, kind: str, tp: int, role: str, w: Mapping[int, float]) -> float | None:
    """$ per 1,000 requests of the weights ``w`` on workers of (kind, tp, role) (module
    docstring); None when no such group serves every one of the buckets."""
    total = sum(w.values())
    best: float | None = None
    for j, g in enumerate(p.groups):
        if g.kind.name != kind or g.tp != tp or g.role != role or total <= 0:
            continue
        costs = [p.costs.get((i, j)) for i in w]
        if any(c is None for c in costs):
            continue
        pre = sum(wi * c.prefill_s for wi, c in zip(w.values(), costs, strict=True) if c) / total
        dec = sum(wi * c.decode_s for wi, c in zip(w.values(), costs, strict=True) if c) / total
        secs = {"prefill": pre, "decode": dec}.get(role)
        if secs is None:  # a both-stage worker is bound by the side its prefill share binds
            secs = max(pre / g.rho, dec / (1.0 - g.rho))
        dollars = g.price_per_hour * secs / 3.6
        best = dollars if best is None else min(best, dollars)
    return best


def why(p: Problem, cand: Candidate, pool: Pool) -> str:
    """Why the pool is of its kind (module docstring)."""
    kind, tp, role = pool
    w = _served(p, cand, pool)
    mine = _per_k(p, kind, tp, role, w)
    if cand.alone:
        return (
            f"the cheapest fleet of {cand.alone} alone, cheaper than the mixes the program "
            f"found (which plan no request where another kind misses fewer of them)"
        )
    if mine is None:
        return "kept by the program"
    others: list[tuple[float, str, int]] = []
    unfit = 0
    for k, t in sorted({(g.kind.name, g.tp) for g in p.groups}):
        if (k, t) == (kind, tp):
            continue
        price = _per_k(p, k, t, role, w)
        if price is None:
            unfit += 1
        else:
            others.append((price, k, t))
    side = _SIDE[role]
    note = f"; {unfit} other kind(s) miss the SLO on these requests" if unfit else ""
    cheaper = sorted(o for o in others if o[0] < mine * (1 - 1e-9))
    if not cheaper:
        if not others:
            return f"the only kind serving all of its requests within the SLO{note}"
        nxt = min(others)
        return (
            f"lowest $ per {side} of its share: ${mine:.3f}/1k requests, next "
            f"{_name(nxt[1], nxt[2])} +{(nxt[0] / mine - 1) * 100:.0f}%{note}"
        )
    price, k, t = cheaper[0]
    avail = p.available.get(k)
    used = sum(n * g.tp for n, g in zip(cand.counts, p.groups, strict=True) if g.kind.name == k)
    pct = (1 - price / mine) * 100
    if avail is not None and used >= avail:
        return (
            f"{_name(k, t)} is {pct:.0f}% cheaper per {side}, but its {avail} available "
            f"GPU(s) are in use{note}"
        )
    worker = next(g.price_per_hour for g in p.groups if g.kind.name == k and g.tp == t)
    return (
        f"whole workers: {_name(k, t)} is {pct:.0f}% cheaper per {side} fully used, but a "
        f"worker of it costs ${worker:.2f}/h, more than this share needs{note}"
    )


def _name(kind: str, tp: int) -> str:
    return kind if tp == 1 else f"{kind} tp{tp}"


def _fleet_rows(p: Problem, cand: Candidate) -> list[dict[str, Any]]:
    rows = []
    for pool, n in sorted(cand.pools.items()):
        kind_name, tp, role = pool
        kind = next(g.kind for g in p.groups if g.kind.name == kind_name)
        rows.append(
            {
                "kind": kind_name,
                "gpu": kind.gpu.name,
                "tp": tp,
                "role": role,
                "workers": n,
                "gpus": n * tp,
                "price_per_hour": n * tp * kind.price_per_hour,
                "why": why(p, cand, pool),
            }
        )
    return rows


def _tried_doc(t: Tried) -> dict[str, Any]:
    return {
        "round": t.round,
        "headroom": {
            "prefill": t.headroom.prefill,
            "decode": t.headroom.decode,
            "both": t.headroom.both,
        },
        "price_per_hour": t.candidate.price_per_hour,
        "fleet": fleet_text(t.candidate.pools),
        "traffic_share": t.candidate.alpha,
        "one_kind": t.candidate.alone or None,
        "attainment": {k: v.attainment for k, v in t.verdict.per_tier.items()},
        "lowest_attainment": t.verdict.worst,
        "stopped_early": t.verdict.stopped_early,
        "holds": t.verdict.passed,
    }


def plan_doc(
    res: PlanResult,
    tiers: Sequence[TierSpec],
    meta: Mapping[str, Any],
    cluster: Mapping[str, Any] | None,
    recheck: Sequence[str],
) -> dict[str, Any]:
    """The one JSON object of ``hpd plan --json``."""
    chosen = res.chosen
    best = chosen or (res.infeasible.best if res.infeasible else None)
    if best is None and res.tried:  # none held: the one that came closest
        best = max(res.tried, key=lambda t: (t.verdict.worst, -t.candidate.price_per_hour))
    status = "ok" if chosen else ("infeasible" if res.infeasible else "no_fleet_holds")
    h = best.headroom if best else res.problem.headroom
    doc: dict[str, Any] = {
        **meta,
        "status": status,
        "tiers": [
            {"name": t.name, "share": t.share, "ttft_ms": t.slo.ttft_ms, "tpot_ms": t.slo.tpot_ms}
            for t in tiers
        ],
        "headroom_used": {"prefill": h.prefill, "decode": h.decode, "both": h.both},
        "buckets": [{"bucket": b.label, "rate_rps": b.rate_rps} for b in res.problem.buckets],
        "fleet": _fleet_rows(res.problem, best.candidate) if best else [],
        "price_per_hour": best.candidate.price_per_hour if best else None,
        "attainment": {
            k: {
                "attainment": v.attainment,
                "ttft_ok": v.ttft_ok,
                "tpot_ok": v.tpot_ok,
                "requests": v.requests,
            }
            for k, v in (best.verdict.per_tier.items() if best else ())
        },
        "candidates": [_tried_doc(t) for t in res.tried],
        "infeasible": None,
        "cluster": dict(cluster) if cluster else None,
        "recheck": list(recheck),
        "seconds": {"solve": res.solve_s, "verify": res.verify_s},
    }
    if res.infeasible:
        inf = res.infeasible
        doc["infeasible"] = {
            "binding": inf.binding,
            "reason": inf.reason,
            "traffic_share": inf.alpha,
        }
    return doc


def _table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    head = f"{'kind':<14}{'tp':>3}  {'role':<8}{'workers':>8}{'GPUs':>6}{'$/h':>9}  why"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['kind']:<14}{r['tp']:>3}  {r['role']:<8}{r['workers']:>8}{r['gpus']:>6}"
            f"{r['price_per_hour']:>9.2f}  {r['why']}"
        )
    total = sum(r["price_per_hour"] for r in rows)
    gpus = sum(r["gpus"] for r in rows)
    workers = sum(r["workers"] for r in rows)
    lines.append(f"{'total':<14}{'':>3}  {'':<8}{workers:>8}{gpus:>6}{total:>9.2f}")
    return lines


def render(doc: Mapping[str, Any], target: float) -> str:
    """The terminal report of a :func:`plan_doc` document."""
    t = doc["traffic"]
    out = [
        f"traffic {t['name']}: {t['requests']} requests, {t['mean_rate_rps']:.2f} req/s; "
        f"model {doc['model']}; headroom {doc['headroom']:.2f}; target {target:.0%} a tier",
        "tiers: "
        + "; ".join(
            f"{x['name']} {x['share']:.0%} (TTFT <= {x['ttft_ms']:g} ms, "
            f"TPOT <= {x['tpot_ms']:g} ms)"
            for x in doc["tiers"]
        ),
        "",
    ]
    if doc["infeasible"]:
        out.append(f"no fleet meets the SLOs: {doc['infeasible']['reason']}")
    elif doc["status"] != "ok":
        out.append(f"no fleet held in the simulator in {len(doc['candidates'])} tried;")
    if doc["fleet"]:
        if doc["status"] != "ok":
            out.append("the closest (best reachable found):")
        out += _table(doc["fleet"])
        hu = doc["headroom_used"]
        out.append(
            f"planned at headroom prefill {hu['prefill']:.2f}, decode {hu['decode']:.2f}, "
            f"both {hu['both']:.2f}"
        )
        out.append("")
        out.append(f"verified in the simulator (policy {doc['policy']}):")
        for name, a in doc["attainment"].items():
            mark = "ok" if a["attainment"] >= target else "BELOW TARGET"
            out.append(
                f"  {name:<12} attainment {a['attainment'] * 100:5.1f}%  (TTFT ok "
                f"{a['ttft_ok'] * 100:5.1f}%, TPOT ok {a['tpot_ok'] * 100:5.1f}%)  {mark}"
            )
    if doc["candidates"]:
        out += ["", "fleets simulated:"]
        for i, c in enumerate(doc["candidates"], start=1):
            low = f"{c['lowest_attainment'] * 100:.1f}%" + ("-" if c["stopped_early"] else "")
            verdict = "holds" if c["holds"] else "misses"
            rnd = c["round"] or "-"
            out.append(
                f"  {i}. round {rnd}  ${c['price_per_hour']:8.2f}/h  lowest {low:<7} "
                f"{verdict:<6} {c['fleet']}"
            )
        out.append(
            "  (a '-' after the attainment: the run stopped once it could not reach the target)"
        )
    if doc.get("cluster_file"):
        out += ["", f"cluster file: {doc['cluster_file']}"]
    if doc["recheck"]:
        out += ["", "re-check in the simulator (each tier judged by its own SLO):"]
        out += [f"  {cmd}" for cmd in doc["recheck"]]
    return "\n".join(out)
