"""Tracing (``hpd_common.tracing``): off by default at no cost and with no exporter, the
W3C context carried when on, and only the edges speaking OpenTelemetry.

The spans of a real request, received by an OTLP receiver, are
``tests/component/test_tracing.py``'s."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web

from hetero_pd.v1 import scheduler_pb2 as s
from hpd_common import tracing
from hpd_common.tracing_interceptor import client_interceptors, server_interceptors
from hpd_gateway.engine_client import EngineHttp, Hop
from hpd_scheduler.policy import Request
from hpd_scheduler.policy.domain import Stage
from hpd_scheduler.spans import note_decision
from hpd_tools.tables.scheduler import HEADERS, rows
from tests.unit.policy.builders import plan, worker
from tests.unit.project.test_layers import hand_written, module_name

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def _off_after() -> Iterator[None]:
    yield
    tracing.shutdown()


# -- off ---------------------------------------------------------------------------------------


def test_off_by_default_every_helper_is_a_no_op_and_no_exporter_exists() -> None:
    assert not tracing.configure(False, "hpd-test")
    assert not tracing.enabled() and tracing.exporter() is None
    # one shared no-op context, whatever is asked: nothing allocated per span
    assert tracing.span("tokenize") is tracing.OFF
    headers: dict[str, str] = {"x": "1"}
    assert tracing.server_span("s", {"traceparent": TRACEPARENT}) is tracing.OFF
    assert tracing.client_span("prefill", headers) is tracing.OFF
    with tracing.span("x") as span:
        span.set_attribute("k", "v")  # the API's no-op span takes it
        assert not span.is_recording()
    tracing.inject(headers)
    assert headers == {"x": "1"}
    assert tracing.current_trace_id() == ""
    assert server_interceptors() == [] and client_interceptors() == []


def test_the_sdk_disabled_by_the_environment_stays_off() -> None:
    assert not tracing.configure(True, "hpd-test", env={"OTEL_SDK_DISABLED": "true"})
    assert tracing.exporter() is None and not tracing.enabled()


def test_a_process_that_does_not_trace_never_loads_the_sdk_or_an_exporter() -> None:
    code = (
        "import sys\n"
        "import hpd_gateway.__main__, hpd_scheduler.__main__, hpd_kvbroker.__main__\n"
        "import hpd_registry.__main__, hpd_agent.__main__, hpd_common.server\n"
        "from hpd_common import tracing\n"
        "assert not tracing.configure(False, 'hpd-test')\n"
        "loaded = [m for m in sys.modules if m.startswith(('opentelemetry.sdk',"
        " 'opentelemetry.exporter', 'opentelemetry.proto'))]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


class _Engine:
    """An engine that notes the headers of what it is asked."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.endpoint = ""

    async def answer(self, request: web.Request) -> web.StreamResponse:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if request.query.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
            return resp
        return web.json_response({"ok": True})


@pytest.fixture
async def engine() -> AsyncIterator[_Engine]:
    eng = _Engine()
    app = web.Application()
    app.router.add_post("/v1/completions", eng.answer)
    eng.runner = web.AppRunner(app, access_log=None)
    await eng.runner.setup()
    site = web.TCPSite(eng.runner, "127.0.0.1", 0)
    await site.start()
    eng.endpoint = f"127.0.0.1:{eng.runner.addresses[0][1]}"
    yield eng
    await eng.runner.cleanup()


async def _call_both(engine: _Engine, hop: Hop | None) -> None:
    http = EngineHttp()
    await http.start()
    try:
        assert await http.post_json(engine.endpoint, "/v1/completions", {}, hop=hop) == {"ok": True}
        got = [e async for e in http.stream(engine.endpoint, "/v1/completions?stream=1", {}, hop)]
        assert got == [b'{"choices": [{"text": "a"}]}', None]
    finally:
        await http.close()


