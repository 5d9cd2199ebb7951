"""`hpd gateway` over HTTP in front of fake engines (`tests/support/gateway_rig.py`): errors
before any engine runs, tiers, the other routes, a client that hangs up, and the mends these
tests found."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from hpd_common.kvchain import chain_hashes
from hpd_gateway.plan import RECOMPUTE, TRANSFER
from hpd_gateway.protocol import GatewayError
from hpd_gateway.service import GatewayConfig
from tests.support.gateway_rig import (
    CHAT,
    COMPLETIONS,
    MODEL,
    PROMPT_TOKENS,
    Rig,
    closed_port,
    fallback,
    open_rig,
    request_body,
)
from tests.support.gateway_rig import (
    rig as rig,
)

# -- errors before any engine runs -------------------------------------------------------------

SCHEDULER_REFUSALS = [
    pytest.param(GatewayError(429, "the fleet is saturated", type_="rate_limit_error",
                              code="rate_limited", retry_after_s=1), id="saturated-429"),
    pytest.param(GatewayError(503, "the control plane is unavailable", type_="server_error",
                              code="unavailable", retry_after_s=1), id="unavailable-503"),
    pytest.param(GatewayError(504, "the scheduler did not answer in time",
                              type_="server_error"), id="deadline-504"),
    pytest.param(GatewayError(404, "no worker", code="model_not_found", param="model"),
                 id="no-worker-404"),
]  # fmt: skip


@pytest.mark.parametrize("refusal", SCHEDULER_REFUSALS)
async def test_a_scheduler_refusal_is_answered_in_openai_shape(
    rig: Rig, refusal: GatewayError
) -> None:
    rig.control.schedule_error = refusal
    status, headers, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert status == refusal.status
    assert answer == refusal.body()
    if refusal.retry_after_s:
        assert headers["Retry-After"] == str(refusal.retry_after_s)
    else:
        assert "Retry-After" not in headers
    assert rig["d1"].calls == rig["d2"].calls == []
    assert len(rig.control.scheduled) == 1
    await asyncio.sleep(0.01)
    assert rig.control.reports == []  # nothing was planned: nothing to report


async def test_an_unknown_model_is_404_naming_the_model(rig: Rig) -> None:
    rig.use(rig.primary(RECOMPUTE, "d1"))
    status, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS, model="nope"))
    assert status == 404
    assert answer["error"]["param"] == "model"
    assert answer["error"]["code"] == "model_not_found"
    assert rig.control.scheduled == []
    assert rig["p1"].calls == []


@pytest.mark.parametrize(
    ("behaviour", "status", "code"),
    [
        pytest.param("error500", 502, "upstream_error", id="tokenizer-5xx"),
        pytest.param("error4xx", 400, "invalid_value", id="tokenizer-4xx"),
    ],
)
async def test_a_tokenizer_failure_stops_before_scheduling(
    rig: Rig, behaviour: str, status: int, code: str
) -> None:
    rig["p1"].tokenize_behaviour = behaviour
    rig.control.tokenizers = [closed_port(), rig["p1"].endpoint]
    rig.use(rig.primary(RECOMPUTE, "d1"))
    got, _, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert (got, answer["error"]["code"]) == (status, code)
    assert rig.control.scheduled == []
    assert [path for path, _ in rig["p1"].calls] == ["/tokenize"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        pytest.param(COMPLETIONS, b'{"model": "tiny", "prompt": ', "body", id="malformed-json"),
        pytest.param(COMPLETIONS, b"[]", "body", id="not-an-object"),
        pytest.param(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens",
                     id="max-tokens-zero"),
        pytest.param(COMPLETIONS, {"model": MODEL}, "prompt", id="prompt-missing"),
        pytest.param(CHAT, {"model": MODEL, "messages": [{"content": "x"}]}, "messages[0].role",
                     id="chat-role-missing"),
        pytest.param(CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                            "kv_transfer_params": {}}, "kv_transfer_params",
                     id="client-kv-transfer-params"),
    ],
)  # fmt: skip
async def test_a_bad_body_is_400_naming_the_field(
    rig: Rig, path: str, body: dict[str, Any] | bytes, param: str
) -> None:
    status, headers, answer = await rig.post(path, body, {"x-request-id": "bad-1"})
    assert status == 400
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == "invalid_request_error"
    assert headers["x-request-id"] == "bad-1"
    assert rig.control.scheduled == []
    assert rig["p1"].calls == []


async def test_a_body_over_the_limit_is_413() -> None:
    async with open_rig(max_body_bytes=1024) as rig:
        rig.use(rig.primary(RECOMPUTE, "d1"))
        status, _, answer = await rig.post(
            COMPLETIONS, request_body(COMPLETIONS, prompt="x" * 2048)
        )
        assert status == 413
        assert (answer["error"]["param"], answer["error"]["code"]) == ("body", "body_too_large")
        assert rig["p1"].calls == []
        # a body under the limit is served
        status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 200


async def test_requests_past_max_concurrent_are_429() -> None:
    async with open_rig(max_concurrent=1) as rig:
        rig["d1"].behaviour = "hold"
        rig.use(rig.primary(RECOMPUTE, "d1"))
        first = asyncio.create_task(rig.post(COMPLETIONS, request_body(COMPLETIONS)))
        await asyncio.wait_for(rig["d1"].entered.wait(), 2)
        status, headers, answer = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 429
        assert headers["Retry-After"] == "1"
        assert answer["error"]["type"] == "rate_limit_error"
        assert len(rig.control.scheduled) == 1
        rig["d1"].release.set()
        status, _, _ = await asyncio.wait_for(first, 2)
        assert status == 200
        # the slot is free again
        status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 200


# -- tiers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "tier"),
    [
        pytest.param({}, "bronze", id="default"),
        pytest.param({"x-hpd-tier": "premium"}, "premium", id="header"),
    ],
)  # fmt: skip
async def test_without_api_keys_the_tier_comes_from_the_header_then_the_default(
    headers: dict[str, str], tier: str
) -> None:
    """(With --api-keys the key decides what a header may ask for: tests/security.)"""
    async with open_rig(config=GatewayConfig(default_tier="bronze")) as rig:
        rig.use(rig.primary(RECOMPUTE, "d1"))
        status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS), headers)
        assert status == 200
        assert rig.control.scheduled[0][4] == tier


# -- the other routes --------------------------------------------------------------------------


async def test_models_lists_the_fleets_models(rig: Rig) -> None:
    async with rig.http.get(rig.url + "/v1/models") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [(MODEL, "model")]


@pytest.mark.parametrize(
    ("age_s", "status"),
    [
        pytest.param(0.25, 200, id="fresh"),
        pytest.param(30.0, 503, id="stale"),
        pytest.param(float("inf"), 503, id="never-synced"),
    ],
)
async def test_health_follows_the_fleet_views_age(rig: Rig, age_s: float, status: int) -> None:
    rig.control.fleet.age = age_s
    async with rig.http.get(rig.url + "/health") as resp:
        assert resp.status == status
        body = await resp.json()
    if status == 200:
        assert body == {"status": "ok", "fleet_age_s": age_s}
    else:
        assert body["error"]["code"] == "unavailable"


async def test_metrics_count_requests(rig: Rig) -> None:
    rig.use(rig.primary(RECOMPUTE, "d1"))
    status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
    assert status == 200
    async with rig.http.get(rig.metrics_url) as resp:
        assert resp.status == 200
        text = await resp.text()
    assert 'hpd_gateway_requests_total{mode="recompute",status="200"} 1.0' in text


async def test_an_unknown_route_is_404_in_openai_shape(rig: Rig) -> None:
    status, _, answer = await rig.post("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404
    assert answer["error"]["code"] == "not_found"


# -- client hang-up ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [RECOMPUTE, TRANSFER])
async def test_a_client_hanging_up_cancels_the_engine_request(rig: Rig, mode: str) -> None:
    rig["d1"].behaviour = "hang"
    rig.use(rig.primary(mode, "d1", "p1" if mode == TRANSFER else ""))
    url = rig.url + COMPLETIONS
    async with rig.http.post(url, json=request_body(COMPLETIONS, stream=True)) as resp:
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readline(), 2)
        assert first.startswith(b"data: ")
        assert "d1-0" in json.loads(first[len(b"data: ") :])["choices"][0]["text"]
        resp.close()
    await asyncio.wait_for(rig["d1"].cancelled.wait(), 2)
    out = await rig.control.outcome()
    assert out.success is False
    assert rig["d2"].calls == []


# -- mends found by these tests ---------------------------------------------------------------


async def test_a_session_whose_kv_arrived_is_not_failed_by_a_later_drop(rig: Rig) -> None:
    rig["d1"].behaviour = "drop"
    rig["d1"].tokens = 5
    rig.use(rig.primary(TRANSFER, "d1", "p1"), fallback(RECOMPUTE, "d2"))
    await rig.stream(COMPLETIONS, request_body(COMPLETIONS, stream=True))
    await rig.control.outcome()
    await rig.control.until(lambda: bool(rig.control.done))
    await asyncio.sleep(0.05)
    assert rig.control.failed == []


async def test_retry_after_is_the_refusals_own() -> None:
    async with open_rig() as rig:
        rig.control.schedule_error = GatewayError(429, "busy", retry_after_s=5)
        status, headers, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
        assert status == 429 and headers["Retry-After"] == "5"


async def test_the_engines_get_the_model_id_that_was_scheduled(rig: Rig) -> None:
    rig.use(rig.primary(RECOMPUTE, "d1"))
    status, _, _ = await rig.post(COMPLETIONS, {**request_body(COMPLETIONS), "model": f" {MODEL} "})
    assert status == 200
    assert rig["d1"].generations[-1]["model"] == MODEL


async def test_the_prompts_block_chain_goes_with_the_schedule(rig: Rig) -> None:
    """The engine's /tokenize gives the prompt's token ids; keyed at the fleet's KV block
    size they travel with Schedule, so the scheduler can plan on the engine holding them."""
    rig.use(rig.primary(TRANSFER, "d1", "p1"))
    rig.control.block = 3
    status, _, _ = await rig.post("/v1/completions", request_body("/v1/completions"))
    assert status == 200
    [(prefix, block)] = rig.control.prefixes
    assert block == 3
    assert prefix == chain_hashes(list(range(PROMPT_TOKENS)), 3)  # 7 tokens: 2 full blocks
    # no known block size: no chain (and nothing else changes)
    rig.control.block = 0
    status, _, _ = await rig.post("/v1/completions", request_body("/v1/completions"))
    assert status == 200 and rig.control.prefixes[-1] == ((), 0)


async def test_a_token_id_prompt_is_counted_as_sent_without_a_tokenize_call(rig: Rig) -> None:
    """Token ids need no tokenizer: the gateway counts them and keys their blocks itself,
    with no round trip to an engine's /tokenize."""
    rig.use(rig.primary(TRANSFER, "d1", "p1"))
    rig.control.block = 4
    ids = list(range(100, 110))
    body = {**request_body(COMPLETIONS), "prompt": ids}
    status, _, _ = await rig.post(COMPLETIONS, body)
    assert status == 200
    assert "/tokenize" not in [path for path, _ in rig["p1"].calls]
    assert rig.control.scheduled[-1][2] == len(ids)
    assert rig.control.prefixes[-1] == (chain_hashes(ids, 4), 4)


