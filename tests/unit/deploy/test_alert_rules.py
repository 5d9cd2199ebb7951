"""deploy/prometheus: the alert rules are valid and pass their unit tests under promtool
(Prometheus's own checker), every alert has its runbook entry and every entry its alert,
and every metric and label the rules name is one the services export."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import yaml

from tests.unit.deploy.promql_names import (
    ROOT,
    exported,
    label_problems,
    metrics_in,
    promtool,
    recorded_in,
)

RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
SEVERITIES = {"critical", "warning"}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _runbook_entries() -> list[str]:
    """The runbook's alert entries: its level-3 headings."""
    return re.findall(r"^### (.+?)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)


def _promtool(*args: str) -> None:
    done = subprocess.run(
        [promtool(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def test_promtool_checks_the_rules() -> None:
    _promtool("check", "rules", str(RULES.relative_to(ROOT)))


def test_promtool_runs_the_rules_unit_tests() -> None:
    _promtool("test", "rules", str(RULES_TEST.relative_to(ROOT)))


def test_every_alert_is_complete() -> None:
    names = [a["alert"] for a in _alerts()]
    assert len(names) == len(set(names)), "alert names must be unique"
    for alert in _alerts():
        name = alert["alert"]
        assert re.fullmatch(r"\d+[smh]", str(alert.get("for", ""))), f"{name}: no for:"
        assert alert.get("labels", {}).get("severity") in SEVERITIES, name
        notes = alert.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            assert str(notes.get(key, "")).strip(), f"{name}: no {key}"


def test_every_alert_says_why_its_threshold() -> None:
    """A comment block starting ``# Why:`` right above each ``- alert:``."""
    lines = RULES.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("- alert:"):
            continue
        j = i - 1
        while j >= 0 and lines[j].lstrip().startswith("#"):
            j -= 1
        block = [ln.strip() for ln in lines[j + 1 : i]]
        assert block and block[0].startswith("# Why:"), f"no '# Why:' comment above {line}"


def test_every_alert_points_at_its_runbook_entry() -> None:
    anchors = {_slug(h) for h in _runbook_entries()}
    for alert in _alerts():
        url = alert["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/runbook.md", f"{alert['alert']}: {url}"
        assert anchor == _slug(alert["alert"]), f"{alert['alert']}: {url} is not its own entry"
        assert anchor in anchors, f"{alert['alert']}: docs/runbook.md has no heading #{anchor}"


def test_every_runbook_entry_has_an_alert() -> None:
    names = {a["alert"] for a in _alerts()}
    entries = _runbook_entries()
    assert len(entries) == len(set(entries)), "a runbook entry appears twice"
    assert not set(entries) - names, "runbook entries without an alert"


def test_every_metric_the_rules_use_is_exported() -> None:
    families = exported()
    for rule in _rules():
        what = rule.get("alert") or rule.get("record")
        unknown = metrics_in(rule["expr"]) - families.keys()
        assert not unknown, f"{what}: no service exports {sorted(unknown)}"
        bad = label_problems(rule["expr"], families)
        assert not bad, f"{what}: labels no service exports: {bad}"


def test_every_recorded_series_used_is_recorded() -> None:
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    for rule in _rules():
        missing = recorded_in(rule["expr"]) - recorded
        assert not missing, f"{rule.get('alert') or rule.get('record')}: {sorted(missing)}"


def test_the_unit_tests_fire_every_alert_and_hold_some_back() -> None:
    cases = [
        case
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = [c["alertname"] for c in cases if not c.get("exp_alerts")]
    assert not {a["alert"] for a in _alerts()} - fired, "alerts never seen firing"
    assert len(quiet) >= 5, "too few cases below a threshold"


def test_the_name_reader_knows_the_services_metrics() -> None:
    """The checks above are only as good as this reader: it finds declared metrics of every
    kind with their suffixes and labels, and nothing made up."""
    families = exported()
    assert {
        "hpd_gateway_requests_total",
        "hpd_scheduler_rejections_total",
        "hpd_redis_memory_used_ratio",
        "hpd_gateway_ttft_seconds_bucket",
        "hpd_agent_engine_up",
        "hpd_kv_sessions_open",
    } <= families.keys()
    assert "hpd_gateway_ttft_seconds" not in families  # a histogram has no bare series
    assert "hpd_scheduler_rejections" not in families
    assert families["hpd_kv_sessions_total"].labels == {"state"}
    # a collector's family, figured at scrape time (hpd_scheduler.metrics.PoolGauges)
    assert families["hpd_scheduler_pool_workers"].labels == {"model", "pool", "health"}
    assert families["hpd_scheduler_pool_queue_depth"].kind == "Gauge"
    assert metrics_in('sum(rate(hpd_x_total{a="hpd_y"}[5m])) / hpd:z:ratio') == {"hpd_x_total"}
    assert label_problems('sum by (rack) (hpd_agent_engine_up{rack="a"})', families) == [
        "hpd_agent_engine_up{rack}",
        "by/on (rack)",
    ]
