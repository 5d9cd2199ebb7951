"""`hpd demo --via-gateway`: the trace replayed as OpenAI clients send it, over HTTP through
`hpd gateway` (a process of its own) to the emulated engines' HTTP servers, which speak
vLLM's protocol and KV hand-off. Every request must end exactly once, the report's counts
must agree with the route records, and what the client measured must contain what the
gateway reported (the gateway's time is inside the client's)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from hetero_pd.v1 import scheduler_pb2 as s
from hpd_fleet.demo import main, options_from, parser
from hpd_fleet.demo_run import DemoOptions, default_trace_path, run_demo
from hpd_fleet.faults import Fault
from hpd_fleet.fleet import default_cluster_path
from hpd_gateway.service import REPLAN_SUFFIX
from hpd_sim.traces import load_trace, reshape
from hpd_tools.embedded_redis import EmbeddedRedis

RATE, DURATION_S = 0.5, 12.0


async def test_the_demo_through_the_gateway_accounts_for_every_request(
    redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> None:
    opts = DemoOptions(
        trace=default_trace_path(),
        cluster=default_cluster_path(),
        rate_scale=RATE,
        duration_s=DURATION_S,
        live=False,
        serve=False,
        key_prefix=key_prefix,
        lease_ttl_ms=3_000,
        seed=11,
        out=tmp_path,
        via_gateway=True,
    )
    out = io.StringIO()
    res = await run_demo(opts, redis_server.url, out=out)
    assert "requests go through hpd gateway at http://" in out.getvalue()
    trace = load_trace(default_trace_path())
    expected = len(reshape(trace, rate_scale=RATE, duration_s=DURATION_S))
    acc = res.report["accounting"]
    assert acc["requests"] == expected == len(res.records) == acc["unique_ids"] > 0
    assert acc["accounted"] and res.status == 0, out.getvalue()
    assert all(r.reason for r in res.records if r.status != "completed")
    # a light load on a healthy fleet: nearly everything is served
    assert acc["completed"] >= 0.9 * expected, acc
    check = res.report["route_records"]
    assert check["agree"], check["mismatches"]
    assert check["outcome_success"] >= acc["completed"]
    by_id = {r.request_id: r for r in res.route}
    modes = set()
    for rec in res.records:
        if not rec.completed:
            continue
        rr = by_id.get(rec.request_id + REPLAN_SUFFIX) or by_id[rec.request_id]
        assert rr.outcome.success
        # the client's TTFT runs from the request's arrival and holds the gateway's
        assert rec.ttft_ms + 1.0 >= rr.outcome.ttft_ms > 0, (rec, rr.outcome)
        assert rec.prefill_worker == rr.plan.prefill_worker_id
        modes.add(rec.mode_used)
    # the hand-off really ran over the engines' protocol: the decode engine pulled the KV
    assert "transfer" in modes, modes
    transfers = [
        r for r in res.route if r.HasField("outcome") and r.outcome.success
        and r.outcome.mode_used == s.EXECUTION_MODE_TRANSFER
    ]  # fmt: skip
    # the prefill step (max_tokens 1 on the prefill engine) was timed apart from decode
    assert transfers and all(r.outcome.prefill_ms > 0 for r in transfers)
    assert (tmp_path / "gateway-demo.log").exists()


async def test_a_redis_stop_through_the_gateway_leaves_every_record_complete(
    tmp_path: Path, key_prefix: str
) -> None:
    """Redis stopped for 2 s while requests flow through the gateway: Schedule answers 503
    (the client retries it), and outcomes the scheduler could not take are sent again, so
    every planned request's record ends with its outcome and the report agrees with them."""
    with EmbeddedRedis(tmp_path / "redis", persist=True) as redis:
        opts = DemoOptions(
            trace=default_trace_path(),
            cluster=default_cluster_path(),
            rate_scale=4.0,
            duration_s=8.0,
            live=False,
            serve=False,
            key_prefix=key_prefix,
            lease_ttl_ms=3_000,
            seed=5,
            out=tmp_path / "out",
            via_gateway=True,
            faults=(Fault("stop_redis", "redis", 2.0, at_s=2.0),),
        )
        out = io.StringIO()
        res = await run_demo(opts, redis.url, redis, out=out)
    assert res.report["faults"] == ["Redis stopped for 2 s", "Redis restarted"]
    acc = res.report["accounting"]
    assert acc["accounted"] and res.status == 0, out.getvalue()
    check = res.report["route_records"]
    assert check["agree"], check["mismatches"]
    assert all(r.completed or r.reason == "unavailable" for r in res.records), acc
    assert acc["completed"] > 0


def test_the_gateway_path_runs_in_real_time_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--via-gateway", "--time-scale", "4", "--no-serve"]) == 2
    assert "--via-gateway runs in real time" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "via_gateway"),
    [
        ([], True),  # the newcomer's `hpd demo`: through the front door
        (["--time-scale", "4"], False),  # emulated time: plans run in process
        (["--attach", "r:1,s:2,k:3"], False),  # someone else's plane and credentials
        (["--in-process"], False),
        (["--via-gateway", "--attach", "r:1,s:2,k:3"], True),
    ],
)
def test_which_path_the_demo_takes(argv: list[str], via_gateway: bool) -> None:
    assert options_from(parser().parse_args(argv)).via_gateway is via_gateway


def test_both_paths_at_once_is_refused() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--via-gateway", "--in-process"])
