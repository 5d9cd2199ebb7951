"""An outsider at the gateway's public port: no identity, a borrowed tier, slow bodies, idle
connections, a huge prompt, a context overrun, hostile JSON, someone else's request id.

Each test failed on the gateway before its fix (there were no keys, the tier header beat
everything, the concurrency slot was taken before the body was read, tokenizing ran on the
event loop, ``max_tokens`` went to the scheduler unchecked, a handler's exception was a
plain-text 500, a repeated request id replayed the first one's plan)."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from hpd_fleet.tiny_model import train_tokenizer
from hpd_gateway.__main__ import GatewaySettings, make_runner
from hpd_gateway.keys import ApiKeys
from hpd_gateway.metrics import GatewayMetrics
from hpd_gateway.plan import RECOMPUTE
from hpd_gateway.tokens import LocalTokenizers
from tests.support.gateway_rig import COMPLETIONS, MODEL, Rig, open_rig, request_body
from tests.support.gateway_rig import rig as rig

STD = "standard-key-0123456789abcdef"
BOTH = "premium-key-0123456789abcdefg"
SLOW = "slow-tenant-key-0123456789abc"
KEYS = {
    "keys": [
        {"tenant": "acme", "key": STD, "tier": "standard"},
        {"tenant": "beta", "key": BOTH, "tier": "standard", "tiers": ["interactive"]},
        {"tenant": "slow", "key": SLOW, "tier": "standard", "requests_per_s": 0.5,
         "burst": 1, "tokens_per_min": 600},
    ]
}  # fmt: skip


def bearer(key: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **more}


@pytest.fixture
async def keyed() -> AsyncIterator[Rig]:
    async with open_rig(keys=ApiKeys.parse(KEYS, "test")) as rig:
        rig.use(rig.primary(RECOMPUTE, "d1"))
        yield rig


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="no-key"),
        pytest.param(bearer("not-a-key-0123456789abcdef"), id="unknown-key"),
        pytest.param({"Authorization": f"Basic {STD}"}, id="not-bearer"),
    ],
)
async def test_without_a_known_key_it_is_401_and_nothing_is_scheduled(
    keyed: Rig, headers: dict[str, str]
) -> None:
    status, _, body = await keyed.post(COMPLETIONS, request_body(COMPLETIONS), headers)
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    assert keyed.control.scheduled == []


async def test_a_key_gets_only_the_tiers_it_may(keyed: Rig) -> None:
    body = request_body(COMPLETIONS)
    status, _, answer = await keyed.post(
        COMPLETIONS, body, bearer(STD, **{"x-hpd-tier": "interactive"})
    )
    assert status == 403 and answer["error"]["code"] == "tier_not_allowed"
    assert keyed.control.scheduled == []
    assert (await keyed.post(COMPLETIONS, body, bearer(STD)))[0] == 200
    assert (await keyed.post(COMPLETIONS, body, bearer(BOTH, **{"x-hpd-tier": "interactive"})))[
        0
    ] == 200
    tiers = [(rid.split(":")[0], tier) for rid, _, _, _, tier in keyed.control.scheduled]
    assert tiers == [("acme", "standard"), ("beta", "interactive")]
    async with keyed.http.get(keyed.metrics_url) as resp:
        text = await resp.text()
    assert 'hpd_gateway_tenant_requests_total{status="403",tenant="acme"} 1.0' in text
    assert 'hpd_gateway_tenant_requests_total{status="200",tenant="beta"} 1.0' in text


async def test_a_keys_rate_and_token_budget_are_429_with_retry_after(keyed: Rig) -> None:
    body = request_body(COMPLETIONS, max_tokens=100)
    assert (await keyed.post(COMPLETIONS, body, bearer(SLOW)))[0] == 200
    status, headers, answer = await keyed.post(COMPLETIONS, body, bearer(SLOW))
    assert status == 429 and answer["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
    # past its tokens per minute in one request: refused outright
    big = request_body(COMPLETIONS, max_tokens=1000)
    await asyncio.sleep(2.1)  # the request bucket refills (0.5/s)
    status, _, answer = await keyed.post(COMPLETIONS, big, bearer(SLOW))
    assert status == 429 and answer["error"]["code"] == "tokens_per_min"
    # another tenant is not limited by it
    assert (await keyed.post(COMPLETIONS, body, bearer(STD)))[0] == 200


async def test_request_ids_are_namespaced_by_tenant_and_a_duplicate_in_flight_is_409(
    keyed: Rig,
) -> None:
    keyed["d1"].behaviour = "hold"
    body = request_body(COMPLETIONS)
    first = asyncio.create_task(
        keyed.post(COMPLETIONS, body, bearer(STD, **{"x-request-id": "r-1"}))
    )
    await asyncio.wait_for(keyed["d1"].entered.wait(), 5)
    status, _, answer = await keyed.post(COMPLETIONS, body, bearer(STD, **{"x-request-id": "r-1"}))
    assert status == 409 and answer["error"]["code"] == "request_id_in_flight"
    # the same id from another tenant is another request
    other = asyncio.create_task(
        keyed.post(COMPLETIONS, body, bearer(BOTH, **{"x-request-id": "r-1"}))
    )
    await keyed.control.until(lambda: len(keyed.control.scheduled) == 2)
    keyed["d1"].release.set()
    assert (await first)[0] == 200 and (await other)[0] == 200
    assert sorted(rid for rid, *_ in keyed.control.scheduled) == ["acme:r-1", "beta:r-1"]


async def _half_sent(url: str, n: int) -> list[asyncio.StreamWriter]:
    """``n`` connections that sent their headers and part of a body, then went quiet."""
    host, port = url.removeprefix("http://").split(":")
    writers = []
    for _ in range(n):
        _, w = await asyncio.open_connection(host, int(port))
        w.write(
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            'Content-Length: 100000\r\n\r\n{"model": '.encode()
        )
        await w.drain()
        writers.append(w)
    return writers


async def test_slow_bodies_hold_no_place_and_time_out() -> None:
    async with open_rig(max_concurrent=8, body_timeout_s=1.0) as rig:
        rig.use(rig.primary(RECOMPUTE, "d1"))
        slow = await _half_sent(rig.url, 40)  # five times the gateway's places
        try:
            for _ in range(3):  # a normal client is served meanwhile (it was 429)
                status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS))
                assert status == 200
            # a body that never comes is answered 408 once its deadline passes
            host, port = rig.url.removeprefix("http://").split(":")
            r, w = await asyncio.open_connection(host, int(port))
            w.write(
                f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{{".encode()
            )
            await w.drain()
            line = await asyncio.wait_for(r.readline(), 10)
            w.close()
            assert b" 408 " in line, line
        finally:
            for w in slow:
                w.close()


async def test_idle_connections_are_closed_and_past_the_cap_refused() -> None:
    settings = GatewaySettings(keepalive_timeout_s=0.5, max_connections=5)
    metrics = GatewayMetrics(CollectorRegistry())
    app = web.Application()

    async def ok(request: web.Request) -> web.Response:
        del request
        return web.json_response({"ok": True})

    app.router.add_get("/ok", ok)
    runner = await make_runner(app, settings, metrics)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        conns = [await asyncio.open_connection(host, port) for _ in range(5)]
        # the sixth is closed at once: reading it ends without an answer
        r6, w6 = await asyncio.open_connection(host, port)
        w6.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(r6.read(), 5) == b""
        # a connection that served a request and then idles is closed after the keep-alive
        r, w = conns[0]
        w.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        await w.drain()
        answer = await asyncio.wait_for(r.read(), 5)  # to EOF: the server closed it
        assert answer.startswith(b"HTTP/1.1 200")
        refused = metrics.registry.get_sample_value(
            "hpd_gateway_refused_total", {"reason": "connection_cap"}
        )
        assert refused == 1.0
        for _, w in conns:
            w.close()
    finally:
        await runner.cleanup()


async def test_a_huge_prompt_is_tokenized_off_the_event_loop(tmp_path: Path) -> None:
    train_tokenizer(tmp_path)
    tokenizers = LocalTokenizers({MODEL: str(tmp_path)})
    prompt = (
        "the quick brown fox jumps over the lazy dog " * 20_000
    )  # ~0.9 MB, under the fake engine's body limit
    t0 = time.perf_counter()
    tokenizers.count(MODEL, {"prompt": prompt})
    alone_s = time.perf_counter() - t0
    async with open_rig() as rig:
        rig.use(rig.primary(RECOMPUTE, "d1"))
        rig.control.tokenizers = ["x"]  # an endpoint exists: the local tokenizer counts
        assert rig.gateway is not None
        rig.gateway.tokenizers = tokenizers
        longest = 0.0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal longest
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                longest = max(longest, now - last)
                last = now

        tick = asyncio.create_task(ticker())
        status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS, prompt=prompt))
        done.set()
        await tick
    assert status == 200
    # the loop kept turning while the prompt was encoded: its longest pause is a fraction
    # of the encoding's own time (it was the whole of it before)
    assert longest < max(0.05, alone_s / 2), (longest, alone_s)


async def test_max_tokens_past_the_models_context_reserves_only_what_fits(rig: Rig) -> None:
    """``max_tokens`` of 2^20 used to become a whole KV reservation: now the plan is for what
    the context leaves after the prompt (vLLM clamps the generation the same way), and a
    prompt that fills the context is 400 before anything is planned."""
    rig.use(rig.primary(RECOMPUTE, "d1"))
    rig.control.context = 100
    status, _, _ = await rig.post(COMPLETIONS, request_body(COMPLETIONS, max_tokens=1 << 20))
    assert status == 200
    (_, _, prompt, planned, _), *_ = rig.control.scheduled
    assert planned == 100 - prompt
    rig.control.context = prompt  # the prompt alone fills it
    status, _, body = await rig.post(COMPLETIONS, request_body(COMPLETIONS, max_tokens=4))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert len(rig.control.scheduled) == 1


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"model": "tiny", "prompt": "a \\ud800 b"}', id="lone-surrogate"),
        pytest.param(b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * 10_000
                     + b"]" * 10_000 + b"}", id="10000-deep"),
    ],
)  # fmt: skip
async def test_hostile_json_is_an_openai_shaped_400(rig: Rig, raw: bytes) -> None:
    rig.use(rig.primary(RECOMPUTE, "d1"))
    status, headers, body = await rig.post(COMPLETIONS, raw, {"Content-Type": "application/json"})
    assert status == 400, body
    assert headers["Content-Type"].startswith("application/json")
    assert set(cast(dict[str, Any], body)["error"]) == {"message", "type", "param", "code"}
    assert rig.control.scheduled == []


async def test_a_handlers_own_failure_is_an_openai_shaped_500(rig: Rig) -> None:
    def boom(model: str) -> int:
        raise RuntimeError("a bug")

    rig.control.context_tokens = boom  # type: ignore[method-assign]
    rig.use(rig.primary(RECOMPUTE, "d1"))
    async with rig.http.post(rig.url + COMPLETIONS, json=request_body(COMPLETIONS)) as resp:
        assert resp.status == 500
        body = json.loads(await resp.text())
    assert body["error"]["type"] == "server_error"


async def test_metrics_are_not_on_the_public_port(rig: Rig) -> None:
    async with rig.http.get(rig.url + "/metrics") as resp:
        assert resp.status == 404
    async with rig.http.get(rig.metrics_url) as resp:
        assert resp.status == 200


async def test_every_error_of_the_public_port_is_openai_shaped(rig: Rig) -> None:
    async with aiohttp.ClientSession() as http, http.put(rig.url + COMPLETIONS) as resp:
        assert resp.status in (404, 405)
        body = await resp.json()
    assert "error" in body


def test_gateway_key_adds_a_hashed_key_the_gateway_accepts(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    hpd = Path(sys.executable).parent / "hpd"
    done = subprocess.run(
        [str(hpd), "gateway-key", "--file", str(path), "--tenant", "acme", "--tier", "standard",
         "--requests-per-s", "5"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    key = done.stdout.strip()
    assert key and key not in path.read_text()  # only its hash is stored
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    found = ApiKeys.load(path).lookup(key)
    assert found is not None and found.tenant == "acme" and found.tier == "standard"
