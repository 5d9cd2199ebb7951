"""What the deploy files may name: the metrics the services declare, and the metric and
label names a PromQL expression uses.

The services' metrics are read from their sources (``Counter(``, ``Gauge(``,
``Histogram(``, ``Summary(`` calls whose name starts ``hpd_``, and the ``GaugeMetricFamily(``
and like calls of a collector that figures its series at scrape time, labels given as
``labels=``), with what prometheus_client adds to each name on ``/metrics``: ``_total``
and ``_created`` for a counter, ``_bucket``, ``_sum``, ``_count`` and ``_created`` for a
histogram, ``_sum``, ``_count`` and ``_created`` for a summary. The emulated fleet and the
simulator (``services/tools``) are not scraped in a deployment and are left out.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVICES = ("agent", "common", "gateway", "kvbroker", "registry", "scheduler")
TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus itself puts on every scraped series."""

_SUFFIXES = {
    "Counter": ("_total", "_created"),
    "Gauge": ("",),
    "Histogram": ("_bucket", "_sum", "_count", "_created"),
    "Summary": ("", "_sum", "_count", "_created"),
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_METRIC = re.compile(r"(?<![\w:])hpd_\w+")
_RECORDED = re.compile(r"(?<![\w:])hpd:[\w:]+")
_SELECTOR = re.compile(r"(?<![\w:])(hpd_\w+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*(hpd_\w+)[^,]*,\s*(\w+)\s*\)")


@dataclass(frozen=True, slots=True)
class Family:
    """One declared metric: its series names on /metrics and the labels they carry."""

    declared: str
    kind: str
    series: frozenset[str]
    labels: frozenset[str]


def _callee(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def _strings(node: ast.expr | None) -> list[str]:
    if isinstance(node, ast.List | ast.Tuple):
        return [
            e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
        ]
    return []


def _family(call: ast.Call) -> Family | None:
    callee = _callee(call.func)
    kind = callee.removesuffix("MetricFamily")
    if kind not in _SUFFIXES or not call.args:
        return None
    first = call.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    name = first.value
    if not name.startswith("hpd_"):
        return None
    collected = callee != kind  # a family a collector yields: ``labels=`` only
    given = call.args[2] if len(call.args) > 2 and not collected else None
    for kw in call.keywords:
        if kw.arg == ("labels" if collected else "labelnames"):
            given = kw.value
    labels = set(_strings(given))
    if kind == "Counter":
        name = name.removesuffix("_total")
    if kind == "Histogram":
        labels.add("le")
    if kind == "Summary":
        labels.add("quantile")
    series = frozenset(name + suffix for suffix in _SUFFIXES[kind])
    return Family(first.value, kind, series, frozenset(labels))


def exported() -> dict[str, Family]:
    """Every series name the services export -> its family."""
    out: dict[str, Family] = {}
    for service in SERVICES:
        for path in sorted((ROOT / "services" / service).rglob("*.py")):
            if "hetero_pd" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and (family := _family(node)) is not None:
                    out.update(dict.fromkeys(family.series, family))
    return out


def metrics_in(expr: str) -> set[str]:
    """The ``hpd_`` metric names an expression selects (not inside label values)."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def recorded_in(expr: str) -> set[str]:
    """The recorded series (``hpd:...``) an expression uses."""
    return set(_RECORDED.findall(_STRING.sub('""', expr)))


def label_problems(expr: str, families: dict[str, Family]) -> list[str]:
    """Labels an expression matches on, groups by or lists that no metric it could mean
    carries: a selector's labels against that metric's, every grouping label against all
    the services' labels."""
    text = _STRING.sub('""', expr)
    problems = []
    for name, body in _SELECTOR.findall(text):
        family = families.get(name)
        allowed = (family.labels if family else frozenset()) | TARGET_LABELS
        problems += [
            f"{name}{{{label}}}" for label in _MATCHER.findall(body) if label not in allowed
        ]
    for name, label in _LABEL_VALUES.findall(text):
        family = families.get(name)
        if family is None or label not in family.labels | TARGET_LABELS:
            problems.append(f"label_values({name}, {label})")
    every = set(TARGET_LABELS).union(*(f.labels for f in families.values()))
    for body in _GROUPING.findall(text):
        problems += [f"by/on ({label})" for label in re.findall(r"\w+", body) if label not in every]
    return problems


def promtool() -> str:
    """The promtool binary (``.venv/bin`` first, then PATH). Missing: a failure under CI,
    else the test is skipped with the way to get it."""
    for candidate in (
        ROOT / ".venv" / "bin" / "promtool",
        Path(sys.executable).parent / "promtool",
    ):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("promtool")
    if found:
        return found
    hint = "promtool not found in .venv/bin or on PATH (scripts/get-promtool.sh puts it there)"
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"{hint}; CI must run the alert rule checks")
    pytest.skip(hint)
