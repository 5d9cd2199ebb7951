"""The emulated fleet speaks the engines' HTTP protocol (``hpd_fleet.engine_http``), and
``hpd gateway`` (its whole assembly, ``GatewayServer``) runs plans on it exactly as on real
vLLM engines: NIXL-style ``kv_transfer_params`` hand-offs, recompute, vLLM's metric names,
a stream cut by a crash, the fallback chain when decode dies during the prefill."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client import CollectorRegistry

from hetero_pd.v1 import kvbroker_pb2 as kb
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_agent.engines import parse_metrics
from hpd_common.clock import SystemClock
from hpd_fleet.demo_run import wait_fleet_seen
from hpd_fleet.engine import EmuTime
from hpd_fleet.engine_http import FleetHttp
from hpd_fleet.fleet import Fleet
from hpd_gateway.__main__ import GatewayServer, GatewaySettings
from hpd_sim.cluster import parse_cluster
from hpd_tools.controlplane import ControlPlane
from tests.support.servers import external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]

MODEL = "llama-3-8b"


def cluster(*pools: dict[str, Any]) -> Any:
    return parse_cluster(
        {
            "name": "http-test",
            "model": MODEL,
            "defaults": {"memory_fraction": 0.9, "max_batch_size": 64, "nic_gbps": 200},
            "pools": list(pools),
            "links": {"classes": {"same_zone": {"gbps": 200, "latency_ms": 0.2}}},
        }
    )


H100_PREFILL = {"id": "h100-p", "gpu": "H100-SXM", "count": 1, "tp": 1, "stage": "prefill",
                "zone": "a", "rack": "a1"}  # fmt: skip
A100_DECODE = {"id": "a100-d", "gpu": "A100-80G", "count": 2, "tp": 1, "stage": "decode",
               "zone": "a", "rack": "a2"}  # fmt: skip
L40S_FP8 = {"id": "l40s-fp8", "gpu": "L40S", "count": 1, "tp": 1, "stage": "decode", "zone": "a",
            "rack": "a3", "kv": {"dtype": "fp8_e4m3"}}  # fmt: skip


@dataclass
class Stack:
    plane: ControlPlane
    fleet: Fleet
    http: FleetHttp
    gateway: GatewayServer
    url: str
    scheduler: s_grpc.SchedulerServiceStub
    broker: kb_grpc.KvBrokerServiceStub

    async def record(self, rid: str) -> s.RouteRecord:
        for _ in range(100):  # the outcome is reported after the answer
            with contextlib.suppress(grpc.aio.AioRpcError):
                got = await self.scheduler.GetRouteRecord(
                    s.GetRouteRecordRequest(request_id=rid), timeout=2
                )
                rec: s.RouteRecord = got.record
                if rec.HasField("outcome"):
                    return rec
            await asyncio.sleep(0.05)
        raise AssertionError(f"no outcome for {rid}")

    async def metrics(self, worker_id: str) -> dict[str, float]:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://{self.http.endpoint(worker_id)}/metrics") as resp,
        ):
            text = await resp.text()
        out: dict[str, float] = {}
        for series in parse_metrics(text):
            key = series.name + "".join(f"[{v}]" for k, v in sorted(series.labels.items())
                                         if k == "source")  # fmt: skip
            out[key] = out.get(key, 0.0) + series.value
        return out


@contextlib.asynccontextmanager
async def stack(plane: ControlPlane, *pools: dict[str, Any], scale: float = 1.0,
                embedded: bool = False) -> AsyncIterator[Stack]:  # fmt: skip
    """The plane, the emulated fleet over HTTP and a gateway planning at the plane's
    scheduler service, or (``embedded``) in its own process over the plane's Redis."""
    chans = [grpc.aio.insecure_channel(t) for t in
             (plane.registry_target, plane.kvbroker_target, plane.scheduler_target)]  # fmt: skip
    emu = EmuTime(scale, time.monotonic, asyncio.sleep, start=time.monotonic())
    fleet = Fleet(cluster(*pools), chans[0], chans[1], emu, SystemClock(), random.Random(3))
    http = FleetHttp(fleet)
    await http.start()
    await fleet.start()
    config = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)  # noqa: SIM115
    with config:
        config.write(f"key_prefix: {plane.settings.key_prefix}\n")
    where: dict[str, Any] = (
        {"redis_url": plane.settings.redis_url, "scheduler_config": config.name}
        if embedded
        else {"scheduler": plane.scheduler_target}
    )
    gw = GatewayServer(
        GatewaySettings(
            port=0, broker=plane.kvbroker_target, registry=plane.registry_target, **where
        ),
        clock=lambda: emu.now_ms() / 1000.0,
        metrics_registry=CollectorRegistry(),
    )  # fmt: skip
    try:
        url = await gw.start()
        deadline = time.monotonic() + 10
        while len(gw.control.fleet.workers) < len(fleet.workers):
            assert time.monotonic() < deadline, "the gateway never saw the fleet"
            await asyncio.sleep(0.05)
        # and the scheduler plans on it: every worker in its view with a load report
        await wait_fleet_seen(plane, list(fleet.workers), timeout_s=10)
        here = gw.control.embedded
        while here is not None and not all(
            w in here.service.informer.workers and here.service.informer.workers[w].load
            for w in fleet.workers
        ):  # the gateway's own replica too
            assert time.monotonic() < deadline + 10, "the embedded replica never saw the fleet"
            await asyncio.sleep(0.05)
        if here is not None:
            here.service.rebuild()
        yield Stack(
            plane, fleet, http, gw, url, s_grpc.SchedulerServiceStub(chans[2]),
            kb_grpc.KvBrokerServiceStub(chans[1]),
        )  # fmt: skip
    finally:
        await gw.stop()
        await fleet.stop()
        await http.stop()
        for ch in chans:
            await ch.close()
        os.unlink(config.name)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


