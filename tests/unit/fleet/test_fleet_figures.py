"""The head-to-head's headline: taken at the rate where the better of the two peaks, against
the router policy whose own peak is highest."""

from __future__ import annotations

from hpd_fleet.fleet_figures import error_figures, headline


def row(arm: str, rate: float, goodput: float) -> dict[str, object]:
    return {"arm": arm, "rate_rps": rate, "goodput_rps": goodput}


def test_the_ratio_is_taken_where_the_better_arm_peaks() -> None:
    points = [
        row("hetero-pd", 10, 9.0), row("vllm-router:a", 10, 8.0), row("vllm-router:b", 10, 7.0),
        row("hetero-pd", 20, 12.0), row("vllm-router:a", 20, 15.0), row("vllm-router:b", 20, 9.0),
        row("hetero-pd", 40, 14.0), row("vllm-router:a", 40, 1.0), row("vllm-router:b", 40, 2.0),
    ]  # fmt: skip
    got = headline(points)
    assert got["best_router_policy"] == "a" and got["at_rate_rps"] == 20
    assert got["goodput_vs_vllm_router_best"] == 0.8
    points.append(row("hetero-pd", 80, 16.0))  # ours rises past the router's peak
    assert headline(points)["at_rate_rps"] == 80


def test_no_router_point_has_no_headline() -> None:
    assert headline([row("hetero-pd", 10, 9.0)]) == {"goodput_vs_vllm_router_best": None}


def test_estimate_error_splits_by_predicted_queue() -> None:
    figs = error_figures([("a", 1.5, False), ("b", 0.5, True), ("c", 1.0, True), ("d", 1.2, True)])
    assert figs["all"]["requests"] == 4 and figs["all"]["p50"] == 0.5
    assert figs["queue_predicted"]["median_ratio"] == 1.0
    assert figs["no_queue_predicted"]["p90"] == 0.5
