"""`hpd agent` against a vLLM look-alike serving recorded answers and a real registry:
registration with the engine's KV format, load from the scrape, a registry that comes up
after the agent, an engine that goes away and comes back, and SIGTERM-style stop."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from aiohttp import web

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_agent.agent import Agent, AgentTiming
from hpd_agent.capability import AgentFlags
from hpd_agent.engines import VllmAdapter
from hpd_common.clock import SystemClock
from hpd_common.server import GrpcServer
from hpd_tools.embedded_redis import EmbeddedRedis, free_port
from tests.support.servers import external, stop_server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines" / "vllm"
pytestmark = [
    pytest.mark.skipif(external("registry") is not None, reason="starts its own servers"),
]


class FakeVllm:
    """Answers /health, /v1/models, /version and /metrics from recorded vLLM answers;
    ``running`` replaces the recorded number of running requests."""

    def __init__(self) -> None:
        self.running = 3
        self.delay_s = 0.0  # /metrics answers this late (a saturated engine)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def metrics(self) -> str:
        text = (FIXTURES / "metrics_decode.txt").read_text()
        lines = [
            f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {self.running}.0'
            if ln.startswith("vllm:num_requests_running{")
            else ln
            for ln in text.splitlines()
        ]
        return "\n".join(lines) + "\n"

    async def start(self, port: int = 0) -> None:
        app = web.Application()

        def answer(text: Callable[[], str]) -> Callable[[web.Request], Awaitable[web.Response]]:
            async def handler(request: web.Request) -> web.Response:
                if request.path == "/metrics" and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                return web.Response(text=text())

            return handler

        app.router.add_get("/health", answer(lambda: ""))
        app.router.add_get("/v1/models", answer((FIXTURES / "v1_models.json").read_text))
        app.router.add_get("/version", answer((FIXTURES / "version.json").read_text))
        app.router.add_get("/metrics", answer(self.metrics))
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def engine() -> AsyncIterator[FakeVllm]:
    e = FakeVllm()
    await e.start()
    yield e
    await e.stop()


def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text((FIXTURES / "model_config.json").read_text())
    return tmp_path


def agent_for(
    engine: FakeVllm, target: str, folder: Path, timing: AgentTiming | None = None
) -> Agent:
    flags = AgentFlags(
        engine_url=f"http://127.0.0.1:{engine.port}", role="decode", worker_id="fake-d0",
        pool_id="fake-decode", gpu_type="cpu-core", peak_tflops=0.5, hbm_gbps=20.0,
        kv_connector="nixl", kv_side_channel="127.0.0.1:5601",
    )  # fmt: skip
    timing = timing or AgentTiming(scrape_period_s=0.1, engine_down_after_s=0.5, http_timeout_s=1.0)
    return Agent(flags, VllmAdapter(), folder, target, SystemClock(), timing, rng=random.Random(1))


async def worker(stub: r_grpc.RegistryServiceStub, wid: str) -> r.GetWorkerResponse | None:
    try:
        resp: r.GetWorkerResponse = await stub.GetWorker(
            r.GetWorkerRequest(worker_id=wid), timeout=5, wait_for_ready=True
        )
        return resp
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


async def until(
    check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0, poll_s: float = 0.05
) -> None:
    """Poll ``check`` (a registry read) until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(poll_s)


