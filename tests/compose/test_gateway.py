"""The stack's front door (compose.yaml's `gateway`), as scripts/compose-e2e.sh brings it
up in its second phase, as shipped, with the `fleet` profile's `engines`: OpenAI
completions, whole and streamed, go through the gateway's published HTTPS port with the
API key the `certs` service made; the gateway plans each in its own process (embedded
mode: a scheduler replica over the stack's Redis, presenting the scheduler certificate to
the broker) and runs it on the emulated engines over HTTP, which it reaches by their
advertised name on the compose network. The route record, read at the scheduler service,
holds the plan and the outcome, and names the gateway's replica, not the service.

Skipped unless HPD_COMPOSE_TLS_DIR and HPD_GATEWAY_ADDR say where the stack is."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common.channels import CallIdentity, sync_channel
from tests.compose.stack import CLIENT_OPTIONS, Stack, tls_dir, wait_until

TLS = tls_dir()
ADDR = os.environ.get("HPD_GATEWAY_ADDR", "")
pytestmark = pytest.mark.skipif(
    not (TLS and ADDR), reason="the stack as shipped with its gateway (compose-e2e.sh, phase 2)"
)

MODEL = "qwen2.5-7b"
"""The model of compose.yaml's `engines` (none other in the stack serves it)."""
TENANT = "local"
"""The tenant of the key `certs` made: the scheduler keys a plan by ``<tenant>:<x-request-id>``."""
MAX_TOKENS = 8


def _ssl() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=f"{TLS}/ca.pem")


def _key() -> str:
    with open(f"{TLS}/gateway-api-key", encoding="utf-8") as f:
        return f.read().strip()


def post(rid: str, body: dict[str, Any], key: str | None = None) -> tuple[int, bytes]:
    """POST /v1/completions through the gateway's published port; (status, body)."""
    req = urllib.request.Request(
        f"https://{ADDR}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "content-type": "application/json",
            "x-request-id": rid,
            "authorization": f"Bearer {_key() if key is None else key}",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30, context=_ssl()) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def completion(stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hello from the compose suite",
                            "max_tokens": MAX_TOKENS}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def events(raw: bytes) -> Iterator[dict[str, Any]]:
    """The JSON events of an SSE body, up to ``[DONE]`` (which must come)."""
    for line in raw.decode().splitlines():
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError(f"the stream ended without [DONE]: {raw[-300:]!r}")


def route_record(rid: str) -> s.RouteRecord:
    """The request's route record once it holds an outcome, read at the scheduler service
    with the operator certificate."""
    ident = CallIdentity(
        "", f"{TLS}/ca.pem", f"{TLS}/role-operator.pem", f"{TLS}/role-operator.key"
    )
    got: list[s.RouteRecord] = []

    def has_outcome() -> bool:
        reply = stub.GetRouteRecord(s.GetRouteRecordRequest(request_id=rid), timeout=3)
        got[:] = [reply.record]
        return bool(reply.record.HasField("outcome"))

    addr = os.environ["HPD_SCHEDULER_ADDR"]
    with sync_channel(addr, ident, options=CLIENT_OPTIONS) as channel:
        stub = s_grpc.SchedulerServiceStub(channel)
        wait_until(f"the outcome of {rid}", has_outcome, timeout_s=20)
    return got[0]


@pytest.fixture(scope="module")
def replica_id(stack: Stack) -> str:
    """The gateway's replica name (`gateway-<its container's host name>`, compose.yaml),
    once the gateway serves: healthy, and a completion answered (its replica has seen the
    engines, which register after the stack is up)."""
    tries = iter(range(10_000))

    def serves() -> bool:
        status, body = post(f"compose-gw-warmup-{next(tries)}", completion(stream=False))
        assert status in (200, 503), (status, body[:300])
        return status == 200

    wait_until("a completion through the gateway", serves, timeout_s=120, every_s=1.0)
    hostname = stack.inspect(stack.container("gateway"))["Config"]["Hostname"]
    return f"gateway-{hostname}"


def check_record(rid: str, replica_id: str, tokens: int) -> None:
    rec = route_record(f"{TENANT}:{rid}")
    assert rec.decision == s.ROUTE_DECISION_PRIMARY, rec
    assert rec.model_id == MODEL
    assert rec.plan.decode_worker_id.startswith("engines-"), rec.plan
    assert rec.plan.decode_endpoint.startswith("engines:"), rec.plan
    if rec.plan.mode == s.EXECUTION_MODE_TRANSFER:
        assert rec.plan.kv_session_id  # the replica opened it as the scheduler
    assert rec.outcome.success, rec.outcome
    assert rec.outcome.output_tokens == tokens
    assert rec.outcome.mode_used != s.EXECUTION_MODE_UNSPECIFIED
    # planned in the gateway's process, not by the scheduler service (its id is
    # <host>:<pid> of the scheduler's container)
    assert rec.scheduler_id == replica_id


def test_a_whole_completion_through_the_gateway(replica_id: str) -> None:
    rid = "compose-gw-" + uuid.uuid4().hex[:10]
    status, raw = post(rid, completion(stream=False))
    assert status == 200, raw[:500]
    body = json.loads(raw)
    assert body["model"] == MODEL
    assert body["choices"][0]["text"].split()  # the engine's tokens
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    check_record(rid, replica_id, MAX_TOKENS)


def test_a_streamed_completion_through_the_gateway(replica_id: str) -> None:
    rid = "compose-gw-" + uuid.uuid4().hex[:10]
    status, raw = post(rid, completion(stream=True))
    assert status == 200, raw[:500]
    got = list(events(raw))
    text = "".join(c["text"] for e in got for c in e["choices"])
    assert text.split(), got  # the engine's tokens, as they came
    usage = [e["usage"] for e in got if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS
    check_record(rid, replica_id, MAX_TOKENS)


def test_the_gateway_wants_the_api_key(replica_id: str) -> None:
    del replica_id  # (it serves)
    status, raw = post("compose-gw-" + uuid.uuid4().hex[:10], completion(False), key="nope" * 5)
    assert status == 401, raw[:300]


@pytest.mark.parametrize("service", ["gateway", "engines"])
def test_container_health_check_passes(stack: Stack, replica_id: str, service: str) -> None:
    """The health check compose.yaml declares (the gateway's HTTPS /health with the stack's
    CA; the engines' ready file), run inside the container by the engine."""
    del replica_id  # (both serve)
    container = stack.container(service)
    if stack.engine == "podman":  # no systemd to schedule checks: one on request
        done = stack.run("healthcheck", "run", container, timeout_s=30)
        assert done.returncode == 0, f"{service}: {done.stdout.strip()} {done.stderr.strip()}"
    else:
        wait_until(
            f"{service} healthy",
            lambda: stack.inspect(container)["State"]["Health"]["Status"] == "healthy",
            timeout_s=60,
        )


def test_the_gateway_metrics_port_is_published(replica_id: str) -> None:
    del replica_id  # (it has served)
    port = os.environ.get("HPD_GATEWAY_METRICS_PORT")
    if not port:
        pytest.skip("metrics port not published by the runner")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    assert "hpd_gateway_requests_total{" in body, body[:500]