async def stream(url: str, body: dict[str, Any], rid: str) -> tuple[int, list[Any]]:
    """POST a streamed request; returns the status and the events (the last may be an
    error object, or the string ``[DONE]``)."""
    events: list[Any] = []
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/v1/completions", json={**body, "stream": True}, headers={"x-request-id": rid}
        ) as resp,  # fmt: skip
    ):
        if resp.status != 200:
            return resp.status, [await resp.json()]
        with contextlib.suppress(aiohttp.ClientPayloadError):
            async for line in resp.content:
                if line.startswith(b"data: "):
                    data = line[6:].strip()
                    events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return resp.status, events


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
async def test_a_transfer_runs_the_nixl_hand_off_on_emulated_engines(
    plane: ControlPlane, embedded: bool
) -> None:
    """In both modes (the gateway planning at the scheduler service, or in its own process):
    the same hand-off, the same record and outcome at the service, the same KV session."""
    async with stack(plane, H100_PREFILL, A100_DECODE, embedded=embedded) as st:
        rid = "http-transfer-1"
        status, events = await stream(
            st.url, {"model": MODEL, "prompt": prompt(2000), "max_tokens": 12}, rid
        )
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        tokens = [e for e in events if isinstance(e, dict) and e.get("choices")
                  and e["choices"][0].get("text")]  # fmt: skip
        assert len(tokens) == 12
        rec = await st.record(rid)
        # planned by the gateway's own replica, or by the service ("demo" in hpd up's wiring)
        assert (rec.scheduler_id != plane.settings.scheduler_id) is embedded, rec.scheduler_id
        assert rec.plan.mode == s.EXECUTION_MODE_TRANSFER, rec.plan
        assert rec.outcome.success and rec.outcome.mode_used == s.EXECUTION_MODE_TRANSFER
        assert rec.outcome.ttft_ms > 0 and rec.outcome.tpot_ms > 0
        dec = await st.metrics(rec.plan.decode_worker_id)
        assert dec["vllm:prompt_tokens_by_source_total[external_kv_transfer]"] == 2000
        assert dec["vllm:prompt_tokens_by_source_total[local_compute]"] == 0
        assert dec["vllm:nixl_bytes_transferred_total"] > 0
        pre = await st.metrics(rec.plan.prefill_worker_id)
        assert pre["vllm:prompt_tokens_by_source_total[local_compute]"] == 2000
        # the broker's session followed what happened
        got = await st.broker.GetSession(
            kb.GetSessionRequest(session_id=rec.plan.kv_session_id), timeout=2
        )
        assert got.session.state == kb.SESSION_STATE_COMPLETE, got.session
        # and the KV is back: nothing held on either engine
        for wid in (rec.plan.prefill_worker_id, rec.plan.decode_worker_id):
            assert st.fleet.workers[wid].engine.used_tokens == 0


