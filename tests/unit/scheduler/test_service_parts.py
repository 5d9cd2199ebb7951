"""Pure parts of the scheduler service: closed-loop averages, record heads, views, filters,
policy parsing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpd_common.kvformat import KvDtype, KvFormat, KvLayout
from hpd_common.worker_model import LoadReport, Stage, WorkerSpec
from hpd_registry.domain import WorkerRecord, WorkerState
from hpd_scheduler.feedback import Ewma, ObservedEstimates, observation_from
from hpd_scheduler.policy import ConfigError, Health, Mode
from hpd_scheduler.policy import Stage as PStage
from hpd_scheduler.policy.decision import Estimates, FallbackStep, RoutePlan
from hpd_scheduler.policy.domain import ResourceNeed
from hpd_scheduler.record_queries import RecordQuery
from hpd_scheduler.records import as_recompute
from hpd_scheduler.settings import parse_policy, profile_document
from hpd_scheduler.views import health_of, link_model, view_of

PLAN = {
    "mode": "transfer",
    "prefill_worker_id": "p1",
    "prefill_pool_id": "pp",
    "decode_worker_id": "d1",
    "decode_pool_id": "dp",
    "prefill_tokens": 2000,
    "estimates": {"kv_bytes": 1_000_000_000, "transfer_ms": 40.0, "prefill_wait_ms": 10.0},
}


@pytest.mark.parametrize(
    ("outcome", "worker", "tps", "itl", "gbps"),
    [
        pytest.param(
            {"success": True, "ttft_ms": 150, "tpot_ms": 25, "prefill_ms": 100},
            "p1", 20_000.0, 25.0, None, id="measured-prefill",
        ),
        pytest.param(
            {"success": True, "ttft_ms": 150, "tpot_ms": 0},
            "p1", 2000 / 0.1, None, None, id="prefill-from-ttft-minus-wait-and-transfer",
        ),
        pytest.param(
            {"success": True, "ttft_ms": 100, "mode_used": "recompute", "prefill_ms": 50},
            "d1", 40_000.0, None, None, id="recompute-teaches-the-decode-worker",
        ),
        pytest.param(
            {"success": True, "transfer_ms": 80.0, "prefill_ms": 100},
            "p1", 20_000.0, None, 100.0, id="transfer-rate",
        ),
    ],
)  # fmt: skip
def test_outcomes_teach_the_right_worker(
    outcome: dict[str, object], worker: str, tps: float, itl: float | None, gbps: float | None
) -> None:
    est = ObservedEstimates(alpha=0.5)
    obs = observation_from(PLAN, outcome)
    assert obs is not None
    est.observe(obs, 1.0)
    assert est.prefill_tps[worker].value == pytest.approx(tps)
    assert (est.itl_ms["d1"].value if "d1" in est.itl_ms else None) == (
        None if itl is None else pytest.approx(itl)
    )
    got = est.link_gbps.get(("pp", "dp"))
    assert (got.value if got else None) == (None if gbps is None else pytest.approx(gbps))


def test_failed_outcome_teaches_nothing() -> None:
    assert observation_from(PLAN, {"success": False, "ttft_ms": 5}) is None


@given(st.lists(st.floats(min_value=0.1, max_value=1e6), min_size=1, max_size=30))
def test_ewma_stays_within_the_samples(xs: list[float]) -> None:
    e = Ewma()
    for x in xs:
        e.add(x, 0.2, 0.0)
    assert min(xs) - 1e-6 <= e.value <= max(xs) + 1e-6
    assert e.samples == len(xs)


def _plan() -> tuple[RoutePlan, tuple[FallbackStep, ...]]:
    est = Estimates(1000, 40.0, 90.0, 2.0, 5.0, 60.0, 105.0, 20.0)
    plan = RoutePlan(ResourceNeed.PREFILL, Mode.TRANSFER, "p1", "pp", "p1:1", "d1", "dp",
                     "d1:1", 5000, 100, est)  # fmt: skip
    chain = (
        FallbackStep(Mode.RECOMPUTE, "d1", "d1", "dp", "kv_transfer_failed", 105 + 95, 800),
        FallbackStep(Mode.TRANSFER, "p2", "d2", "dp", "next_best_pair", 130, 870),
    )
    return plan, chain


def test_broker_refusal_turns_the_plan_into_recompute() -> None:
    plan, chain = _plan()
    new, rest = as_recompute(plan, chain)
    assert new.mode is Mode.RECOMPUTE
    assert new.prefill_worker_id == new.decode_worker_id == "d1"
    assert new.estimates.transfer_ms is None
    assert new.estimates.ttft_ms == pytest.approx(95.0)  # decode wait 5 + recompute 90
    assert [f.reason for f in rest] == ["next_best_pair"]


@pytest.mark.parametrize(
    ("query", "expect"),
    [
        pytest.param(RecordQuery(), True, id="no-filter"),
        pytest.param(RecordQuery(tier="batch"), False, id="tier"),
        pytest.param(RecordQuery(worker_id="d1"), True, id="decode-worker"),
        pytest.param(RecordQuery(worker_id="p1"), True, id="prefill-worker"),
        pytest.param(RecordQuery(worker_id="zz"), False, id="other-worker"),
        pytest.param(RecordQuery(mode="recompute"), False, id="mode"),
        pytest.param(RecordQuery(decision="primary", mode="transfer"), True, id="both"),
    ],
)
def test_record_query(query: RecordQuery, expect: bool) -> None:
    head = {"tier": "standard", "decision": "primary", "model_id": "m", "plan": PLAN}
    assert query.matches(head) is expect


def _record(**state: Any) -> WorkerRecord:
    spec = WorkerSpec(
        worker_id="w1", pool_id="p", endpoint="w1:1", stages=(Stage.PREFILL, Stage.DECODE),
        model_id="llama-3-8b", model_revision="r", engine="vllm", engine_version="1",
        gpu_type="H100-SXM", gpu_count=1, tp_size=1, pp_size=1, peak_tflops=0.0,
        hbm_gbps=0.0, kv_memory_total_bytes=1000, max_batch_size=64,
        kv_format=KvFormat(KvDtype.BF16, KvLayout.PAGED_NHD, 16, 32, 8, 128, 1, "fa", "r"),
    )  # fmt: skip
    return WorkerRecord(
        spec, WorkerState(0, 0, 10**15, 1000, **state),
        LoadReport(kv_blocks_free=250, kv_blocks_total=1000, reported_at_ms=5000), 1,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("state", "health"),
    [
        pytest.param({}, Health.HEALTHY, id="healthy"),
        pytest.param({"suspect": True}, Health.SUSPECT, id="suspect"),
        pytest.param({"draining": True}, Health.DRAINING, id="draining"),
        pytest.param({"cordoned": True}, Health.CORDONED, id="cordoned"),
        pytest.param({"unhealthy": True, "draining": True}, Health.UNHEALTHY, id="precedence"),
    ],
)
def test_health_comes_from_the_registry_flags(state: dict[str, Any], health: Health) -> None:
    assert health_of(_record(**state)) is health


def test_view_free_memory_and_observed_figures() -> None:
    est = ObservedEstimates()
    est.prefill_tps.setdefault("w1", Ewma()).add(9000.0, 0.2, 7.0)
    v = view_of(_record(), est)
    assert v.stage is PStage.BOTH
    assert v.kv_available_bytes == 250
    assert v.load is not None and v.load.reported_at_s == 5.0
    assert v.load.prefill_tokens_per_s == 9000.0  # the report had none


def test_link_model_takes_observed_rates() -> None:
    e = Ewma()
    e.add(12.5, 0.2, 0.0)
    lm = link_model({("a", "b"): e})
    assert lm.pool_overrides[("a", "b")].gbps == 12.5


@pytest.mark.parametrize(
    ("tiers", "key"),
    [
        pytest.param("tiers: {classes: {x: {ttft_ms: -1, tpot_ms: 1, queue_budget_ms: 1}}}",
                     "tiers.classes.x.ttft_ms", id="bad-tier"),
        pytest.param("- 1\n", "tiers", id="not-a-mapping"),
    ],
)  # fmt: skip
def test_tiers_file_is_validated_with_the_key_named(tiers: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_policy(profile_document("default"), tiers)
    assert err.value.key_path == key


def test_tiers_file_replaces_the_profiles_tiers() -> None:
    tiers = "default: gold\nclasses: {gold: {ttft_ms: 500, tpot_ms: 40, queue_budget_ms: 100}}"
    profile, _ = parse_policy(profile_document("default"), tiers)
    assert set(profile.tiers) == {"gold"} and profile.default_tier == "gold"
