"""Fault injection end to end, one fault per test, each a short time-scaled replay through
the real services over a real Redis: the report and the route records show the fallbacks.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import scheduler_pb2 as s
from hpd_agent.worker_client import TERMINAL_STATES
from hpd_fleet.demo_run import DemoResult, run_demo
from hpd_fleet.faults import Fault
from hpd_fleet.replay_common import MODE_NAMES
from hpd_tools.embedded_redis import EmbeddedRedis
from tests.e2e.test_demo_replay import options


async def replay(redis: EmbeddedRedis, prefix: str, **kw: Any) -> DemoResult:
    res = await run_demo(options(prefix, **kw), redis.url, redis, out=io.StringIO())
    assert res.report["accounting"]["accounted"], res.report["accounting"]
    assert res.report["route_records"]["agree"], res.report["route_records"]["mismatches"]
    assert res.status == 0
    return res


def cluster_file(tmp_path: Path, pools: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"name: test\nmodel: llama-3-8b\npools:\n{pools}")
    return path


LEASE_TTL_MS = 1_000


async def test_killed_decode_worker_fails_its_sessions_and_requests_fall_back(
    redis_server: EmbeddedRedis, key_prefix: str
) -> None:
    res = await replay(
        redis_server, key_prefix, rate_scale=3.0, duration_s=36.0,
        faults=(Fault("kill_worker", "auto", 0.0, at_s=1.5),), lease_ttl_ms=LEASE_TTL_MS,
    )  # fmt: skip
    (killed,) = res.sessions
    lost = [r for r in res.records if r.fallback.startswith("decode_worker_lost")]
    assert lost, res.report["overall"]["fallbacks"]
    assert all(r.completed or r.status == "failed" for r in lost)
    by_id = {r.request_id: r for r in res.route}
    by_rec = {r.request_id: r for r in res.records}
    assert res.report["workers"][killed]["killed_at_unix_ms"] > 0
    for r in lost:
        rr = by_id[r.request_id]
        assert rr.plan.decode_worker_id == killed  # planned onto the dead worker...
        assert rr.outcome.error_class == "decode_worker_lost"  # ...and the record says why
        if r.completed:
            assert r.decode_worker != killed
            assert MODE_NAMES[rr.outcome.mode_used] == r.mode_used
    # none of its sessions is left open: those in flight at the crash failed, naming it
    sessions = res.sessions[killed]
    assert sessions and all(x.state in TERMINAL_STATES for x in sessions)
    failed = [x for x in sessions if x.state == kb.SESSION_STATE_FAILED]
    assert all(killed in x.reason for x in failed)
    assert res.report["killed_worker_sessions"][killed]
    # once the lease lapsed and the registry's sweep (every 1 s) expired it, the scheduler
    # stopped planning onto it (ordered by when each plan was made, not by request id: a
    # short request that arrived later may have finished on the worker before the crash)
    lapsed_ms = res.report["workers"][killed]["killed_at_unix_ms"] + LEASE_TTL_MS + 1_500
    late = [r for r in res.route if r.created_at_unix_ms > lapsed_ms]
    onto_dead = [
        (r.request_id, r.created_at_unix_ms - lapsed_ms, by_rec[r.request_id].fallback)
        for r in late
        if r.plan.decode_worker_id == killed
    ]
    assert late and not onto_dead, onto_dead


CUT_AT_S = 2.0


async def test_slow_link_switches_the_pair_to_recompute(
    redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> None:
    """Prefill in zone a, decode in zone b over the 25 Gb/s cross-zone link: transfer wins
    until the link is cut tenfold; the scheduler learns the rate from the reported transfer
    times and plans recompute on the decode worker instead."""
    cluster = cluster_file(
        tmp_path,
        "  - {id: h100-prefill-a, gpu: H100-SXM, count: 2, tp: 1, stage: prefill, zone: a}\n"
        "  - {id: a100-decode-b, gpu: A100-80G, count: 2, tp: 1, stage: decode, zone: b}\n",
    )
    res = await replay(
        redis_server, key_prefix, cluster=cluster, rate_scale=2.0, duration_s=40.0,
        faults=(Fault("slow_link", "h100-prefill-a>a100-decode-b", 10.0, at_s=CUT_AT_S),),
    )  # fmt: skip
    records = sorted(res.route, key=lambda r: r.request_id)
    # with the link cut the two decode workers prefill everything themselves and the fleet
    # runs past capacity: admission refuses what would miss its TTFT or TPOT target; the
    # plans are the rest
    refused = [r for r in records if r.decision == s.ROUTE_DECISION_REJECT]
    assert {reason for r in refused for reason in r.reject_reasons} <= {
        "ttft_over_admission_limit",
        "tpot_over_admission_limit",
    }
    planned = [r for r in records if r.decision != s.ROUTE_DECISION_REJECT]
    # before the cut (planned within CUT_AT_S wall seconds of the first plan) against the
    # last quarter, long after it: a count-based first quarter would straddle the cut
    start_ms = min(r.created_at_unix_ms for r in planned)
    first = [r for r in planned if r.created_at_unix_ms < start_ms + CUT_AT_S * 1000]
    last = planned[-(len(planned) // 4) :]
    assert len(first) >= 20 and len(last) >= 20

    def share(rs: list[s.RouteRecord], mode: int) -> float:
        return sum(r.plan.mode == mode for r in rs) / len(rs)

    assert share(first, s.EXECUTION_MODE_TRANSFER) >= 0.8
    assert share(last, s.EXECUTION_MODE_RECOMPUTE) >= 0.8
    assert res.report["faults"] == ["link h100-prefill-a -> a100-decode-b bandwidth / 10"]


async def test_full_decode_pool_climbs_the_memory_ladder(
    redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> None:
    """The decode pool holds most of the model's decode memory; filling it pushes memory
    pressure over the ladder's rungs and the records name the steps taken."""
    cluster = cluster_file(
        tmp_path,
        "  - {id: h100-prefill-a, gpu: H100-SXM, count: 1, tp: 1, stage: prefill, zone: a}\n"
        "  - {id: a100-decode-a, gpu: A100-80G, count: 2, tp: 1, stage: decode, zone: a}\n"
        "  - {id: l4-shared-a, gpu: L4, count: 2, tp: 1, stage: both, zone: a}\n",
    )
    res = await replay(
        redis_server, key_prefix, cluster=cluster, rate_scale=2.0, duration_s=24.0,
        faults=(Fault("fill_pool", "a100-decode-a", 0.97, at_s=1.5),),
    )  # fmt: skip
    before = [r for r in res.route if not r.serving_action.ladder_steps]
    after = [r for r in res.route if r.serving_action.ladder_steps]
    assert before and after
    assert all(r.serving_action.ladder_steps[0] == "throttle_admission" for r in after)
    assert any("fallback_to_shared" in r.serving_action.ladder_steps for r in after)
    placed = [r for r in after if r.decision != s.ROUTE_DECISION_REJECT]
    assert any(r.plan.decode_pool_id == "l4-shared-a" for r in placed)

    def on_full_pool(rs: list[s.RouteRecord]) -> float:
        return sum(r.plan.decode_pool_id == "a100-decode-a" for r in rs) / max(1, len(rs))

    assert on_full_pool(placed) < on_full_pool(before)
    for r in after:
        assert r.serving_action.action == r.serving_action.ladder_steps[-1]
        assert r.summary["service_action"] == r.serving_action.action


