"""The SLO objective: decode admission wait, whole-path TTFT and projected TPOT decide the
pair before the weighted factors do; the baselines do not use it."""

from __future__ import annotations

import random

import pytest
import yaml

from hpd_scheduler.policy import (
    ConfigError,
    Fleet,
    Mode,
    Planner,
    Stage,
    builtin_profile,
    builtin_profile_names,
    parse_profile,
)
from hpd_scheduler.policy.config import SloObjective

from .builders import GIB, NOW, request, worker

DEFAULT = builtin_profile("default")


def _state(**kw: object) -> object:
    fleet = Fleet.build([worker("d", gpu="A100-80G", **kw)], NOW)  # type: ignore[arg-type]
    ws = fleet.worker("d")
    assert ws is not None
    return ws


@pytest.mark.parametrize(
    ("batch", "queue", "kv_free_gib", "need_gib", "expect"),
    [
        pytest.param(10, 0, 30.0, 1.0, "zero", id="room-in-batch-and-memory"),
        pytest.param(255, 0, 30.0, 1.0, "zero", id="last-slot-free"),
        pytest.param(256, 0, 30.0, 1.0, "positive", id="batch-full"),
        pytest.param(200, 60, 30.0, 1.0, "positive", id="queue-ahead-fills-batch"),
        pytest.param(10, 0, 0.5, 1.0, "positive", id="memory-short"),
    ],
)
def test_admission_wait(
    batch: int, queue: int, kv_free_gib: float, need_gib: float, expect: str
) -> None:
    ws = _state(batch=batch, queue=queue, kv_free_gib=kv_free_gib)
    wait = ws.admission_wait_ms(int(need_gib * GIB), 200.0)  # type: ignore[attr-defined]
    if expect == "zero":
        assert wait == 0.0
    else:
        assert wait > 0.0


def test_admission_wait_formula_for_a_full_batch() -> None:
    # deficit 256 + 0 + 1 - 256 = 1 slot; 256 running, each living 200 steps: 200/256 steps
    ws = _state(batch=256, queue=0)
    wait = ws.admission_wait_ms(GIB, 200.0)  # type: ignore[attr-defined]
    assert wait == pytest.approx(200.0 / 256.0 * ws.step_ms())  # type: ignore[attr-defined]


def test_admission_wait_grows_with_the_queue_ahead() -> None:
    short = _state(batch=256, queue=2).admission_wait_ms(GIB, 200.0)  # type: ignore[attr-defined]
    long = _state(batch=256, queue=40).admission_wait_ms(GIB, 200.0)  # type: ignore[attr-defined]
    assert long > short > 0.0


def _two_decoders(profile_doc: dict[str, object] | None = None) -> tuple[str, list[float]]:
    """One prefill worker; an A100 decoder whose batch is full (admission wait) and an idle
    L40S decoder. Returns the chosen decode worker and the options' TTFT estimates."""
    views = [
        worker("p", Stage.PREFILL, gpu="H100-SXM", rack="r1"),
        worker("a100", Stage.DECODE, gpu="A100-80G", batch=256, queue=20, rack="r1"),
        worker("l40s", Stage.DECODE, gpu="L40S", batch=0, rack="r1"),
    ]
    prof = DEFAULT if profile_doc is None else parse_profile(profile_doc)
    fleet = Fleet.build(views, NOW)
    d = Planner(prof).plan(request(1000, 400, "interactive"), fleet, NOW, random.Random(0))
    assert d.plan is not None and d.record is not None
    return d.plan.decode_worker_id, [o.ttft_ms for o in d.record.options]


def test_full_batch_sends_the_request_to_the_worker_that_can_admit_it() -> None:
    chosen, _ = _two_decoders()
    assert chosen == "l40s"


