"""What a head-to-head on a real fleet says: the headline ratio over the rates run, the
cost model's estimate error, percentiles. Pure functions over the benchmark's points
(``bench/real_fleet.py``), kept apart so other runs of a fleet can report the same way."""

from __future__ import annotations

from typing import Any

__all__ = ["error_figures", "headline", "ms", "pct"]


def pct(values: list[float], q: float) -> float | None:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))] if v else None


def ms(values: list[float], q: float) -> float | None:
    v = pct(values, q)
    return None if v is None else round(v * 1000, 1)


def error_figures(ratios: list[tuple[str, float, bool]]) -> dict[str, Any]:
    """``|actual / predicted - 1|`` p50 and p90, the median ratio (its bias: > 1 is late),
    for all and split by whether a queue was predicted."""

    def fig(xs: list[float]) -> dict[str, Any]:
        err = [abs(x - 1.0) for x in xs]
        return {
            "requests": len(xs),
            "p50": None if not xs else round(pct(err, 0.5) or 0.0, 3),
            "p90": None if not xs else round(pct(err, 0.9) or 0.0, 3),
            "median_ratio": None if not xs else round(pct(xs, 0.5) or 0.0, 3),
        }

    return {
        "all": fig([r for _, r, _ in ratios]),
        "no_queue_predicted": fig([r for _, r, q in ratios if not q]),
        "queue_predicted": fig([r for _, r, q in ratios if q]),
    }


def headline(points: list[dict[str, Any]]) -> dict[str, Any]:
    """``goodput_vs_vllm_router_best``: ours over the best router policy's goodput (the policy
    whose peak over the rates is highest), at the rate where the better of the two peaks;
    with how it was found. ``points``: rows with ``arm`` (``hetero-pd`` or
    ``vllm-router:<policy>``), ``rate_rps`` and ``goodput_rps``."""
    by_arm: dict[str, dict[float, float]] = {}
    for pt in points:
        by_arm.setdefault(pt["arm"], {})[pt["rate_rps"]] = pt["goodput_rps"]
    ours = by_arm.pop("hetero-pd", {})
    if not ours or not by_arm:
        return {"goodput_vs_vllm_router_best": None}
    best = max(by_arm, key=lambda a: max(by_arm[a].values()))
    theirs = by_arm[best]
    rate = max(ours, key=lambda r: max(ours[r], theirs.get(r, 0.0)))
    ratio = ours[rate] / theirs[rate] if theirs.get(rate) else float("inf")
    return {
        "goodput_vs_vllm_router_best": round(ratio, 3),
        "best_router_policy": best.removeprefix("vllm-router:"),
        "at_rate_rps": rate,
        "peak_goodput_rps": {
            "hetero-pd": max(ours.values()),
            **{a: max(v.values()) for a, v in by_arm.items()},
        },
    }
