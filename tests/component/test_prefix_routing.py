"""Prefix-aware routing through the real services: an engine's KV events go to the
registry (``ReportKvEvents``), into the feed the scheduler follows, into its prefix index;
a ``Schedule`` carrying the prompt's block chain then plans prefill on the worker that
holds the longest prefix, with the cached tokens left out (``cached_tokens`` in the plan
and the route record). Also the feed's refusals, and the index forgetting a worker that
leaves."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import zmq
import zmq.asyncio

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_agent.agent import Agent, AgentTiming
from hpd_agent.capability import AgentFlags
from hpd_agent.engines import VllmAdapter
from hpd_common.clock import SystemClock
from hpd_scheduler.policy.prefix import chain_hashes
from hpd_tools.controlplane import ControlPlane
from hpd_tools.embedded_redis import free_port
from tests.component.test_registry_api import code_of
from tests.support.fleet import capability, load
from tests.support.servers import external

pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]
BLOCK = 128
PROMPT = list(range(5000, 5600))  # 600 tokens: 4 full blocks
CHAIN = chain_hashes(PROMPT, BLOCK)


async def _register(stub: r_grpc.RegistryServiceStub, wid: str, **kw: Any) -> str:
    resp = await stub.RegisterWorker(
        r.RegisterWorkerRequest(capability=capability(wid, **kw), lease_ttl_ms=60_000), timeout=5
    )
    await stub.Heartbeat(
        r.HeartbeatRequest(worker_id=wid, credential=resp.credential, load=load()), timeout=5
    )
    return str(resp.credential)


def _stored(keys: tuple[int, ...], from_start: bool = True) -> r.KvCacheEvent:
    blocks = r.KvBlocks(block_hashes=list(keys), from_prompt_start=from_start)
    return r.KvCacheEvent(stored=blocks)


async def _schedule(stub: s_grpc.SchedulerServiceStub, rid: str, **kw: Any) -> s.RoutePlan:
    req = s.ScheduleRequest(
        request_id=rid, model_id="llama-3-8b", prompt_tokens=600, expected_output_tokens=20,
        prefix_block_hashes=list(CHAIN), prefix_block_tokens=BLOCK, **kw,
    )  # fmt: skip
    for _ in range(100):
        try:
            plan: s.RoutePlan = (await stub.Schedule(req, timeout=5)).plan
            return plan
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("never planned")


async def test_the_worker_holding_the_prefix_gets_the_prefill(plane: ControlPlane) -> None:
    async with (
        grpc.aio.insecure_channel(plane.registry_target) as rch,
        grpc.aio.insecure_channel(plane.scheduler_target) as sch,
    ):
        reg, sched = r_grpc.RegistryServiceStub(rch), s_grpc.SchedulerServiceStub(sch)
        # two identical prefill workers and one decode worker; "pfx-p1" sorts first, so a
        # tie would go to it
        creds = {
            wid: await _register(reg, wid, pool_id="h100-prefill", stages=(c.STAGE_PREFILL,))
            for wid in ("pfx-p1", "pfx-p2")
        }
        await _register(reg, "pfx-d", pool_id="a100-decode", stages=(c.STAGE_DECODE,),
                        gpu="A100-80G")  # fmt: skip
        cold = await _schedule(sched, "pfx-cold")
        assert cold.cached_tokens == 0
        # p2's engine stored the prompt's first three blocks (a previous request shared them)
        cred = creds["pfx-p2"]
        got = await reg.ReportKvEvents(
            r.ReportKvEventsRequest(
                worker_id="pfx-p2", credential=cred, block_tokens=BLOCK,
                events=[_stored(CHAIN[:3])],
            ),
            timeout=5,
        )  # fmt: skip
        assert got.accepted == 1
        for i in range(50):  # the scheduler follows the feed within a moment
            plan = await _schedule(sched, f"pfx-warm-{i}")
            if plan.cached_tokens:
                break
            await asyncio.sleep(0.05)
        assert plan.prefill_worker_id == "pfx-p2"
        assert plan.cached_tokens == 3 * BLOCK
        rec = await sched.GetRouteRecord(
            s.GetRouteRecordRequest(request_id=plan.request_id), timeout=5
        )
        assert rec.record.plan.cached_tokens == 3 * BLOCK
        # the engine evicts the second block: the usable prefix is one block now, and the
        # block size must match the request's for any of it to count
        await reg.ReportKvEvents(
            r.ReportKvEventsRequest(
                worker_id="pfx-p2", credential=cred, block_tokens=BLOCK,
                events=[r.KvCacheEvent(removed=r.KvBlocks(block_hashes=[CHAIN[1]]))],
            ),
            timeout=5,
        )  # fmt: skip
        for i in range(50):
            plan = await _schedule(sched, f"pfx-evicted-{i}")
            if plan.cached_tokens != 3 * BLOCK:
                break
            await asyncio.sleep(0.05)
        assert plan.cached_tokens in (0, BLOCK)
        assert plan.prefill_worker_id == "pfx-p2" or plan.cached_tokens == 0


async def test_the_feed_refuses_strangers_and_bad_batches(plane: ControlPlane) -> None:
    async with grpc.aio.insecure_channel(plane.registry_target) as rch:
        reg = r_grpc.RegistryServiceStub(rch)
        cred = await _register(reg, "pfx-x", pool_id="h100-prefill", stages=(c.STAGE_PREFILL,))

        async def code(req: r.ReportKvEventsRequest) -> grpc.StatusCode:
            return await code_of(reg.ReportKvEvents(req, timeout=5))

        ok = r.ReportKvEventsRequest(
            worker_id="pfx-x", credential=cred, block_tokens=BLOCK, events=[_stored(CHAIN)]
        )
        assert await code(ok) == grpc.StatusCode.OK
        wrong = r.ReportKvEventsRequest()
        wrong.CopyFrom(ok)
        wrong.credential = "not-it"
        assert await code(wrong) == grpc.StatusCode.PERMISSION_DENIED
        nobody = r.ReportKvEventsRequest()
        nobody.CopyFrom(ok)
        nobody.worker_id = "pfx-nobody"
        assert await code(nobody) == grpc.StatusCode.NOT_FOUND
        for mutate in (
            lambda m: setattr(m, "block_tokens", 0),
            lambda m: m.ClearField("events"),
            lambda m: m.events.append(r.KvCacheEvent()),
            lambda m: m.events.append(_stored(tuple(range(5000)))),
        ):
            bad = r.ReportKvEventsRequest()
            bad.CopyFrom(ok)
            mutate(bad)
            assert await code(bad) == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_worker_that_leaves_is_forgotten_by_the_index(plane: ControlPlane) -> None:
    svc = plane.scheduler.component.service  # type: ignore[union-attr]
    async with grpc.aio.insecure_channel(plane.registry_target) as rch:
        reg = r_grpc.RegistryServiceStub(rch)
        cred = await _register(reg, "pfx-gone", pool_id="h100-prefill", stages=(c.STAGE_PREFILL,))
        await reg.ReportKvEvents(
            r.ReportKvEventsRequest(
                worker_id="pfx-gone", credential=cred, block_tokens=BLOCK, events=[_stored(CHAIN)]
            ),
            timeout=5,
        )
        for _ in range(100):
            if svc.prefix.size("pfx-gone") == len(CHAIN):
                break
            await asyncio.sleep(0.05)
        assert svc.prefix.size("pfx-gone") == len(CHAIN)
        # bounded by what its engine can hold: 40 GiB of KV at 128 KiB a token, 128 a block
        svc.rebuild()
        assert svc.prefix.capacity("pfx-gone") == (40 << 30) // ((128 << 10) * BLOCK)
        await reg.DeregisterWorker(
            r.DeregisterWorkerRequest(worker_id="pfx-gone", credential=cred), timeout=5
        )
        for _ in range(100):
            svc.rebuild()
            if svc.prefix.held("pfx-gone") is None:
                break
            await asyncio.sleep(0.05)
        assert svc.prefix.held("pfx-gone") is None


async def test_an_agent_relays_its_engines_kv_events_into_the_schedulers_index(
    plane: ControlPlane, tmp_path: Path
) -> None:
    """The engine publishes BlockStored over ZMQ as vLLM does; the agent keys the blocks by
    our chain and reports them; the scheduler's index then holds the prompt's keys for the
    agent's worker, and a Schedule with the prompt's chain plans the cached tokens."""
    from tests.component.test_agent_fake_engine import FakeVllm, model_dir

    engine = FakeVllm()
    await engine.start()
    port = free_port()
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    flags = AgentFlags(
        engine_url=f"http://127.0.0.1:{engine.port}", role="prefill", worker_id="pfx-agent",
        pool_id="fake-prefill", gpu_type="H100-SXM", kv_connector="nixl",
        kv_side_channel="127.0.0.1:5601",
    )  # fmt: skip
    agent = Agent(
        flags, VllmAdapter(), model_dir(tmp_path), plane.registry_target, SystemClock(),
        AgentTiming(scrape_period_s=0.1, engine_down_after_s=0.5, http_timeout_s=1.0),
        kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kv",
    )  # fmt: skip
    task = asyncio.create_task(agent.run())
    svc = plane.scheduler.component.service  # type: ignore[union-attr]
    tokens = PROMPT[: 4 * 128]
    try:
        for seq in range(200):  # the subscriber joins late (ZMQ): publish until it is seen
            event = ["BlockStored", [11, 12, 13, 14], None, tokens, 128, None, "GPU"]
            payload = msgpack.packb([0.0, [event], 0])
            await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            if svc.prefix.size("pfx-agent") == 4:
                break
            await asyncio.sleep(0.05)
        held = svc.prefix.held("pfx-agent")
        assert held is not None and all(k in held for k in CHAIN[:4])
        assert svc.prefix.block_tokens("pfx-agent") == 128
        # the scheduler can read the registry's stream before the agent's RPC reply lands
        relay = agent.kv_relay
        assert relay is not None
        for _ in range(100):
            if relay.reported >= 1:
                break
            await asyncio.sleep(0.02)
        assert relay.reported >= 1
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        pub.close(linger=0)
        await engine.stop()