def test_admission_wait_is_in_the_ttft_estimate() -> None:
    views = [
        worker("p", Stage.PREFILL, gpu="H100-SXM", rack="r1"),
        worker("a100", Stage.DECODE, gpu="A100-80G", batch=256, queue=20, rack="r1"),
    ]
    req = request(1000, 400, "interactive")
    with_slo = Planner(DEFAULT).plan(req, Fleet.build(views, NOW), NOW, random.Random(0))
    doc = yaml.safe_load(_default_text())
    del doc["slo_objective"]
    without = Planner(parse_profile(doc)).plan(req, Fleet.build(views, NOW), NOW, random.Random(0))
    assert with_slo.plan is not None and without.plan is not None
    assert with_slo.plan.mode is Mode.TRANSFER
    assert with_slo.plan.estimates.ttft_ms > without.plan.estimates.ttft_ms + 100.0


def test_decoder_over_its_tpot_limit_loses_to_one_within_it() -> None:
    # the L40S sits at the seed's ideal batch (70 % of max) with plenty of free KV, so the
    # weighted factors prefer it; its projected step exceeds 0.9 x the interactive 50 ms
    views = [
        worker("p", Stage.PREFILL, gpu="H100-SXM", rack="r1"),
        worker("a100", Stage.DECODE, gpu="A100-80G", kv_total_gib=40.0, kv_free_gib=1.0),
        worker("l40s", Stage.DECODE, gpu="L40S", batch=179, kv_total_gib=28.0, kv_free_gib=16.0),
    ]
    req = request(1000, 200, "interactive")
    doc = yaml.safe_load(_default_text())
    del doc["slo_objective"]
    plain = Planner(parse_profile(doc)).plan(req, Fleet.build(views, NOW), NOW, random.Random(0))
    ours = Planner(DEFAULT).plan(req, Fleet.build(views, NOW), NOW, random.Random(0))
    assert plain.plan is not None and ours.plan is not None and ours.record is not None
    assert plain.plan.decode_worker_id == "l40s"
    assert ours.plan.decode_worker_id == "a100"
    l40s = [o for o in ours.record.options if o.d.ws.worker_id == "l40s"]
    assert l40s and all(o.d.step_ms > 45.0 for o in l40s)


def _default_text() -> str:
    from importlib import resources

    return (
        resources.files("hpd_scheduler.policy")
        .joinpath("profiles/default.yaml")
        .read_text(encoding="utf-8")
    )


def test_default_profile_carries_the_objective_and_baselines_do_not() -> None:
    assert DEFAULT.slo_objective == SloObjective(0.7, 0.9, 0.5)
    for name in builtin_profile_names():
        if name != "default":
            assert builtin_profile(name).slo_objective is None, name


@pytest.mark.parametrize(
    ("block", "key"),
    [
        pytest.param({"ttft_fraction": 0}, "slo_objective.ttft_fraction", id="zero-fraction"),
        pytest.param({"tpot_fraction": "x"}, "slo_objective.tpot_fraction", id="not-a-number"),
        pytest.param({"slack_weight": 1.5}, "slo_objective.slack_weight", id="slack-above-1"),
        pytest.param({"margin": 0.5}, "slo_objective.margin", id="unknown-key"),
    ],
)
def test_bad_slo_objective_names_the_key(block: dict[str, object], key: str) -> None:
    doc = yaml.safe_load(_default_text())
    doc["slo_objective"] = block
    with pytest.raises(ConfigError) as info:
        parse_profile(doc)
    assert key in str(info.value)


def test_scores_stay_in_unit_interval() -> None:
    _, ttfts = _two_decoders()
    views = [
        worker("p", Stage.PREFILL, gpu="H100-SXM", queue=30, rack="r1"),
        worker("a100", Stage.DECODE, gpu="A100-80G", batch=256, queue=20, rack="r1"),
        worker("l40s", Stage.DECODE, gpu="L40S", batch=120, rack="r1"),
    ]
    d = Planner(DEFAULT).plan(
        request(4000, 400, "interactive"), Fleet.build(views, NOW), NOW, random.Random(0)
    )
    assert d.record is not None
    assert all(0.0 <= o.score <= 1.0 for o in d.record.options)
    assert all(t >= 0.0 for t in ttfts)
