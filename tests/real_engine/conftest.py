"""Real-engine suite: real vLLM processes (CPU build, NIXL) under a real control plane.

Every test here skips unless ``HPD_REAL_ENGINES=1`` (``scripts/real-engines-e2e.sh`` sets
it, after installing the engines' virtualenv). The session fixture ``real`` starts:

* two engines serving the tiny model with dummy weights, one core each: ``prefill``
  (bf16, NIXL producer) and ``decode`` (bf16, NIXL consumer);
* ``hpd up`` with its embedded Redis on free ports;
* one ``hpd agent`` per engine (workers ``p0`` and ``d0``; scrape period 0.5 s).

The fixture ``fp32_prefill`` swaps the bf16 prefill engine for an fp32 one (worker ``x0``)
for the tests of a pair whose KV really cannot move, and ``cache_pair`` runs two engines
without a KV connector (workers ``c0`` and ``c1``, both stages, KV events with replay) in
place of the P/D pair, for prefix routing between two engines; ``pd_pair`` brings the P/D
pair back. Two engines at a time: each engine's NIXL progress thread spins on its core,
and a third engine sharing a core did not finish warming up in five minutes.

Logs go to ``HPD_REAL_LOG_DIR`` (the stage prints their tails when a test fails).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import kvbroker_pb2_grpc as kb_grpc
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_fleet.real_install import engines_venv, write_tiny_model
from hpd_fleet.real_processes import AgentProcess, EngineProcess, EngineSpec, pick_port, wait_http
from hpd_tools.up import embedded_redis_url
from tests.support.processes import wait_serving

SCRAPE_PERIOD_S = 0.5
WORKERS: dict[str, tuple[str, str]] = {
    "p0": ("prefill", "prefill"),
    "x0": ("prefill32", "prefill"),
    "d0": ("decode", "decode"),
    "c0": ("cache0", "both"),
    "c1": ("cache1", "both"),
}
"""Worker id -> (engine, role) of the engines the suite can run."""
LEASE_TTL_MS = 10_000


def enabled() -> bool:
    return os.environ.get("HPD_REAL_ENGINES") == "1"


HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs real engines (scripts/real-engines-e2e.sh)")
    for item in items:
        # by the test's file (a test elsewhere may name this folder in its id)
        if HERE in item.path.resolve().parents and not enabled():
            item.add_marker(skip)


@dataclass
class RealFleet:
    """Handles on the running engines, agents and control plane."""

    engines: dict[str, EngineProcess]
    agents: dict[str, AgentProcess]
    model_dir: Path
    log_dir: Path
    registry_addr: str
    scheduler_addr: str
    broker_addr: str
    control_plane: subprocess.Popen[bytes]
    gateway_url: str = ""
    gateway: AgentProcess | None = None
    channels: list[grpc.Channel] = field(default_factory=list)

    def _channel(self, addr: str) -> grpc.Channel:
        ch = grpc.insecure_channel(addr)
        self.channels.append(ch)
        return ch

    @property
    def registry(self) -> r_grpc.RegistryServiceStub:
        return r_grpc.RegistryServiceStub(self._channel(self.registry_addr))

    @property
    def scheduler(self) -> s_grpc.SchedulerServiceStub:
        return s_grpc.SchedulerServiceStub(self._channel(self.scheduler_addr))

    @property
    def broker(self) -> kb_grpc.KvBrokerServiceStub:
        return kb_grpc.KvBrokerServiceStub(self._channel(self.broker_addr))

    def agent_args(self, engine: str, worker_id: str, role: str, *extra: str) -> list[str]:
        e = self.engines[engine]
        args = [
            "--engine-url", e.url, "--model-dir", str(self.model_dir), "--role", role,
            "--registry", self.registry_addr, "--worker-id", worker_id,
            "--pool-id", f"cpu-{role}-{e.spec.dtype}", "--gpu-type", "cpu-core",
            # one CPU core: order-of-magnitude figures, so the planner's estimates are sane
            "--peak-tflops", "0.5", "--hbm-gbps", "20", "--zone", "local",
            "--scrape-period-s", str(SCRAPE_PERIOD_S), "--log-level", "info",
        ]  # fmt: skip
        if e.side_channel:
            args += ["--kv-connector", "nixl", "--kv-side-channel", e.side_channel]
        if role == "decode":
            # the P/D pair's decode engine only decodes (as in a router's P/D mode): with
            # measured speeds, recomputing a short prompt on it is faster than the hand-off
            # on these CPU engines, and the tests here are about the hand-off
            args += ["--labels", "local-prefill=never"]
        if e.kv_events:
            args += ["--kv-events-endpoint", e.kv_events, "--kv-events-topic", "kv"]
        if e.kv_replay:
            args += ["--kv-events-replay-endpoint", e.kv_replay]
        return args + list(extra)

    def start_agent(
        self, name: str, engine: str, worker_id: str, role: str, *extra: str
    ) -> AgentProcess:
        agent = AgentProcess(name, self.agent_args(engine, worker_id, role, *extra), self.log_dir)
        agent.start()
        return agent

    def use_prefill(self, engine: str) -> None:
        """Run ``engine`` ("prefill", worker p0, or "prefill32", worker x0) with the decode
        engine (d0), in place of whatever else runs; nothing to do when they already run."""
        self.run_workers("p0" if engine == "prefill" else "x0", "d0")

    def run_workers(self, *wanted: str) -> None:
        """Exactly these workers (keys of ``WORKERS``), each engine with its agent: the
        others' agents stop and their engines are killed first (two engines at a time)."""
        for wid in [w for w in self.agents if w in WORKERS and w not in wanted]:
            self.agents.pop(wid).stop()
            self.engines[WORKERS[wid][0]].kill()
        todo = [w for w in wanted if w not in self.agents]
        engines = [self.engines[WORKERS[w][0]] for w in todo]
        for e in engines:
            e.kill()  # one a test left without its agent
            e.start()
        for e in engines:
            try:
                e.wait_ready(150)
            except (TimeoutError, RuntimeError):
                e.kill()
                e.start_ready()  # once more, on new ports (its agent starts after)
        for wid in todo:
            engine, role = WORKERS[wid]
            extra = ("--kv-role", "none") if not self.engines[engine].spec.role else ()
            self.agents[wid] = self.start_agent(wid, engine, wid, role, *extra)
        for wid in todo:
            self.wait_worker(wid, timeout_s=60)

    def worker(self, worker_id: str) -> r.GetWorkerResponse | None:
        try:
            resp: r.GetWorkerResponse = self.registry.GetWorker(
                r.GetWorkerRequest(worker_id=worker_id), timeout=5
            )
            return resp
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def settle(self, *worker_ids: str, timeout_s: float = 60.0) -> None:
        """Wait until each worker is registered, HEALTHY, not draining and idle in the
        registry (a test before may have left an engine busy, its agent re-registering, or
        its scrapes timing out), then two scrape periods for the scheduler to follow."""
        t0 = time.monotonic()
        pending = list(worker_ids)
        while pending:
            got = self.worker(pending[0])
            w = got.worker if got is not None else None
            if (
                w is not None
                and w.status.health == c.HEALTH_STATE_HEALTHY
                and not w.status.draining
                and w.HasField("load")
                and w.load.batch_size == 0
                and w.load.queue_depth == 0
            ):
                pending.pop(0)
                continue
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"worker {pending[0]} not healthy and idle: {w}")
            time.sleep(0.1)
        time.sleep(2 * SCRAPE_PERIOD_S)

    def wait_worker(self, worker_id: str, present: bool = True, timeout_s: float = 60.0) -> float:
        """Seconds until the worker is (or is no longer) registered."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if (self.worker(worker_id) is not None) == present:
                return time.monotonic() - t0
            time.sleep(0.1)
        state = "registered" if present else "gone"
        raise AssertionError(f"worker {worker_id} not {state} after {timeout_s:.0f} s")


# size: starts the real stack step by step, each step's failure naming itself
@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    log_dir = Path(os.environ.get("HPD_REAL_LOG_DIR") or tmp_path_factory.mktemp("real-logs"))
    venv = engines_venv(getattr(sys, "_base_executable", sys.executable))
    model_dir = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", venv)
    specs = [
        EngineSpec(
            "prefill",
            pick_port(),
            0,
            "kv_producer",
            pick_port(),
            kv_events_port=pick_port(),
            kv_replay_port=pick_port(),
        ),
        # KV events on the prefill engine only: the shared-prefix test needs that side, and
        # the decode side's would let the planner prefer recompute on d0 for a repeated
        # prompt, which the other tests here do not expect
        EngineSpec("decode", pick_port(), 1, "kv_consumer", pick_port()),
        EngineSpec("prefill32", pick_port(), 0, "kv_producer", pick_port(), dtype="float32"),
        # no KV connector (so no spinning NIXL thread): both stages on each, KV events
        *(
            EngineSpec(
                f"cache{i}", pick_port(), i, kv_events_port=pick_port(), kv_replay_port=pick_port()
            )
            for i in (0, 1)
        ),
    ]
    engines = {s.name: EngineProcess(s, venv, model_dir, log_dir) for s in specs}
    t0 = time.monotonic()
    engines["prefill"].start()
    engines["decode"].start()
    ports = {"registry": pick_port(), "scheduler": pick_port(), "kvbroker": pick_port()}
    hpd = Path(sys.executable).with_name("hpd")
    up_log = (log_dir / "hpd-up.log").open("ab")
    state_dir, redis_port = tmp_path_factory.mktemp("hpd-up"), pick_port()
    redis_url = embedded_redis_url(state_dir, redis_port)  # the gateway plans over it
    control_plane = subprocess.Popen(
        [
            str(hpd), "up", "--state-dir", str(state_dir), "--redis-port", str(redis_port),
            "--registry-port", str(ports["registry"]),
            "--scheduler-port", str(ports["scheduler"]),
            "--kvbroker-port", str(ports["kvbroker"]),
            "--lease-ttl-ms", str(LEASE_TTL_MS), "--log-level", "info", "--json-logs",
        ],
        stdout=up_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,  # a session of its own: see hpd_fleet.real_processes.OWN_SESSION
    )  # fmt: skip
    addr = {k: f"127.0.0.1:{p}" for k, p in ports.items()}
    fleet = RealFleet(
        engines=engines,
        agents={},
        model_dir=model_dir,
        log_dir=log_dir,
        registry_addr=addr["registry"],
        scheduler_addr=addr["scheduler"],
        broker_addr=addr["kvbroker"],
        control_plane=control_plane,
    )
    try:
        wait_serving(list(addr.values()), control_plane, 60)
        for e in (engines["prefill"], engines["decode"]):
            try:
                e.wait_ready(150)
            except (TimeoutError, RuntimeError):
                e.kill()
                e.start_ready()  # once more, on new ports (no agent knows them yet)
        print(f"\nreal engines: 2 up in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        for name, engine, role in (("p0", "prefill", "prefill"), ("d0", "decode", "decode")):
            fleet.agents[name] = fleet.start_agent(name, engine, name, role)
        for wid in ("p0", "d0"):
            fleet.wait_worker(wid, timeout_s=60)
        gw_port = pick_port()
        fleet.gateway = AgentProcess(
            "gw",
            [
                "--port", str(gw_port), "--redis-url", redis_url,
                "--broker", addr["kvbroker"], "--registry", addr["registry"],
                "--tokenizer", f"tiny={model_dir}", "--log-level", "info", "--json-logs",
            ],
            log_dir,
            command="gateway",
        )  # fmt: skip
        fleet.gateway.start()
        fleet.gateway_url = f"http://127.0.0.1:{gw_port}"
        wait_http(fleet.gateway_url + "/health", 30)
        yield fleet
    finally:
        # every process is stopped, whatever one of them does on the way out
        stops: list[Callable[[], object]] = []
        if fleet.gateway is not None:
            stops.append(fleet.gateway.stop)
        stops += [a.stop for a in fleet.agents.values()]
        stops += [e.kill for e in engines.values()]
        for stop in stops:
            try:
                stop()
            except Exception as exc:  # reported, and the rest still stopped
                print(f"teardown: {exc!r}", file=sys.stderr)
        control_plane.terminate()
        try:
            control_plane.wait(timeout=20)
        except subprocess.TimeoutExpired:
            control_plane.kill()
        up_log.close()
        for ch in fleet.channels:
            ch.close()


@pytest.fixture
def fp32_prefill(real: RealFleet) -> RealFleet:
    """The bf16 prefill engine (p0) replaced by an fp32 one (x0) on the same core; it stays
    until a test asks for ``pd_pair`` (swapping costs an engine start each way)."""
    real.use_prefill("prefill32")
    return real


@pytest.fixture
def cache_pair(real: RealFleet) -> RealFleet:
    """Two engines without a KV connector (c0 on core 0, c1 on core 1; both stages, KV
    events with replay) in place of the P/D pair; registered, healthy and idle."""
    real.run_workers("c0", "c1")
    real.settle("c0", "c1")
    return real


@pytest.fixture
def pd_pair(real: RealFleet) -> RealFleet:
    """The bf16 prefill (p0) and decode (d0) engines, both registered, healthy and idle."""
    real.use_prefill("prefill")
    real.settle("p0", "d0")
    return real
