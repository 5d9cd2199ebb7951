"""The demo's report: per tier and overall, from the gateway's request records.

Definitions (the simulator's, ``hpd_sim.metrics``, whose percentile this uses):

* TTFT, TPOT: emulated ms as the gateway measured them; percentiles are nearest-rank over
  the *completed* requests of the tier.
* SLO attainment: the share of *all* the tier's requests (rejected and failed ones count as
  misses) that completed with TTFT <= the tier's ``ttft_ms`` and TPOT <= its ``tpot_ms``.
* admitted attainment: the same share over the requests the control plane *admitted*
  (completed or failed, not refused): whether admission kept its promise.
* goodput: SLO-meeting requests per emulated second of replay (``met / replay_s``), the
  single-run form of DistServe's goodput (which searches for the highest rate keeping
  attainment >= 90 %; ``hpd sim`` does that search); ``goodput_per_dollar_hour`` divides it
  by the fleet's assumed price per hour.
* accounting: every request is exactly one of completed, rejected (with a reason) or failed
  (with a cause); ``accounted`` is true when the counts add up and no id repeats.
"""

from __future__ import annotations

import collections
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpd_sim.metrics import Slo, percentile

from .replay_common import RequestRecord

__all__ = ["TierSlo", "build_report", "format_report", "plot_report", "write_report"]

TierSlo = Slo


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{p}": round(percentile(values, p), 2) for p in (50, 90, 99)}


def _met(r: RequestRecord, slo: Slo | None) -> bool:
    if not r.completed or slo is None:
        return r.completed and slo is None
    return r.ttft_ms <= slo.ttft_ms and (r.output_tokens <= 1 or r.tpot_ms <= slo.tpot_ms)


def _group(
    records: Sequence[RequestRecord], slo: Slo | None, replay_s: float, price: float
) -> dict[str, Any]:
    done = [r for r in records if r.completed]
    met = sum(_met(r, slo) for r in records)
    n = len(records)
    admitted = sum(r.status != "rejected" for r in records)
    goodput = met / replay_s if replay_s > 0 else 0.0
    return {
        "requests": n,
        "completed": len(done),
        "rejected": sum(r.status == "rejected" for r in records),
        "failed": sum(r.status == "failed" for r in records),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms} if slo else None,
        "ttft_ms": _pcts([r.ttft_ms for r in done]),
        "tpot_ms": _pcts([r.tpot_ms for r in done if r.output_tokens > 1]),
        "slo_attainment": round(met / n, 4) if n else 0.0,
        "admitted_attainment": round(met / admitted, 4) if admitted else None,
        "goodput_rps": round(goodput, 3),
        "goodput_per_dollar_hour": round(goodput / price, 4) if price > 0 else None,
        "modes": dict(collections.Counter(r.mode_used for r in done)),
        "planned_modes": dict(
            collections.Counter(r.planned_mode for r in records if r.planned_mode)
        ),
        "decisions": dict(collections.Counter(r.decision for r in records if r.decision)),
        "fallbacks": dict(collections.Counter(r.fallback for r in records if r.fallback)),
        "rejects": dict(collections.Counter(r.reason for r in records if r.status == "rejected")),
        "failures": dict(collections.Counter(r.reason for r in records if r.status == "failed")),
        "serving_actions": dict(
            collections.Counter(r.serving_action for r in records if r.serving_action)
        ),
        # completed requests per pool (a pool counts once per request, whatever its stages)
        "pools": dict(
            collections.Counter(
                pool for r in done for pool in {r.prefill_pool, r.decode_pool} if pool
            )
        ),
    }


