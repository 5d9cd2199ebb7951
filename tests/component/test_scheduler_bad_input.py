"""Bad input over every Schedule field (INVALID_ARGUMENT naming the field, nothing
written), and random messages to every RPC: never INTERNAL or UNKNOWN."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetero_pd.v1 import scheduler_pb2 as s
from tests.support.scheduler import (
    SchedulerHandle,
    hetero_fleet,
    sched,
    status_of,
)
from tests.support.scheduler import scheduler as scheduler

GOOD: dict[str, Any] = {
    "request_id": "bad-1",
    "model_id": "llama-3-8b",
    "prompt_tokens": 1000,
    "expected_output_tokens": 100,
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        pytest.param({"request_id": ""}, "request_id", id="request_id-empty"),
        pytest.param({"request_id": "a b"}, "request_id", id="request_id-space"),
        pytest.param({"request_id": "x" * 129}, "request_id", id="request_id-too-long"),
        pytest.param({"model_id": ""}, "model_id", id="model_id-empty"),
        pytest.param({"model_id": "m" * 129}, "model_id", id="model_id-too-long"),
        pytest.param({"model_id": "llama\n"}, "model_id", id="model_id-control-char"),
        pytest.param({"prompt_tokens": 0}, "prompt_tokens", id="prompt_tokens-zero"),
        pytest.param({"prompt_tokens": 10_000_001}, "prompt_tokens", id="prompt_tokens-huge"),
        pytest.param(
            {"expected_output_tokens": 10_000_001},
            "expected_output_tokens",
            id="expected_output_tokens-huge",
        ),
        pytest.param({"tier": "platinum"}, "tier", id="tier-unknown"),
        pytest.param({"tier": "t" * 65}, "tier", id="tier-too-long"),
        pytest.param({"prefix_hints": ["w"] * 65}, "prefix_hints", id="prefix_hints-too-many"),
        pytest.param({"prefix_hints": [""]}, "prefix_hints[0]", id="prefix_hints-empty"),
        pytest.param({"prefix_hints": ["h" * 129]}, "prefix_hints[0]", id="prefix_hints-long"),
        pytest.param({"model_revision": "r" * 129}, "model_revision", id="model_revision-long"),
        pytest.param({"preferred_pool": "p" * 129}, "preferred_pool", id="preferred_pool-long"),
    ],
)
async def test_bad_schedule_field_is_named_and_nothing_is_written(
    scheduler: SchedulerHandle, change: dict[str, Any], field: str
) -> None:
    await hetero_fleet(scheduler)
    req = s.ScheduleRequest(**{**GOOD, **change})
    code, exc = await status_of(scheduler.stub.Schedule(req, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    trailers = {k: v for k, v in (exc.trailing_metadata() or ())}
    assert trailers["hpd-field"] == field
    svc = scheduler.service
    if svc is not None:
        assert await svc.store.reservation_count() == 0
        assert await svc.store.index_page(None, 0, 10) == []


NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
text = st.text(max_size=40)
ms = st.floats(allow_nan=True, allow_infinity=True, width=64)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
mode = st.integers(min_value=0, max_value=7)

MESSAGES = st.one_of(
    st.builds(
        lambda *a: ("Schedule", s.ScheduleRequest(
            request_id=a[0], model_id=a[1], prompt_tokens=a[2], expected_output_tokens=a[3],
            tier=a[4], prefix_hints=a[5], model_revision=a[6], preferred_pool=a[7])),
        st.one_of(text, st.just("hyp-1")), st.one_of(text, st.just("llama-3-8b")), u32, u32,
        st.one_of(text, st.sampled_from(["", "batch", "interactive"])),
        st.lists(text, max_size=3), text, text,
    ),
    st.builds(
        lambda *a: ("ReportOutcome", s.ReportOutcomeRequest(
            request_id=a[0], success=a[1], error_class=a[2], ttft_ms=a[3], tpot_ms=a[4],
            mode_used=a[5], prefill_ms=a[6], transfer_ms=a[7], output_tokens=a[8])),
        st.one_of(text, st.just("hyp-1")), st.booleans(), text, ms, ms, mode, ms, ms, u32,
    ),
    st.builds(lambda a: ("GetRouteRecord", s.GetRouteRecordRequest(request_id=a)), text),
    st.builds(
        lambda *a: ("ListRouteRecords", s.ListRouteRecordsRequest(
            since_unix_ms=a[0], until_unix_ms=a[1], tier=a[2], worker_id=a[3], decision=a[4],
            mode=a[5], page_size=a[6], page_token=a[7])),
        st.integers(-(2**40), 2**40), st.integers(-(2**40), 2**40), text, text, mode, mode,
        st.integers(0, 5000), text,
    ),
    st.builds(lambda: ("GetPolicy", s.GetPolicyRequest())),
    st.builds(
        lambda a, b, c: ("ReloadPolicy", s.ReloadPolicyRequest(
            builtin_profile=a, dry_run=True) if b else s.ReloadPolicyRequest(
            profile_yaml=c, dry_run=True)),
        text, st.booleans(),
        st.one_of(text, st.sampled_from(["profile: x\n", "[1, 2]\n", "a: {b: c}\n", ":\n-"])),
    ),
    st.builds(lambda a: ("GetRecommendations", s.GetRecommendationsRequest(model_id=a)), text),
)  # fmt: skip


async def test_random_messages_never_internal(scheduler: SchedulerHandle) -> None:
    await hetero_fleet(scheduler)
    seen: list[tuple[str, Any]] = []

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(MESSAGES)
    def run(item: tuple[str, Any]) -> None:
        seen.append(item)

    run()
    for name, msg in seen:
        code, exc = await status_of(getattr(scheduler.stub, name)(msg, timeout=5))
        assert code not in NEVER, (name, msg, exc)
    # still serving
    ok = await scheduler.stub.Schedule(sched("after-fuzz"), timeout=5)
    assert ok.plan.decode_worker_id


@pytest.mark.parametrize(
    ("doc", "limit"),
    [
        pytest.param("[" * 5000 + "]" * 5000, "levels", id="deep-brackets"),
        pytest.param(
            "profile: x\n" + "a: &a [1]\n" + "b: [" + "*a, " * 200 + "1]",
            "aliases",
            id="alias-fan-out",
        ),
    ],
)
async def test_a_hostile_policy_document_is_refused_naming_the_limit(
    scheduler: SchedulerHandle, doc: str, limit: str
) -> None:
    """The document is refused before it is built (INVALID_ARGUMENT naming the limit, not
    INTERNAL after a recursion error), and the live policy stays."""
    before = await scheduler.stub.GetPolicy(s.GetPolicyRequest(), timeout=5)
    code, exc = await status_of(
        scheduler.stub.ReloadPolicy(s.ReloadPolicyRequest(profile_yaml=doc), timeout=10)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT, code
    assert "profile_yaml" in exc.details() and limit in exc.details(), exc.details()
    after = await scheduler.stub.GetPolicy(s.GetPolicyRequest(), timeout=5)
    assert after.policy.generation == before.policy.generation
