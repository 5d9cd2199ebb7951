"""`hpd gateway` in front of real vLLM engines: the OpenAI SDK, vLLM's NIXL hand-off,
recompute for a pair NIXL cannot serve, fallbacks when an engine dies, bad input."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import openai
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import scheduler_pb2 as s
from hpd_fleet.real_processes import AgentProcess, http_json
from tests.real_engine.conftest import RealFleet
from tests.real_engine.test_agent import gauge

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "sigma",
]


def fresh_prompt(n_words: int = 100) -> str:
    """Words in a new order each time, so no engine holds the prefix already (about five
    tokens a word with the tiny model's tokenizer: 100 words stay under its 1,024)."""
    rng = random.Random(time.monotonic_ns())
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def record(real: RealFleet, rid: str, timeout_s: float = 30.0) -> s.RouteRecord:
    """The route record once its outcome has been reported (the record as it stands after
    ``timeout_s``). A call that times out is asked again within ``timeout_s``: on a shared
    2-core machine busy with engines the control plane once took over 5 s to answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            got = real.scheduler.GetRouteRecord(
                s.GetRouteRecordRequest(request_id=rid), timeout=max(1.0, min(5.0, left))
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or left <= 0:
                raise
            continue
        if got.record.HasField("outcome") or time.monotonic() > deadline:
            rec: s.RouteRecord = got.record
            return rec
        time.sleep(0.1)


def why(rec: s.RouteRecord) -> str:
    """The plan and the planner's explanation (candidates, factors, drops), compactly."""
    from google.protobuf.json_format import MessageToDict

    return json.dumps(
        {"plan": MessageToDict(rec.plan), "explanation": MessageToDict(rec.explanation)},
        separators=(",", ":"),
    )[:6000]


def client(real: RealFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=real.gateway_url + "/v1", api_key="test-key", max_retries=0)


def by_source(metrics: str) -> dict[str, float]:
    return {
        src: gauge(metrics, "vllm:prompt_tokens_by_source_total", source=src)
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }


def test_the_openai_sdk_streams_a_chat_through_a_real_kv_transfer(pd_pair: RealFleet) -> None:
    real = pd_pair
    dec = real.engines["decode"]
    before = by_source(dec.metrics())
    rid = f"sdk-chat-{time.monotonic_ns()}"
    messages: list[Any] = [{"role": "user", "content": fresh_prompt()}]
    stream = client(real).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True},
        extra_headers={"x-request-id": rid},
    )
    ids: list[int] = []
    prompt_tokens = 0
    chunks = 0
    for chunk in stream:
        if chunk.choices:
            chunks += 1
            ids += (chunk.choices[0].model_extra or {}).get("token_ids") or []
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    # (a slow engine may put several tokens in one event)
    assert chunks >= 1 and len(ids) == 12 and prompt_tokens > 128
    rec = record(real, rid)
    assert rec.plan.mode == s.EXECUTION_MODE_TRANSFER, why(rec)
    assert (rec.plan.prefill_worker_id, rec.plan.decode_worker_id) == ("p0", "d0"), why(rec)
    assert rec.outcome.success and rec.outcome.mode_used == s.EXECUTION_MODE_TRANSFER
    assert rec.outcome.ttft_ms > 0
    after = by_source(dec.metrics())
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] == before["local_compute"]
    session = real.broker.GetSession(kb.GetSessionRequest(request_id=rid), timeout=5).session
    assert session.state == kb.SESSION_STATE_COMPLETE
    assert session.bytes_done == session.expected_bytes > 0
    # the same request computed by one engine alone (same dummy weights): same tokens
    alone = http_json(
        real.engines["prefill"].url + "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert alone["choices"][0]["token_ids"] == ids


def test_the_openai_sdk_streams_a_completion(pd_pair: RealFleet) -> None:
    real = pd_pair
    stream = client(real).completions.create(
        model="tiny", prompt=fresh_prompt(60), max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    pieces = [c for c in chunks if c.choices]
    usage = [c.usage for c in chunks if c.usage is not None]
    # six tokens, streamed: a busy engine may put two of them in one event
    assert 1 <= len(pieces) <= 6
    assert usage and usage[-1].completion_tokens == 6
    whole = client(real).completions.create(model="tiny", prompt=fresh_prompt(60), max_tokens=4)
    assert whole.usage is not None and whole.usage.completion_tokens == 4
    models = client(real).models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.fixture
def both_worker(pd_pair: RealFleet) -> Iterator[RealFleet]:
    """A second worker on the prefill engine serving both stages: somewhere to fall back to
    when the decode engine dies. Its id sorts after d0's, so the gateway counts tokens on
    the decode engine first (the test freezes the prefill engine). Its engine is a NIXL
    producer (``--kv-role producer``): it runs requests whole, and no plan sends it KV.
    It is described as a tenth of a core (the flags after the shared ones win), so the
    planner prefers the P/D pair and keeps this worker as the fallback it is here for: on
    equal figures a short request served whole on one worker is rightly the cheaper plan."""
    real = pd_pair
    agent = AgentProcess(
        "zb0",
        [
            *real.agent_args("prefill", "zb0", "both"),
            "--pool-id", "cpu-both", "--kv-role", "producer",
            "--peak-tflops", "0.05", "--hbm-gbps", "2",
        ],
        real.log_dir,
    )  # fmt: skip
    agent.start()
    real.wait_worker("zb0", timeout_s=30)
    yield real
    agent.stop()


def _lifecycle(real: RealFleet, worker_id: str, last: int = 8) -> list[str]:
    """The agent's last lifecycle log lines (registered, lost, deregistered, lease) as
    ``HH:MM:SS.s event``, for a failure message that says what the agent did."""
    keep = ("registered", "engine_lost", "deregister", "lease_lost", "registration_failed")
    lines: list[str] = []
    with contextlib.suppress(OSError):
        for raw in (real.log_dir / f"agent-{worker_id}.log").read_text().splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(raw)
                if any(k in str(ev.get("event", "")) for k in keep):
                    lines.append(f"{str(ev.get('timestamp', ''))[11:21]} {ev['event']}")
    return lines[-last:]


def _restart_decode(real: RealFleet) -> None:
    proc = real.engines["decode"].proc
    if proc is not None and proc.poll() is None:
        return  # the test failed before it killed the engine: nothing to restart
    real.engines["decode"].start()
    real.engines["decode"].wait_ready()
    real.wait_worker("d0", timeout_s=60)
    deadline = time.monotonic() + 30
    while True:  # registered, then healthy once its first scrapes succeed
        got = real.worker("d0")
        if got is not None and got.worker.status.health == c.HEALTH_STATE_HEALTHY:
            return
        assert time.monotonic() < deadline, "d0 never became healthy again"
        time.sleep(0.2)


# size: one real-engine scenario (kill, fall back, restart) whose steps build on each other
def test_a_decode_engine_killed_while_the_request_waits_in_prefill_falls_back(
    both_worker: RealFleet,
) -> None:
    """The prefill engine is frozen (SIGSTOP) while the request is in its prefill step; the
    decode engine is SIGKILLed meanwhile; the prefill resumes and the gateway finds decode
    gone: the plan's fallback chain serves the request and the record says why. The agent
    of the killed engine takes its worker out within the lease and, once the engine is
    restarted, back in as a new incarnation without being restarted itself."""
    real = both_worker
    pre, dec = real.engines["prefill"], real.engines["decode"]
    assert pre.proc is not None
    before = real.worker("d0")
    assert before is not None
    lease_s = before.worker.status.lease_ttl_ms / 1000
    rid = f"fb-{time.monotonic_ns()}"
    result: dict[str, Any] = {}

    def send() -> None:
        try:
            result["body"] = http_json(
                real.gateway_url + "/v1/completions",
                {"model": "tiny", "prompt": fresh_prompt(), "max_tokens": 4, "temperature": 0},
                timeout=60,
                headers={"x-request-id": rid},
            )
        except urllib.error.HTTPError as exc:
            result["status"] = exc.code
            result["error"] = exc.read().decode()

    gone: list[float] = []
    seen: list[str] = []  # the watcher's last answer, for the failure message

    def watch() -> None:  # when d0 leaves, seen while the request still runs
        deadline = time.monotonic() + lease_s + 10
        while time.monotonic() < deadline:
            try:
                got = real.worker("d0")
            except grpc.RpcError as exc:
                seen[:] = [f"GetWorker: {exc.code().name}"]
            else:
                if got is None:
                    gone.append(time.monotonic())
                    return
                st = got.worker.status
                seen[:] = [f"health {c.HealthState.Name(st.health)} ({st.health_reason!r})"]
            time.sleep(0.1)

    plan = None
    killed_at: float | None = None
    t = threading.Thread(target=send)
    watcher = threading.Thread(target=watch)
    try:
        os.killpg(pre.proc.pid, signal.SIGSTOP)
        t.start()
        deadline = time.monotonic() + 5
        while plan is None and time.monotonic() < deadline:  # scheduled: in its prefill now
            with contextlib.suppress(grpc.RpcError):
                plan = real.scheduler.GetRouteRecord(
                    s.GetRouteRecordRequest(request_id=rid), timeout=1
                ).record.plan
            time.sleep(0.05)
        dec.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        watcher.start()
    finally:
        os.killpg(pre.proc.pid, signal.SIGCONT)
    t.join(timeout=60)
    if killed_at is not None:
        watcher.join(timeout=lease_s + 15)
    try:
        assert plan is not None and plan.mode == s.EXECUTION_MODE_TRANSFER, plan
        assert plan.decode_worker_id == "d0"
        assert "body" in result, result
        rec = record(real, rid)
        assert rec.outcome.error_class.startswith("decode_"), rec.outcome
        if not rec.outcome.success:
            # the chain ran out (its steps were planned while d0 still looked alive): the
            # gateway re-planned once, under a request id of its own, and that plan served it
            again = record(real, rid + ":replan")
            assert again.outcome.success, again.outcome
            # served by zb0: the re-plan's own chain ends on it when its view still had d0
            assert (
                again.outcome.mode_used in (s.EXECUTION_MODE_SAME_POOL, s.EXECUTION_MODE_RECOMPUTE)
                or again.plan.decode_worker_id == "zb0"
            ), again.outcome
        assert killed_at is not None and gone, (
            f"d0 still there {lease_s + 10:.0f} s after the kill; last seen: {seen}; its agent "
            f"said: {_lifecycle(real, 'd0')}"
        )
        gone_after = gone[0] - killed_at
        assert gone_after <= lease_s, f"d0 left after {gone_after:.1f} s, lease {lease_s:.0f} s"
    finally:
        _restart_decode(real)
    after = real.worker("d0")
    assert after is not None
    agent = real.agents["d0"]
    assert agent.proc is not None and agent.proc.poll() is None, "the agent was restarted"
    assert after.worker.status.registered_at_unix_ms > before.worker.status.registered_at_unix_ms, (
        "a new incarnation has a new registration time"
    )


def _raw_stream(url: str, body: dict[str, Any]) -> tuple[http.client.HTTPResponse, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    conn.request(
        "POST", parts.path, body=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    return conn.getresponse(), conn


def test_a_decode_engine_killed_mid_stream_ends_the_stream_with_an_error(
    pd_pair: RealFleet,
) -> None:
    real = pd_pair
    resp, conn = _raw_stream(
        real.gateway_url + "/v1/completions",
        {
            "model": "tiny", "prompt": fresh_prompt(40), "max_tokens": 900,
            "ignore_eos": True, "stream": True,
        },
    )  # fmt: skip
    try:
        assert resp.status == 200
        events: list[str] = []
        killed_at = None
        t0 = time.monotonic()
        while True:
            line = resp.readline()
            if not line:
                break
            text = line.decode().strip()
            if not text.startswith("data:"):
                continue
            events.append(text[5:].strip())
            if len(events) == 5:
                real.engines["decode"].kill(signal.SIGKILL)
                killed_at = time.monotonic()
            assert time.monotonic() - t0 < 60, "the stream hung"
        assert killed_at is not None
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "error" in last and last["error"]["type"] == "server_error", last
        tokens = [e for e in events[:-2] if '"choices"' in e]
        assert 5 <= len(tokens) < 900  # cut short, and never restarted from the top
    finally:
        conn.close()
        _restart_decode(real)


BAD = [
    pytest.param("completions", b"{not json", 400, "body", id="completions-malformed-json"),
    pytest.param("chat", b"[1, 2]", 400, "body", id="chat-not-an-object"),
    pytest.param("completions", b'{"prompt": "hi"}', 400, "model", id="completions-no-model"),
    pytest.param("chat", b'{"model": "tiny"}', 400, "messages", id="chat-no-messages"),
    pytest.param("completions", b'{"model": "tiny"}', 400, "prompt", id="completions-no-prompt"),
    pytest.param(
        "completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": -3}', 400,
        "max_tokens", id="completions-negative-max-tokens",
    ),
    pytest.param(
        "chat", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
        b'"max_tokens": -1}', 400, "max_tokens", id="chat-negative-max-tokens",
    ),
    pytest.param(
        "completions", b'{"model": "no-such-model", "prompt": "hi"}', 404, "model",
        id="completions-unknown-model",
    ),
    pytest.param(
        "chat", b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
        404, "model", id="chat-unknown-model",
    ),
    pytest.param(
        "completions", b'{"model": "tiny", "prompt": "' + b"x" * (5 << 20) + b'"}', 413,
        "body", id="completions-huge-body",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "raw", "status", "param"), BAD)
def test_bad_input_gets_its_status_and_the_gateway_keeps_serving(
    pd_pair: RealFleet, kind: str, raw: bytes, status: int, param: str
) -> None:
    real = pd_pair
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    req = urllib.request.Request(
        real.gateway_url + path, data=raw, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == status
    body = json.loads(err.value.read())
    assert body["error"]["param"] == param and body["error"]["message"], body
    ok = client(real).completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert ok.choices


def test_a_client_that_hangs_up_cancels_upstream_and_releases_the_reservation(
    pd_pair: RealFleet,
) -> None:
    real = pd_pair
    dec = real.engines["decode"]
    rid = f"hangup-{time.monotonic_ns()}"
    parts = urlsplit(real.gateway_url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({
            "model": "tiny", "prompt": fresh_prompt(40), "max_tokens": 900,
            "ignore_eos": True, "stream": True,
        }),
        headers={"Content-Type": "application/json", "x-request-id": rid},
    )  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(4):
        resp.readline()
    if conn.sock is not None:  # the client hangs up mid-stream
        conn.sock.shutdown(socket.SHUT_RDWR)
    resp.close()
    conn.close()
    deadline = time.monotonic() + 10
    while gauge(dec.metrics(), "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the engine kept generating for a gone client"
        time.sleep(0.1)
    rec = record(real, rid)
    assert rec.HasField("outcome"), "no outcome: the reservation would wait for its TTL"
    assert not rec.outcome.success or rec.outcome.output_tokens < 900
    ok = client(real).completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert ok.choices