def build_report(
    records: Sequence[RequestRecord],
    tier_slos: Mapping[str, Slo],
    replay_s: float,
    price_per_hour: float = 0.0,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report as a JSON-ready dict (module docstring)."""
    ids = [r.request_id for r in records]
    by_tier: dict[str, list[RequestRecord]] = collections.defaultdict(list)
    for r in records:
        by_tier[r.tier].append(r)
    overall = _group(records, None, replay_s, price_per_hour)
    overall["slo_attainment"] = (
        round(sum(_met(r, tier_slos.get(r.tier)) for r in records) / len(records), 4)
        if records
        else 0.0
    )
    met_all = sum(_met(r, tier_slos.get(r.tier)) for r in records)
    admitted = sum(r.status != "rejected" for r in records)
    overall["admitted_attainment"] = round(met_all / admitted, 4) if admitted else None
    overall["goodput_rps"] = round(met_all / replay_s, 3) if replay_s > 0 else 0.0
    overall["goodput_per_dollar_hour"] = (
        round(overall["goodput_rps"] / price_per_hour, 4) if price_per_hour > 0 else None
    )
    counted = overall["completed"] + overall["rejected"] + overall["failed"]
    report: dict[str, Any] = {
        "replay_s": round(replay_s, 3),
        "price_per_hour_usd": round(price_per_hour, 2),
        "accounting": {
            "requests": len(records),
            "completed": overall["completed"],
            "rejected": overall["rejected"],
            "failed": overall["failed"],
            "unique_ids": len(set(ids)),
            "accounted": counted == len(records) == len(set(ids))
            and all(r.status in ("completed", "rejected", "failed") for r in records)
            and all(r.reason for r in records if r.status != "completed"),
        },
        "overall": overall,
        "tiers": {
            t: _group(rs, tier_slos.get(t), replay_s, price_per_hour)
            for t, rs in sorted(by_tier.items())
        },
    }
    if extra:
        report.update(extra)
    return report


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _counts(d: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text for the terminal."""
    acc = report["accounting"]
    lines = [
        f"replay {report['replay_s']:.1f} s emulated, {acc['requests']} requests: "
        f"{acc['completed']} completed, {acc['rejected']} rejected, {acc['failed']} failed "
        f"({'all accounted for' if acc['accounted'] else 'ACCOUNTING MISMATCH'})",
        "",
        f"{'tier':<12}{'reqs':>6}{'TTFT p50/p90/p99 ms':>24}{'TPOT p50/p90/p99 ms':>24}"
        f"{'SLO att.':>10}{'admitted':>10}{'goodput/s':>11}",
    ]
    rows = [*report["tiers"].items(), ("overall", report["overall"])]
    for name, g in rows:
        t, p = g["ttft_ms"], g["tpot_ms"]
        ttft = "/".join(_fmt(t[k]) for k in ("p50", "p90", "p99"))
        tpot = "/".join(_fmt(p[k]) for k in ("p50", "p90", "p99"))
        adm = g.get("admitted_attainment")
        admitted = "-" if adm is None else f"{adm * 100:.1f}%"
        lines.append(
            f"{name:<12}{g['requests']:>6}{ttft:>24}{tpot:>24}"
            f"{g['slo_attainment'] * 100:>9.1f}%{admitted:>10}{g['goodput_rps']:>11.2f}"
        )
    o = report["overall"]
    lines += [
        "",
        f"hand-off modes used: {_counts(o['modes'])}",
        f"planned modes:       {_counts(o['planned_modes'])}",
        f"decisions:           {_counts(o['decisions'])}",
        f"serving actions:     {_counts(o['serving_actions'])}",
        f"fallbacks taken:     {_counts(o['fallbacks'])}",
        f"rejects by reason:   {_counts(o['rejects'])}",
    ]
    if o["failures"]:
        lines.append(f"failed by cause:     {_counts(o['failures'])}")
    if report.get("faults"):
        lines.append("faults injected:     " + "; ".join(str(f) for f in report["faults"]))
    if o.get("goodput_per_dollar_hour") is not None:
        lines.append(
            f"fleet price ${report['price_per_hour_usd']:.2f}/h (assumed); goodput per $/h: "
            f"{o['goodput_per_dollar_hour']:.3f} req/s"
        )
    lines += ["", narrative(report)]
    return "\n".join(lines)


_MODE_WORDS = {
    "transfer": "prefilled on one pool and moved their KV cache to a decode pool (transfer)",
    "recompute": "were prefilled again by their decode worker, because KV in the prefill "
    "side's format could not reach it or could not arrive sooner (recompute)",
    "same_pool": "ran both stages on one worker of a pool that serves both (same pool)",
    "": "",
}


def narrative(report: Mapping[str, Any]) -> str:
    """A short "what just happened" paragraph for the end of the report, in plain words."""
    acc, o = report["accounting"], report["overall"]
    ramp = ""
    if report.get("rate_scale_end"):
        ramp = (
            f", at a rate rising from {report['rate_scale']:g} x to "
            f"{report['rate_scale_end']:g} x the trace's"
        )
    out = [
        f"What just happened: {acc['requests']} requests of the trace arrived over "
        f"{report['replay_s']:.0f} emulated seconds{ramp}; {acc['completed']} completed, "
        f"{acc['rejected']} were refused and {acc['failed']} failed."
    ]
    modes = o.get("modes") or {}
    if modes:
        parts = [
            f"{n} {_MODE_WORDS.get(m, m)}"
            for m, n in sorted(modes.items(), key=lambda kv: -kv[1])
            if m
        ]
        out.append("Of the completed ones, " + "; ".join(parts) + ".")
        if modes.get(""):
            out.append(
                f"{modes['']} completed without their route record in reach (the control"
                " plane did not answer for it): their plans are not in this report."
            )
    workers = report.get("workers") or {}
    pools = sorted({w["pool"] for w in workers.values()}) if workers else []
    used = o.get("pools") or {}
    if pools:
        busy = ", ".join(f"{p} {used[p]}" for p in sorted(used, key=lambda p: -used[p]))
        idle = [p for p in pools if p not in used]
        out.append(
            f"{len(used)} of the {len(pools)} pools served requests ({busy})"
            + (f"; idle: {', '.join(idle)}." if idle else ".")
        )
    fallbacks = o.get("fallbacks") or {}
    if fallbacks:
        out.append(
            f"{sum(fallbacks.values())} requests left their first plan for a fallback step "
            f"({_counts(fallbacks)}): a worker or link failed under them, or a pool filled."
        )
    rejects = o.get("rejects") or {}
    if rejects:
        out.append(f"Refusals by reason: {_counts(rejects)}.")
        if rejects.get("saturated"):
            out.append(
                "Saturated refusals mean the fleet was past its capacity: the scheduler"
                " refuses a request it predicts would miss its tier's TTFT target, or one no"
                " decode worker has room for (a gateway answers 429 with Retry-After)."
            )
    out.append(_admitted_words(report))
    for f in report.get("faults") or ():
        if str(f).startswith("Redis stopped") and rejects.get("no_capable_worker"):
            lease = report.get("lease_ttl_ms")
            out.append(
                f"{f}"
                + (f"; the demo's worker lease is {lease / 1000:g} s" if lease else "")
                + ", and leases run out while no heartbeat can renew them: the fleet was"
                " empty until the workers registered again, which is what the"
                " no_capable_worker refusals are."
            )
    return "\n".join(textwrap.wrap(" ".join(out), width=92))


ADMITTED_PROMISE = 0.9
"""The share of admitted requests per tier that must meet their targets for the report to
say admission kept its promise (the issue's and DistServe's 90 %)."""


def _admitted_words(report: Mapping[str, Any]) -> str:
    """Whether the admitted requests kept their tier's targets, as measured, per tier."""
    tiers = report.get("tiers") or {}
    shares = {
        name: t["admitted_attainment"]
        for name, t in sorted(tiers.items())
        if t.get("admitted_attainment") is not None
    }
    if not shares:
        return ""
    listed = ", ".join(f"{name} {share * 100:.0f} %" for name, share in shares.items())
    if all(share >= ADMITTED_PROMISE for share in shares.values()):
        return f"The requests it admitted kept their tier's targets ({listed} of them did)."
    low = [name for name, share in shares.items() if share < ADMITTED_PROMISE]
    return (
        f"The admitted requests did not all keep their targets ({listed} of them did):"
        f" {', '.join(low)} fell below {ADMITTED_PROMISE * 100:.0f} %, the fleet served"
        " slower than the scheduler predicted when it admitted them (see the TTFT"
        " percentiles above)."
    )


def write_report(report: Mapping[str, Any], records: Sequence[RequestRecord], out: Path) -> Path:
    """Write ``report.json`` (the report plus every request record) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    doc = {**report, "requests": [r.to_dict() for r in records]}
    path.write_text(json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    return path


def plot_report(records: Sequence[RequestRecord], report: Mapping[str, Any], out: Path) -> str:
    """Write ``ttft_cdf.png`` and ``modes.png``; returns what was written, or why nothing
    was (matplotlib is optional)."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return "matplotlib is not installed: no PNG plots written (pip install 'hetero-pd[plots]')"
    out.mkdir(parents=True, exist_ok=True)
    from matplotlib.ticker import NullFormatter

    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    slos = {t: g.get("slo") for t, g in report.get("tiers", {}).items()}
    for tier in sorted({r.tier for r in records}):
        xs = sorted(r.ttft_ms for r in records if r.tier == tier and r.completed)
        if not xs:
            continue
        (line,) = ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=tier)
        slo = slos.get(tier)
        if slo:  # the tier's TTFT target, in the tier's colour
            ax.axvline(
                slo["ttft_ms"], color=line.get_color(), linestyle="--", linewidth=1,
                label=f"{tier} TTFT SLO {slo['ttft_ms']:g} ms",
            )  # fmt: skip
    ax.set_xscale("log")
    done = [r.ttft_ms for r in records if r.completed and r.ttft_ms > 0]
    targets = [v["ttft_ms"] for v in slos.values() if v]
    lo, hi = (min(done + targets), max(done + targets)) if done else (1.0, 1000.0)
    ticks = [m * 10**e for e in range(-1, 7) for m in (1, 2, 5) if lo <= m * 10**e <= hi]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])  # 20, 50, 100, 200, ... ms
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("time to first token (ms, emulated; log scale)")
    ax.set_ylabel("share of the tier's completed requests")
    ax.set_title("TTFT by tier, with each tier's TTFT target (dashed)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=120)
    plt.close(fig)
    # requests per decode pool, stacked by the hand-off mode really used
    per_pool: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in records:
        if r.completed and r.decode_pool:
            per_pool[r.decode_pool][r.mode_used or "?"] += 1
    workers = report.get("workers") or {}
    decoding = {w["pool"] for w in workers.values() if w.get("stage") != "prefill"}
    pools = sorted(decoding | set(per_pool))
    modes = sorted({m for c in per_pool.values() for m in c})
    fig, ax = plt.subplots(figsize=(7.0, 3.8))
    bottom = [0] * len(pools)
    for mode in modes:
        heights = [per_pool[p][mode] for p in pools]
        ax.bar(pools, heights, bottom=bottom, label=mode)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_ylabel("completed requests")
    ax.set_xlabel("decode pool (prefill-only pools hand their KV to these)")
    ax.set_title("where requests decoded, by hand-off mode")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    if modes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "modes.png", dpi=120)
    plt.close(fig)
    return f"plots: {out / 'ttft_cdf.png'}, {out / 'modes.png'}"