async def test_redis_outage_loses_no_request_and_the_run_recovers(
    tmp_path: Path, key_prefix: str
) -> None:
    with EmbeddedRedis(tmp_path / "redis", persist=True) as redis:
        res = await replay(
            redis, key_prefix, rate_scale=2.0, duration_s=36.0, lease_ttl_ms=3_000,
            faults=(Fault("stop_redis", "redis", 2.0, at_s=1.5),),
        )  # fmt: skip
    assert res.report["faults"] == ["Redis stopped for 2 s", "Redis restarted"]
    assert res.report["schedule_retries_while_unavailable"] > 0
    waited = [r for r in res.records if r.schedule_retries > 0]
    assert waited and all(r.completed or r.reason == "unavailable" for r in waited)
    # requests arriving well after the restart are served normally again
    tail = res.records[-len(res.records) // 4 :]
    assert all(r.completed and r.schedule_retries == 0 for r in tail)


async def test_a_worker_killed_during_a_redis_stop_longer_than_a_lease(
    tmp_path: Path, key_prefix: str
) -> None:
    """Two faults at once: a decode worker killed while Redis is stopped for longer than a
    lease. Every request either completes (a fallback serves those of the dead worker) or,
    arriving while the state store was away, is refused as unavailable (retryable): never
    FAILED_PRECONDITION, which a gateway would not retry."""
    with EmbeddedRedis(tmp_path / "redis", persist=True) as redis:
        res = await replay(
            redis, key_prefix, rate_scale=2.0, duration_s=36.0, lease_ttl_ms=1_000,
            faults=(
                Fault("stop_redis", "redis", 3.0, at_s=1.5),
                Fault("kill_worker", "auto", 0.0, at_s=2.0),
            ),
        )  # fmt: skip
    assert res.report["faults"][0].startswith("Redis stopped")
    assert any(f.startswith("killed worker") for f in res.report["faults"])
    statuses: dict[str, int] = {}
    for r in res.records:
        key = "completed" if r.completed else f"{r.status}:{r.reason}"
        statuses[key] = statuses.get(key, 0) + 1
    # every request a fallback could serve was served; the only refusals allowed are the
    # retryable ones of the outage itself (never no_capable_worker / FAILED_PRECONDITION)
    assert all(r.completed or r.reason == "unavailable" for r in res.records), statuses
    lost = [r for r in res.records if r.fallback.startswith("decode_worker_lost")]
    assert lost and all(r.completed for r in lost), statuses