async def test_a_pool_that_cannot_take_the_kv_gets_a_recompute(plane: ControlPlane) -> None:
    async with stack(plane, H100_PREFILL, L40S_FP8) as st:
        rid = "http-recompute-1"
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                st.url + "/v1/chat/completions",
                headers={"x-request-id": rid},
                json={
                    "model": MODEL,
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "why recompute " * 100}],
                },
            ) as resp,  # fmt: skip
        ):
            body = await resp.json()
        assert resp.status == 200, body
        assert body["usage"]["completion_tokens"] == 5
        assert "kv_transfer_params" not in body
        rec = await st.record(rid)
        assert rec.plan.mode == s.EXECUTION_MODE_RECOMPUTE, rec.plan
        dec = await st.metrics(rec.plan.decode_worker_id)
        assert dec["vllm:prompt_tokens_by_source_total[external_kv_transfer]"] == 0
        assert dec["vllm:prompt_tokens_by_source_total[local_compute]"] == 204  # 200 + template
        pre = await st.metrics("h100-p-0")
        assert pre["vllm:prompt_tokens_by_source_total[local_compute]"] == 0  # never asked


async def test_a_decode_engine_killed_mid_stream_ends_the_stream_with_an_error(
    plane: ControlPlane,
) -> None:
    async with stack(plane, H100_PREFILL, A100_DECODE) as st:
        rid = "http-kill-stream"
        task = asyncio.create_task(
            stream(st.url, {"model": MODEL, "prompt": prompt(300), "max_tokens": 4000}, rid)
        )
        plan = None
        deadline = asyncio.get_running_loop().time() + 20
        while asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(grpc.aio.AioRpcError):
                plan = (await st.scheduler.GetRouteRecord(
                    s.GetRouteRecordRequest(request_id=rid), timeout=1)).record.plan  # fmt: skip
                if st.fleet.workers[plan.decode_worker_id].engine._batch:
                    break  # decoding now
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the request never started decoding")
        assert plan is not None
        await st.fleet.kill(plan.decode_worker_id)
        status, events = await asyncio.wait_for(task, 20)
        assert status == 200 and events[-1] == "[DONE]"
        last = events[-2]
        assert isinstance(last, dict) and last["error"]["type"] == "server_error", last
        tokens = [e for e in events[:-2] if isinstance(e, dict) and e.get("choices")]
        assert 1 <= len(tokens) < 4000  # cut short, and never restarted from the top
        rec = await st.record(rid)
        assert not rec.outcome.success and rec.outcome.error_class.startswith("decode_")


async def test_a_decode_engine_killed_during_the_prefill_falls_back(plane: ControlPlane) -> None:
    # emulated time runs 20x slower than wall time: the prefill takes long enough to act in
    async with stack(plane, H100_PREFILL, A100_DECODE, scale=0.05) as st:
        rid = "http-kill-prefill"
        pre = st.fleet.workers["h100-p-0"].engine
        task = asyncio.create_task(
            stream(st.url, {"model": MODEL, "prompt": prompt(6000), "max_tokens": 3}, rid)
        )
        for _ in range(400):
            if pre._running_prefill:
                break
            await asyncio.sleep(0.01)
        assert pre._running_prefill, "the prefill never started"
        plan = (await st.scheduler.GetRouteRecord(
            s.GetRouteRecordRequest(request_id=rid), timeout=1)).record.plan  # fmt: skip
        assert plan.mode == s.EXECUTION_MODE_TRANSFER
        await st.fleet.kill(plan.decode_worker_id)
        status, events = await asyncio.wait_for(task, 60)
        assert status == 200 and events[-1] == "[DONE]", events[-2:]
        rec = await st.record(rid)
        assert rec.outcome.success, rec.outcome
        assert rec.outcome.error_class.startswith("decode_"), rec.outcome  # why it fell back
