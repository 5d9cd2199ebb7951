"""KvBrokerService through its gRPC API: the session lifecycle, WatchSession and ListSessions."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from prometheus_client import REGISTRY

from hetero_pd.v1 import kvbroker_pb2 as k
from tests.support.kvbroker import (
    GIB,
    SCHED,
    Env,
    V,
    code_of,
    eventually,
    open_request,
)
from tests.support.kvbroker import (
    env as env,
)
from tests.support.servers import external

# These start their own broker over the suite's Redis; against a compose stack (whose
# registry keeps its credentials in the stack's Redis) the stack's own suite covers it.
pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own broker"),
]


# -- lifecycle, watch, list --------------------------------------------------------------------


async def test_all_bytes_arrived_completes_without_progress_in_one_call(env: Env) -> None:
    """A caller that reported no progress (a gateway that saw the decode side produce from
    the KV) completes a NEGOTIATED or RESERVED session in one call when it says every byte
    arrived; without saying so, completing still needs reported progress."""
    p1, d1 = env.as_("p1"), env.as_("d1")
    for i, reserve in enumerate((False, True)):
        opened = await env.stub.OpenSession(open_request(f"req-all-{i}", who=p1), timeout=5)
        sid = opened.session.session_id
        if reserve:
            await env.stub.ReportProgress(
                k.ReportProgressRequest(session_id=sid, caller=d1, state=k.SESSION_STATE_RESERVED),
                timeout=5,
            )
        early = env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=d1))
        assert await code_of(early) == grpc.StatusCode.FAILED_PRECONDITION
        before = (await env.stub.GetSession(k.GetSessionRequest(session_id=sid))).session
        assert before.bytes_done == 0
        done = await env.stub.CompleteSession(
            k.CompleteSessionRequest(session_id=sid, caller=d1, all_bytes_arrived=True)
        )
        assert done.session.state == k.SESSION_STATE_COMPLETE
        assert done.session.bytes_done == done.session.expected_bytes > 0
        assert done.session.version == before.version + 1
        again = await env.stub.CompleteSession(
            k.CompleteSessionRequest(session_id=sid, caller=p1, all_bytes_arrived=True)
        )
        assert again.session == done.session  # a retry changes nothing


async def test_a_full_lifecycle_seen_by_a_watcher(env: Env) -> None:
    opened = await env.stub.OpenSession(open_request("req-6", who=env.as_("p1")), timeout=5)
    sid = opened.session.session_id
    watch = env.stub.WatchSession(k.WatchSessionRequest(request_id="req-6"))
    seen = [(await watch.read()).session]
    p1, d1 = env.as_("p1"), env.as_("d1")
    await env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=sid, caller=d1, state=k.SESSION_STATE_RESERVED),
        timeout=5,
    )
    for n in (GIB // 4, GIB // 2):
        await env.stub.ReportProgress(
            k.ReportProgressRequest(session_id=sid, caller=p1, bytes_done=n), timeout=5
        )
    back = env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=sid, caller=p1, bytes_done=GIB // 8), timeout=5
    )
    assert await code_of(back) == grpc.StatusCode.FAILED_PRECONDITION
    done = await env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=d1))
    again = await env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=p1))
    assert again.session == done.session
    late = env.stub.AbortSession(k.AbortSessionRequest(session_id=sid, caller=SCHED), timeout=5)
    assert await code_of(late) == grpc.StatusCode.FAILED_PRECONDITION
    while (msg := await watch.read()) is not grpc.aio.EOF:
        seen.append(msg.session)
    assert [(s.state, s.bytes_done, s.version) for s in seen] == [
        (k.SESSION_STATE_NEGOTIATED, 0, 1),
        (k.SESSION_STATE_RESERVED, 0, 2),
        (k.SESSION_STATE_TRANSFERRING, GIB // 4, 3),
        (k.SESSION_STATE_TRANSFERRING, GIB // 2, 4),
        (k.SESSION_STATE_COMPLETE, GIB, 5),
    ]
    resumed = env.stub.WatchSession(k.WatchSessionRequest(session_id=sid, from_version=3))
    assert [m.session.version async for m in resumed] == [5]


async def test_a_failure_report_needs_a_reason_and_ends_the_session(env: Env) -> None:
    opened = await env.stub.OpenSession(open_request("req-7", who=SCHED), timeout=5)
    sid = opened.session.session_id
    no_reason = k.ReportProgressRequest(
        session_id=sid, caller=env.as_("d1"), state=k.SESSION_STATE_FAILED
    )
    assert await code_of(env.stub.ReportProgress(no_reason, timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    no_reason.reason = "rdma link down"
    failed = await env.stub.ReportProgress(no_reason, timeout=5)
    assert (failed.session.state, failed.session.reason) == (
        k.SESSION_STATE_FAILED,
        "rdma link down",
    )


async def test_list_sessions_filters_and_pages(env: Env) -> None:
    sids = []
    for i in range(5):
        opened = await env.stub.OpenSession(open_request(f"list-{i}", who=SCHED), timeout=5)
        sids.append(opened.session.session_id)
    await env.stub.AbortSession(k.AbortSessionRequest(session_id=sids[1], caller=SCHED))
    pages: list[list[str]] = []
    token = ""
    while True:
        resp = await env.stub.ListSessions(
            k.ListSessionsRequest(page_size=2, page_token=token), timeout=5
        )
        pages.append([s.session_id for s in resp.sessions])
        token = resp.next_page_token
        if not token:
            break
    assert [sid for page in pages for sid in page] == sorted(sids)
    assert [len(p) for p in pages] == [2, 2, 1]
    aborted = await env.stub.ListSessions(
        k.ListSessionsRequest(state=k.SESSION_STATE_ABORTED), timeout=5
    )
    assert [s.session_id for s in aborted.sessions] == [sids[1]]
    of_d2 = await env.stub.ListSessions(k.ListSessionsRequest(worker_id="d2"), timeout=5)
    assert list(of_d2.sessions) == []
    of_d1 = await env.stub.ListSessions(k.ListSessionsRequest(worker_id="d1"), timeout=5)
    assert len(of_d1.sessions) == 5


async def test_listing_moves_past_ids_whose_sessions_are_gone(env: Env) -> None:
    """A scan batch whose sessions were all purged between the index read and the hash
    reads is not the end of the listing."""
    sids = []
    for i in range(5):
        opened = await env.stub.OpenSession(open_request(f"gone-{i}", who=SCHED), timeout=5)
        sids.append(opened.session.session_id)
    sids.sort()  # listing order (ids opened in the same millisecond sort by their random part)
    svc = env.broker.service
    await svc.client.delete(*(svc.store.keys.session(sid) for sid in sids[:3]))
    listed, token = await svc.list_sessions(None, "", 10, "", scan_batch=2)
    assert ([s.session_id for s in listed], token) == (sids[3:], "")
    first, token = await svc.list_sessions(None, "", 1, "", scan_batch=2)
    assert [s.session_id for s in first] == [sids[3]] and token == sids[3]
    rest, token = await svc.list_sessions(None, "", 1, token, scan_batch=2)
    assert ([s.session_id for s in rest], token) == ([sids[4]], "")


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_metrics_count_changes_bytes_durations_expiries_and_verdicts(env: Env) -> None:
    """What the broker exports (`hpd_kv_*`) moves with each session change it makes."""
    names = {
        "opened": ("hpd_kv_sessions_total", {"state": "NEGOTIATED"}),
        "moving": ("hpd_kv_sessions_total", {"state": "TRANSFERRING"}),
        "complete": ("hpd_kv_sessions_total", {"state": "COMPLETE"}),
        "expired": ("hpd_kv_sessions_total", {"state": "EXPIRED"}),
        "moved_bytes": ("hpd_kv_session_bytes_total", {"state": "COMPLETE"}),
        "stranded_bytes": ("hpd_kv_session_bytes_total", {"state": "EXPIRED"}),
        "durations": ("hpd_kv_session_duration_seconds_count", {"state": "COMPLETE"}),
        "deadline_expiries": ("hpd_kv_session_expiries_total", {"reason": "deadline_exceeded"}),
        "convertible": ("hpd_kv_negotiations_total", {"verdict": "convertible"}),
    }

    def snapshot() -> dict[str, float]:
        return {key: _sample(name, **labels) for key, (name, labels) in names.items()}

    before = snapshot()
    p1, d1 = env.as_("p1"), env.as_("d1")
    opened = await env.stub.OpenSession(open_request("metrics-1", who=p1), timeout=5)
    assert opened.session.negotiation.verdict == V.COMPATIBILITY_VERDICT_CONVERTIBLE
    sid = opened.session.session_id
    await env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=sid, caller=p1, bytes_done=GIB // 2), timeout=5
    )
    await env.stub.CompleteSession(k.CompleteSessionRequest(session_id=sid, caller=d1), timeout=5)
    late = await env.stub.OpenSession(
        open_request("metrics-2", who=p1, deadline_ms=1_000, lease_ttl_ms=1_000), timeout=5
    )
    await env.stub.ReportProgress(
        k.ReportProgressRequest(session_id=late.session.session_id, caller=p1, bytes_done=GIB // 4),
        timeout=5,
    )

    async def expired() -> bool:
        got = await env.stub.GetSession(
            k.GetSessionRequest(session_id=late.session.session_id), timeout=5
        )
        return bool(got.session.state == k.SESSION_STATE_EXPIRED)

    await eventually(expired)
    after = snapshot()
    assert {key: after[key] - before[key] for key in names} == {
        "opened": 2,
        "moving": 2,
        "complete": 1,
        "expired": 1,
        "moved_bytes": GIB,
        "stranded_bytes": GIB // 4,
        "durations": 1,
        "deadline_expiries": 1,
        "convertible": 2,
    }


async def test_hpd_sessions_and_hpd_compat_print_tables(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator's views: `hpd sessions` (filters, --limit, JSON) and `hpd compat MODEL`."""
    from hpd_tools.tables import kvbroker as tables

    for i in range(3):
        await env.stub.OpenSession(open_request(f"cli-{i}", who=SCHED), timeout=5)
    base = ["--kvbroker", env.broker.target]

    async def hpd(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = await asyncio.to_thread(tables.main, [argv[0], *base, *argv[1:]])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = await hpd("sessions", "--limit", "2")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split()[:2] == ["SESSION", "REQUEST"]
    assert len(lines) == 3 and all("NEGOTIATED" in line for line in lines[1:])
    code, out, _ = await hpd("sessions", "--state", "negotiated", "-o", "json")
    assert code == 0 and sorted(s["request_id"] for s in json.loads(out)) == [
        "cli-0",
        "cli-1",
        "cli-2",
    ]
    code, out, _ = await hpd("sessions", "--state", "complete")
    assert code == 0 and len(out.strip().splitlines()) == 1  # the header alone
    for bad in (("--limit", "0"), ("--state", "bogus")):
        code, _, err = await hpd("sessions", *bad)
        assert code == 2 and err.startswith("hpd sessions:")
    code, out, _ = await hpd("compat", "llama-3-8b")
    rows = [line.split() for line in out.strip().splitlines()]
    assert code == 0 and rows[0] == ["PREFILL", "DECODE", "VERDICT", "MS/GIB", "REASONS"]
    assert ["p1", "d1", "CONVERTIBLE", "1", "block_size_mismatch"] in rows[1:], out