@pytest.mark.parametrize(
    ("mode", "streamed"), [(TRANSFER, False), (TRANSFER, True), (RECOMPUTE, True)]
)
async def test_the_answer_says_where_the_gateways_own_time_went(
    rig: Rig, mode: str, streamed: bool
) -> None:
    """A W3C Server-Timing header carries the gateway's tokenize and schedule steps (and a
    transfer's prefill call) in milliseconds; the metrics count the same steps."""
    primary = rig.primary(TRANSFER, "d1", "p1") if mode == TRANSFER else rig.primary(mode, "d1")
    rig.use(primary)
    body = request_body(COMPLETIONS, stream=streamed)
    async with rig.http.post(rig.url + COMPLETIONS, json=body) as resp:
        assert resp.status == 200
        header = resp.headers["Server-Timing"]
        await resp.read()
    steps = {}
    for part in header.split(", "):
        name, dur = part.split(";dur=")
        steps[name] = float(dur)
    expected = {"tokenize", "schedule"} | ({"prefill"} if mode == TRANSFER else set())
    assert set(steps) == expected, header
    assert all(v >= 0 for v in steps.values())
    assert steps.get("prefill", 1.0) > 0
    async with rig.http.get(rig.metrics_url) as resp:
        text = await resp.text()
    assert 'hpd_gateway_phase_seconds_count{phase="schedule"} 1.0' in text
    assert 'hpd_gateway_phase_seconds_count{phase="tokenize"} 1.0' in text
