"""The stage after pairing as plugins (``admission.py``): option filters named in the
profile, applied in order, each refusing with its own reason when it keeps no option."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from hpd_scheduler.policy import (
    REGISTRY,
    ConfigError,
    Fleet,
    Planner,
    Stage,
    WorkerView,
    builtin_profile,
    parse_profile,
)
from hpd_scheduler.policy.admission import (
    AdmissionLimitFilter,
    HardTtftFilter,
    LimitParams,
    TpotAdmissionFilter,
    TtftAdmissionFilter,
    default_option_filters,
)
from hpd_scheduler.policy.framework import Option, OptionFilter, PluginRegistry, RequestContext

from .builders import NOW, ctx_for, request, worker

DEFAULT = builtin_profile("default")
ROOT = Path(__file__).resolve().parents[3]


def _doc() -> dict[str, Any]:
    res = resources.files("hpd_scheduler.policy") / "profiles" / "default.yaml"
    doc = yaml.safe_load(res.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def _held_up(busy: float) -> list[WorkerView]:
    """The only decode worker's batch is predicted past the interactive TPOT target while
    its engine prefills ``busy`` of the time (test_slo_objective's case)."""
    return [
        worker("p", Stage.PREFILL, gpu="H100-SXM", rack="r1"),
        worker("d", Stage.DECODE, gpu="L40S", batch=60, prefill_busy=busy),
    ]


def test_the_default_profile_runs_the_built_in_filters_in_order() -> None:
    planner = Planner(DEFAULT)
    kinds = [type(f) for f in planner.option_filters]
    assert kinds == [HardTtftFilter, TtftAdmissionFilter, TpotAdmissionFilter]
    slo = DEFAULT.slo_objective
    assert slo is not None
    assert planner.option_filters[1].params.factor == slo.admit_ttft_factor
    assert planner.option_filters[2].params.factor == slo.admit_tpot_factor
    assert [type(f) for f in default_option_filters(None)] == [HardTtftFilter]


def test_listed_filters_replace_the_built_in_ones() -> None:
    """A profile naming its option filters gets exactly those: without the TPOT admission
    the held-up worker is planned; with it listed (factor 1, as the default) refused."""
    req = request(1000, 200, "interactive")
    fleet = Fleet.build(_held_up(0.8), NOW)
    doc = _doc()
    doc["plugins"].append({"name": "hard", "type": "hard-ttft-filter"})
    doc["option_filters"] = ["hard"]
    lenient = Planner(parse_profile(doc))
    assert [type(f) for f in lenient.option_filters] == [HardTtftFilter]
    assert lenient.plan(req, fleet, NOW, random.Random(0)).plan is not None
    doc["plugins"].append(
        {"name": "tpot", "type": "tpot-admission-filter", "params": {"factor": 1.0}}
    )
    doc["option_filters"] = ["hard", "tpot"]
    strict = Planner(parse_profile(doc)).plan(req, fleet, NOW, random.Random(0))
    assert strict.plan is None and strict.reject_reasons == ("tpot_over_admission_limit",)
    assert any(n.startswith("all_options_exceed_admission_tpot_ms:") for n in strict.record.notes)
    doc["option_filters"] = []  # none at all: every option passes
    assert Planner(parse_profile(doc)).option_filters == ()


def test_the_built_in_filters_decide_as_the_listed_equivalents() -> None:
    """The default profile, and the same profile listing its filters explicitly, plan alike
    over a range of loads (the stage moved, the decisions did not)."""
    doc = _doc()
    slo = doc["slo_objective"]
    doc["plugins"] += [
        {"name": "hard", "type": "hard-ttft-filter"},
        {"name": "ttft", "type": "ttft-admission-filter",
         "params": {"factor": slo["admit_ttft_factor"]}},
        {"name": "tpot", "type": "tpot-admission-filter",
         "params": {"factor": slo["admit_tpot_factor"]}},
    ]  # fmt: skip
    doc["option_filters"] = ["hard", "ttft", "tpot"]
    listed = Planner(parse_profile(doc))
    built_in = Planner(DEFAULT)
    for busy in (0.0, 0.5, 0.8, 0.95):
        for prompt, out, tier in ((1000, 200, "interactive"), (30000, 50, "standard")):
            fleet = Fleet.build(_held_up(busy), NOW)
            req = request(prompt, out, tier)
            a = built_in.plan(req, fleet, NOW, random.Random(1))
            b = listed.plan(req, fleet, NOW, random.Random(1))
            assert (a.plan, a.reject_reasons, a.retry_after_ms) == (
                b.plan,
                b.reject_reasons,
                b.retry_after_ms,
            )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["nope"], "no plugin instance named 'nope'"),
        (["gate"], "is a filter, not a filter of options"),
        ("hard", "must be a list"),
    ],
)
def test_a_bad_option_filter_list_names_the_key(value: Any, message: str) -> None:
    doc = _doc()
    doc["plugins"].append({"name": "hard", "type": "hard-ttft-filter"})
    gate = next(p["name"] for p in doc["plugins"] if p["type"] == "execution-gate-filter")
    if isinstance(value, list):
        value = [gate if v == "gate" else v for v in value]
    doc["option_filters"] = value
    with pytest.raises(ConfigError) as info:
        parse_profile(doc)
    assert "option_filters" in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    ("cls", "factor", "tier", "limit"),
    [
        (TtftAdmissionFilter, 1.0, "interactive", "ttft_ms"),
        (TtftAdmissionFilter, 2.5, "batch", "ttft_ms"),
        (TtftAdmissionFilter, 0.0, "standard", None),
        (TpotAdmissionFilter, 1.0, "interactive", "tpot_ms"),
        (TpotAdmissionFilter, 0.5, "standard", "tpot_ms"),
        (TpotAdmissionFilter, 0.0, "batch", None),
    ],
    ids=["ttft-1", "ttft-2.5", "ttft-off", "tpot-1", "tpot-0.5", "tpot-off"],
)
def test_an_admission_limit_is_factor_times_the_tiers_target(
    cls: type[AdmissionLimitFilter], factor: float, tier: str, limit: str | None
) -> None:
    """``L = factor x`` the tier's TTFT or TPOT target; factor 0: the filter is off (None)."""
    ctx = ctx_for(Fleet.build([worker("d")], NOW), tier=tier)
    expected = None if limit is None else getattr(DEFAULT.tier(tier), limit) * factor
    assert cls("f", LimitParams(factor)).bound(ctx) == expected