async def test_the_engines_get_the_request_id_and_no_trace_context_when_off(
    engine: _Engine,
) -> None:
    await _call_both(engine, Hop("prefill", "req-7", "w1"))
    assert [h.get("x-request-id") for h in engine.headers] == ["req-7", "req-7"]
    assert not [h for h in engine.headers if "traceparent" in h]
    engine.headers.clear()
    await _call_both(engine, None)  # a call for no request: nothing added
    assert not [h for h in engine.headers if "x-request-id" in h or "traceparent" in h]


# -- on ----------------------------------------------------------------------------------------


async def test_on_the_context_crosses_hops_as_w3c_trace_context(engine: _Engine) -> None:
    # no exporter: the spans are made and their context propagates, nothing is sent
    assert tracing.configure(True, "hpd-test", env={"OTEL_TRACES_EXPORTER": "none"})
    assert tracing.configure(True, "another") and tracing.exporter() is None  # idempotent
    assert len(server_interceptors()) == 1 and len(client_interceptors()) == 1
    with tracing.server_span("POST /v1/completions", {"traceparent": TRACEPARENT}) as root:
        assert root.is_recording()
        trace_id = tracing.current_trace_id()
        assert trace_id == TRACEPARENT.split("-")[1]  # the caller's trace, continued
        carrier: dict[str, str] = {}
        tracing.inject(carrier)
        assert carrier["traceparent"].split("-")[1:3] == [
            trace_id,
            f"{root.get_span_context().span_id:016x}",
        ]
        await _call_both(engine, Hop("decode", "req-8", "w2"))
    sent = [h["traceparent"].split("-") for h in engine.headers]
    assert [h["x-request-id"] for h in engine.headers] == ["req-8", "req-8"]
    assert {p[1] for p in sent} == {trace_id}
    assert len({p[2] for p in sent}) == 2  # each call its own client span
    assert tracing.current_trace_id() == ""  # outside the span again


def test_a_decision_is_told_in_aggregates_on_the_schedule_span() -> None:
    assert tracing.configure(True, "hpd-test", env={"OTEL_TRACES_EXPORTER": "none"})
    views = [worker("p1", Stage.PREFILL), worker("d1"), worker("d2"), worker("d3")]
    decided, _ = plan(views)
    refused, _ = plan(views, Request("r2", "no-such-model", 3000, 128, "standard"))
    with tracing.span("schedule") as span:
        note_decision(decided, session="kv-1")
        got = dict(span.attributes or {})  # type: ignore[attr-defined]
    assert decided.plan is not None
    assert got["hpd.decision"] == decided.kind.value
    assert got["hpd.mode"] == decided.plan.mode.value
    assert got["hpd.decode_worker_id"] == decided.plan.decode_worker_id
    assert got["hpd.candidates.decode"] == 3 and got["hpd.kv_session_id"] == "kv-1"
    assert not [k for k in got for w in ("p1", "d1", "d2", "d3") if w in k]  # no per-worker key
    with tracing.span("schedule") as span:
        note_decision(refused)
        got = dict(span.attributes or {})  # type: ignore[attr-defined]
    assert (got["hpd.decision"], got["hpd.reject_class"]) == ("reject", refused.reject_class)
    assert "hpd.mode" not in got


def test_hpd_routes_shows_the_trace_id() -> None:
    traced = s.RouteRecord(request_id="r-1", trace_id=TRACEPARENT.split("-")[1])
    got = dict(zip(HEADERS, rows([traced, s.RouteRecord(request_id="r-2")], 0)[0], strict=True))
    assert got["TRACE"] == TRACEPARENT.split("-")[1]
    assert rows([s.RouteRecord(request_id="r-2")], 0)[0][HEADERS.index("TRACE")] == "-"


# -- layers ------------------------------------------------------------------------------------


def test_only_the_tracing_module_imports_opentelemetry() -> None:
    """Spans and attributes are made at the edges through ``hpd_common.tracing``; the policy
    core and the rest of the services never speak OpenTelemetry."""
    found = set()
    for path in hand_written():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "opentelemetry" for n in names):
                found.add(module_name(path))
    assert found == {"hpd_common.tracing"}, found
