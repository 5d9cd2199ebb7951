"""deploy/grafana/hetero-pd.json: a dashboard Grafana can import, whose every query selects
metrics and labels the services really export."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import yaml

from tests.unit.deploy.promql_names import ROOT, exported, label_problems, metrics_in, recorded_in

DASHBOARD = ROOT / "deploy" / "grafana" / "hetero-pd.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every panel target and templating query."""
    doc = _dashboard()
    for panel in _panels(doc["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in doc["templating"]["list"]:
        query = var.get("query")
        if var.get("type") == "query":
            yield f"${var['name']}", query["query"] if isinstance(query, dict) else str(query)


def test_the_dashboard_is_one_grafana_can_import() -> None:
    doc = _dashboard()
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    assert any(
        v["type"] == "datasource" and v["name"] == "datasource" for v in doc["templating"]["list"]
    )
    panels = list(_panels(doc["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"{panel['title']}: no query"
        assert panel["datasource"] == DATASOURCE, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"{panel['title']}: wider than the dashboard"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_every_metric_the_dashboard_uses_is_exported() -> None:
    families = exported()
    recorded = {
        rule["record"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
    for title, expr in _queries():
        unknown = metrics_in(expr) - families.keys()
        assert not unknown, f"{title}: no service exports {sorted(unknown)}"
        assert not recorded_in(expr) - recorded, f"{title}: a series rules.yaml does not record"
        bad = label_problems(expr, families)
        assert not bad, f"{title}: labels no service exports: {bad}"


def test_the_dashboard_shows_what_an_operator_watches() -> None:
    used = set().union(*(metrics_in(expr) for _, expr in _queries()))
    assert {
        "hpd_gateway_ttft_seconds_bucket",
        "hpd_gateway_tpot_seconds_bucket",
        "hpd_scheduler_rejections_total",
        "hpd_scheduler_decisions_total",
        "hpd_scheduler_ttft_estimate_ratio_count",
        "hpd_gateway_in_flight",
        "hpd_kv_sessions_total",
        "hpd_scheduler_ttft_estimate_ratio_bucket",
        "hpd_scheduler_tpot_estimate_ratio_bucket",
        "hpd_redis_memory_used_ratio",
        "hpd_redis_up",
    } <= used