@pytest.mark.parametrize("factor", [-0.5, 4.5])
def test_an_admission_factor_out_of_range_is_refused(factor: float) -> None:
    doc = _doc()
    doc["plugins"].append(
        {"name": "ttft", "type": "ttft-admission-filter", "params": {"factor": factor}}
    )
    with pytest.raises(ConfigError):
        parse_profile(doc)


def newcomers_filter_refuses() -> None:
    """A filter of one's own (here: refuse any plan whose prefill waits at all) plugs into a
    registry and a profile without touching the planner."""

    class QueueWaitCap(OptionFilter):
        type_name: ClassVar[str] = "queue-wait-cap"
        note: ClassVar[str] = "queue_wait_ms"
        reject_reason: ClassVar[str] = "queue_wait_over_cap"

        def bound(self, ctx: RequestContext) -> float | None:
            return 0.0

        def keep(self, options: list[Option], ctx: RequestContext, bound: float) -> list[Option]:
            return [o for o in options if o.p.wait_ms <= bound]

    registry = PluginRegistry()
    for name in REGISTRY.names():
        registry.register(REGISTRY.get(name, "t"))
    registry.register(QueueWaitCap)
    doc = _doc()
    doc["plugins"].append({"name": "cap", "type": "queue-wait-cap"})
    doc["option_filters"] = ["cap"]
    prof = parse_profile(doc, registry=registry)
    busy = [worker("p", Stage.PREFILL, queue=40, rack="r1"), worker("d", Stage.DECODE, queue=40)]
    d = Planner(prof).plan(request(4000, 50), Fleet.build(busy, NOW), NOW, random.Random(0))
    assert d.plan is None and d.reject_reasons == ("queue_wait_over_cap",), d


def test_a_newcomers_option_filter_is_a_plugin_like_the_others() -> None:
    """Run on the pure-Python core (``HPD_NATIVE=0``, as an install without the compiled
    core runs): a compiled base class takes no interpreted subclass instance, so a plugin of
    one's own is either run so or compiled with the core (``hpd_common.native.MODULES``)."""
    code = "from tests.unit.policy.test_option_filters import newcomers_filter_refuses as f; f()"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT, env={**os.environ, "HPD_NATIVE": "0"},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