async def test_a_registry_that_comes_up_late_still_gets_the_worker_with_its_load(
    engine: FakeVllm, redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    agent = agent_for(engine, f"127.0.0.1:{port}", model_dir(tmp_path))
    task = asyncio.create_task(agent.run())
    await asyncio.sleep(1.0)  # the agent is retrying against nothing
    assert not task.done()
    server = await _registry_on(redis_server.url, key_prefix, port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = r_grpc.RegistryServiceStub(channel)
    try:
        await until(lambda: _has_load(stub, "fake-d0", 3), timeout_s=30)
        got = await worker(stub, "fake-d0")
        assert got is not None
        kv = got.worker.capability.kv_format
        assert (kv.block_size_tokens, kv.num_layers, kv.num_kv_heads, kv.head_dim) == (
            128, 2, 2, 32,
        )  # fmt: skip
        assert got.worker.capability.labels["kv-side-channel"] == "127.0.0.1:5601"
        engine.running = 7  # the next scrapes carry the change
        await until(lambda: _has_load(stub, "fake-d0", 7))
        # the engine goes away: the worker is taken out, and comes back with the engine
        first = got.worker.status.registered_at_unix_ms
        engine_port = engine.port
        await engine.stop()
        await until(lambda: _gone(stub, "fake-d0"))
        await engine.start(engine_port)
        await until(lambda: _has_load(stub, "fake-d0", 7))
        again = await worker(stub, "fake-d0")
        assert again is not None and again.worker.status.registered_at_unix_ms > first
        agent.stop()  # as on SIGTERM: deregistered at once
        assert await asyncio.wait_for(task, 10) == 0
        assert await worker(stub, "fake-d0") is None
    finally:
        agent.stop()
        await channel.close()
        await stop_server(server)


async def test_a_slow_engine_stays_registered_unhealthy_and_a_silent_one_is_taken_out(
    engine: FakeVllm, redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> None:
    """Scrapes that time out (an engine busy with its own batch) mark the worker
    UNHEALTHY but keep it registered past ``engine_down_after_s``; it is healthy again
    with the next answer. Only ``engine_hung_after_s`` of timeouts takes it out."""
    port = free_port()
    server = await _registry_on(redis_server.url, key_prefix, port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = r_grpc.RegistryServiceStub(channel)
    timing = AgentTiming(
        scrape_period_s=0.1, engine_down_after_s=0.3, http_timeout_s=0.2, engine_hung_after_s=2.5
    )
    agent = agent_for(engine, f"127.0.0.1:{port}", model_dir(tmp_path), timing)
    task = asyncio.create_task(agent.run())
    try:
        await until(lambda: _has_load(stub, "fake-d0", 3), timeout_s=30)
        first = (await worker(stub, "fake-d0")).worker.status.registered_at_unix_ms  # type: ignore[union-attr]
        engine.delay_s = 0.5  # every scrape now times out
        await until(lambda: _health(stub, "fake-d0", HEALTH_UNHEALTHY))
        await asyncio.sleep(1.0)  # three times engine_down_after_s: still registered
        got = await worker(stub, "fake-d0")
        assert got is not None and got.worker.status.health == HEALTH_UNHEALTHY
        assert got.worker.status.registered_at_unix_ms == first
        engine.delay_s = 0.0  # it answers again: the same registration, healthy
        await until(lambda: _health(stub, "fake-d0", HEALTH_HEALTHY))
        got = await worker(stub, "fake-d0")
        assert got is not None and got.worker.status.registered_at_unix_ms == first
        engine.delay_s = 0.5  # and now it never answers in time again
        t0 = asyncio.get_running_loop().time()
        await until(lambda: _gone(stub, "fake-d0"), timeout_s=15)
        waited = asyncio.get_running_loop().time() - t0
        assert waited >= 2.5, f"taken out after {waited:.2f} s of timeouts"
    finally:
        agent.stop()
        await asyncio.wait_for(task, 10)
        await channel.close()
        await stop_server(server)


async def test_a_drain_directive_marks_the_worker_draining_then_deregisters_it_once_idle(
    engine: FakeVllm, redis_server: EmbeddedRedis, key_prefix: str, tmp_path: Path
) -> None:
    """DRAIN: marked draining at the registry while the engine still runs requests, with
    the garbage collector running all the while (the marking is a task of its own, which
    the event loop holds only weakly); deregistered, exit 0, once the engine is idle."""
    port = free_port()
    server = await _registry_on(redis_server.url, key_prefix, port)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = r_grpc.RegistryServiceStub(channel)
    agent = agent_for(engine, f"127.0.0.1:{port}", model_dir(tmp_path))
    task = asyncio.create_task(agent.run())
    stop_gc = asyncio.Event()

    async def collect() -> None:
        while not stop_gc.is_set():  # a full collection every 20 ms: often, not all the time
            gc.collect()
            await asyncio.sleep(0.02)

    collector = asyncio.create_task(collect())
    try:
        await until(lambda: _has_load(stub, "fake-d0", 3), timeout_s=30)
        await stub.SendDirective(
            r.SendDirectiveRequest(
                worker_id="fake-d0",
                directive=c.Directive(kind=c.DIRECTIVE_KIND_DRAIN, reason="test", issuer="t"),
            ),
            timeout=5,
        )
        await until(lambda: _health(stub, "fake-d0", c.HEALTH_STATE_DRAINING), timeout_s=10)
        await asyncio.sleep(0.5)  # busy: still there, still draining
        assert await _health(stub, "fake-d0", c.HEALTH_STATE_DRAINING)
        engine.running = 0
        await until(lambda: _gone(stub, "fake-d0"), timeout_s=10)
        assert await asyncio.wait_for(task, 10) == 0
    finally:
        stop_gc.set()
        await collector
        agent.stop()
        await asyncio.wait_for(task, 10)
        await channel.close()
        await stop_server(server)


HEALTH_HEALTHY = c.HEALTH_STATE_HEALTHY
HEALTH_UNHEALTHY = c.HEALTH_STATE_UNHEALTHY


async def _health(stub: r_grpc.RegistryServiceStub, wid: str, state: int) -> bool:
    got = await worker(stub, wid)
    return got is not None and got.worker.status.health == state


async def _has_load(stub: r_grpc.RegistryServiceStub, wid: str, running: int) -> bool:
    got = await worker(stub, wid)
    return got is not None and got.worker.HasField("load") and got.worker.load.batch_size == running


async def _gone(stub: r_grpc.RegistryServiceStub, wid: str) -> bool:
    return await worker(stub, wid) is None


async def _registry_on(redis_url: str, prefix: str, port: int) -> GrpcServer:
    from hpd_common import redis_conn
    from hpd_registry.__main__ import build_server
    from hpd_registry.settings import RegistrySettings

    settings = RegistrySettings(port=port, redis_url=redis_url, key_prefix=prefix,
                                lease_ttl_ms=3_000, sweep_interval_ms=100)  # fmt: skip
    server = build_server(settings, redis_conn.connect(redis_url))
    await server.start()
    return server
