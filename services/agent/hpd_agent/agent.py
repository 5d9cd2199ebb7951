"""The agent at work: one engine, its registration, its heartbeats, its directives.

Life of an agent (each step logged under a past-tense event name):

1. **wait for the engine** (``engine_waiting``): poll its health path every scrape period;
2. **read it and register** (``worker_registered``): the adapter's info paths, the model
   folder's ``config.json``, the flags -> a capability record (``capability``); a record
   that cannot be built is a configuration error and ends the agent (exit 2) with the flag
   named, since retrying would not fix it;
3. **heartbeat** over the registry's stream (``worker_client``), every scrape period, with
   the load of the latest scrape (``load``). A scrape that fails sends no figures, so
   nothing stale is ever sent, and reports the worker UNHEALTHY with the reason (a scrape
   that only timed out does so the second time in a row: a busy engine may miss one). An
   engine that refuses or garbles its answers for ``engine_down_after_s``, or answers
   nothing in time for ``engine_hung_after_s`` (longer: an engine saturated by its own
   batch is slow, not gone, and stays registered as UNHEALTHY), is deregistered
   (``engine_lost``) and the agent goes back to 1: a restarted engine comes back as a new
   registration (a new credential and registration time: a new incarnation) without
   restarting the agent;
4. **directives**: DRAIN marks the worker draining at the registry (the scheduler stops
   planning on it, so the gateway sends it nothing new), then the agent deregisters it
   once the engine has no request running or waiting, and exits 0 (``worker_drained``).
   Directives the engine cannot carry out (a new batch cap, throttling, migration: vLLM and
   SGLang fix these at start-up) are logged (``directive_unsupported``) and counted in
   ``hpd_agent_directives_total{result="unsupported"}``; cordon needs nothing from the
   engine (the registry excludes the worker);
5. **SIGTERM / SIGINT**: deregister at once and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from hetero_pd.v1 import common_pb2 as c
from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hpd_agent.kv_events import KvEvent, KvEventRelay
from hpd_common.channels import CallIdentity, aio_channel
from hpd_common.clock import Clock
from hpd_common.logging import get_logger
from hpd_common.worker_model import LoadReport, WorkerSpec
from hpd_registry.convert import spec_to_pb

from .capability import AgentFlags, build_spec
from .engines import EngineAdapter, EngineError
from .load import LoadTracker
from .model_config import ModelGeometry, geometry_from_config
from .worker_client import ClientTiming, WorkerClient

__all__ = ["Agent", "AgentMetrics", "AgentTiming", "ConfigError"]

log = get_logger("agent")

EXIT_OK = 0
EXIT_CONFIG = 2


class ConfigError(Exception):
    """The agent cannot describe its engine; retrying will not help."""


@dataclass(frozen=True, slots=True)
class AgentTiming:
    """``scrape_period_s``: engine scrapes and heartbeats; ``engine_down_after_s``: how long
    an engine that refuses connections or answers garbage stays registered (as UNHEALTHY)
    before it is deregistered; ``engine_hung_after_s``: the same for an engine whose
    scrapes only time out (busy, not gone: at least ``engine_down_after_s``);
    ``http_timeout_s``: one request to the engine; ``lease_ttl_ms``: requested lease (0 =
    the registry's default)."""

    scrape_period_s: float = 1.0
    engine_down_after_s: float = 3.0
    http_timeout_s: float = 2.0
    lease_ttl_ms: int = 0
    engine_hung_after_s: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "scrape_period_s",
            "engine_down_after_s",
            "engine_hung_after_s",
            "http_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.engine_hung_after_s < self.engine_down_after_s:
            raise ValueError("engine_hung_after_s must be >= engine_down_after_s")


class AgentMetrics:
    """The agent's own Prometheus metrics (served on ``--metrics-port``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.scrapes = Counter(
            "hpd_agent_scrapes", "Engine metric scrapes by result", ["result"],
            registry=self.registry,
        )  # fmt: skip
        self.directives = Counter(
            "hpd_agent_directives", "Directives received, by kind and what became of them",
            ["kind", "result"], registry=self.registry,
        )  # fmt: skip
        self.registrations = Counter(
            "hpd_agent_registrations", "Registrations of the engine's worker",
            registry=self.registry,
        )  # fmt: skip
        self.engine_up = Gauge(
            "hpd_agent_engine_up", "1 while the engine answers its scrapes",
            registry=self.registry,
        )  # fmt: skip
        self.draining = Gauge(
            "hpd_agent_draining", "1 once a drain directive was taken", registry=self.registry
        )
        self.kv_events = Counter(
            "hpd_agent_kv_events", "Engine KV cache events reported to the registry",
            registry=self.registry,
        )  # fmt: skip


class Agent:
    """Speaks for one engine (module docstring)."""

    def __init__(
        self,
        flags: AgentFlags,
        adapter: EngineAdapter,
        model_dir: Path | None,
        registry: str | grpc.aio.Channel,
        clock: Clock,
        timing: AgentTiming | None = None,
        metrics: AgentMetrics | None = None,
        rng: random.Random | None = None,
        identity: CallIdentity | None = None,
        kv_events_endpoint: str = "",
        kv_events_topic: str = "",
        kv_events_replay_endpoint: str = "",
    ) -> None:
        self.flags = flags
        self.kv_events_endpoint = kv_events_endpoint
        self.kv_events_topic = kv_events_topic
        self.kv_events_replay_endpoint = kv_events_replay_endpoint
        self.kv_relay: KvEventRelay | None = None
        self.adapter = adapter
        self.model_dir = model_dir
        self.timing = timing or AgentTiming()
        self.metrics = metrics or AgentMetrics()
        self._own_channel = isinstance(registry, str)
        self._channel = aio_channel(registry, identity) if isinstance(registry, str) else registry
        self._registry = r_grpc.RegistryServiceStub(self._channel)
        self._clock = clock
        self._rng = rng or random.Random()
        self._base = flags.engine_url.rstrip("/")
        if "://" not in self._base:
            self._base = "http://" + self._base
        self._http: aiohttp.ClientSession | None = None
        self.client: WorkerClient | None = None
        self.spec: WorkerSpec | None = None
        self._load: LoadReport | None = None
        self._tracker: LoadTracker | None = None
        self._blocks = 0
        self._failed_scrapes = 0
        self._draining = False
        # the loop holds tasks only weakly: one not referenced here can vanish mid-await
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self.registered = asyncio.Event()

    # -- engine HTTP ------------------------------------------------------------------------

    async def _get(self, path: str) -> str:
        assert self._http is not None
        async with self._http.get(self._base + path) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise EngineError(path, f"HTTP {resp.status}: {text[:200]}")
            return text

    async def _engine_healthy(self) -> bool:
        try:
            await self._get(self.adapter.health_path)
        except (aiohttp.ClientError, TimeoutError, EngineError):
            return False
        return True

    def _model_files(self) -> tuple[ModelGeometry | None, bytes | None]:
        if self.model_dir is None:
            return None, None
        path = self.model_dir / "config.json"
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"--model-dir: cannot read {path}: {exc.strerror}") from exc
        try:
            return geometry_from_config(raw.decode(), str(path)), raw
        except (EngineError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--model-dir: {exc}") from exc

    async def describe(self) -> WorkerSpec:
        """Read the engine and build its record (ConfigError when it cannot be built)."""
        geometry, config_bytes = self._model_files()
        answers = {p: await self._get(p) for p in self.adapter.info_paths}
        try:
            facts = self.adapter.facts(answers, geometry)
            spec = build_spec(self.flags, facts, geometry, config_bytes)
        except ValueError as exc:  # EngineError, CapabilityError
            raise ConfigError(str(exc)) from exc
        self._blocks = facts.kv_blocks_total or spec.kv_memory_total_bytes // max(
            1, spec.kv_format.bytes_per_token() * spec.kv_format.block_size_tokens
        )
        return spec

    # -- lifecycle --------------------------------------------------------------------------

    def stop(self) -> None:
        """Deregister and end :meth:`run` (SIGTERM)."""
        self._stop.set()

    async def run(self) -> int:
        """Serve until stopped or drained; returns the process exit code."""
        timeout = aiohttp.ClientTimeout(total=self.timing.http_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            self._http = http
            try:
                while not self._stop.is_set():
                    if not await self._wait_for_engine():
                        break
                    try:
                        spec = await self.describe()
                    except (aiohttp.ClientError, TimeoutError, EngineError) as exc:
                        log.info("engine_unreadable", error=str(exc))
                        await self._sleep(self.timing.scrape_period_s)
                        continue
                    outcome = await self._serve(spec)
                    if outcome != "engine_lost":
                        return EXIT_OK
                return EXIT_OK
            except ConfigError as exc:
                log.error("agent_misconfigured", error=str(exc))
                return EXIT_CONFIG
            finally:
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
                self._http = None
                if self._own_channel:
                    await self._channel.close()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    async def _wait_for_engine(self) -> bool:
        first = True
        while not self._stop.is_set():
            if await self._engine_healthy():
                return True
            if first:
                log.info("engine_waiting", url=self._base + self.adapter.health_path)
                first = False
            self.metrics.engine_up.set(0)
            await self._sleep(self.timing.scrape_period_s)
        return False

    async def _serve(self, spec: WorkerSpec) -> str:
        """Registered until the engine is lost ("engine_lost", also when the registry
        could not be reached to register), drained ("drained") or the agent is stopped
        ("stopped")."""
        self.spec = spec
        self._tracker = LoadTracker(self._blocks, queue_max=spec.max_batch_size)
        self._load = None
        await self._scrape()  # the first heartbeat carries real figures
        client = await self._register(spec)
        if client is None:
            return "engine_lost"
        relay_task = self._start_kv_relay()
        try:
            return await self._watch_engine(spec)
        finally:
            if relay_task is not None:
                relay_task.cancel()
                with contextlib.suppress(BaseException):
                    await relay_task
            self.registered.clear()
            await client.stop(deregister=True)
            self.client = None
            log.info("worker_deregistered", worker_id=spec.worker_id)

    async def _register(self, spec: WorkerSpec) -> WorkerClient | None:
        """The worker registered, heartbeating with the scraped load; None when the registry
        could not be reached (or refused for now) within the client's retry budget."""
        client = WorkerClient(
            spec_to_pb(spec),
            self._channel,
            None,
            load_fn=lambda: self._load,
            clock=self._clock,
            rng=self._rng,
            on_directive=self._on_directive,
            lease_ttl_ms=self.timing.lease_ttl_ms,
            timing=ClientTiming(report_interval_s=self.timing.scrape_period_s),
        )
        self.client = client
        try:
            await client.start()
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise ConfigError(f"the registry refused the record: {exc.details()}") from exc
            # unreachable past the client's retry budget, or refused for now (a live
            # worker holds the id): try again from the top after a pause
            log.warning("registration_failed", code=exc.code().name, detail=exc.details())
            await client.stop(deregister=False)
            self.client = None
            await self._sleep(max(1.0, self.timing.scrape_period_s))
            return None
        self.metrics.registrations.inc()
        self.registered.set()
        log.info(
            "worker_registered",
            worker_id=spec.worker_id,
            pool_id=spec.pool_id,
            endpoint=spec.endpoint,
            kv_dtype=spec.kv_format.dtype.value,
            block_size_tokens=spec.kv_format.block_size_tokens,
            model_revision=spec.model_revision,
        )
        return client

    def _start_kv_relay(self) -> asyncio.Task[None] | None:
        """The engine's KV event relay, when the engine publishes KV events."""
        if not self.kv_events_endpoint:
            return None
        relay = KvEventRelay(
            self.kv_events_endpoint,
            self._report_kv_events,
            self.kv_events_topic,
            replay_endpoint=self.kv_events_replay_endpoint,
        )
        self.kv_relay = relay
        return asyncio.get_running_loop().create_task(relay.run())

    async def _watch_engine(self, spec: WorkerSpec) -> str:
        """Scrape the engine every period until it is lost (refused for
        ``engine_down_after_s``, or silent for ``engine_hung_after_s``), drained, or the agent
        is stopped; returns which."""
        down_since: float | None = None
        refused = False  # some failure of this run was more than a timeout
        while not self._stop.is_set():
            await self._sleep(self.timing.scrape_period_s)
            if self._stop.is_set():
                break
            result = await self._scrape()
            now = asyncio.get_running_loop().time()
            if result == "ok":
                down_since, refused = None, False
                if self._draining and self._idle():
                    log.info("worker_drained", worker_id=spec.worker_id)
                    return "drained"
                continue
            down_since = down_since or now
            refused = refused or result == "down"
            silent = now - down_since
            limit = self.timing.engine_down_after_s if refused else self.timing.engine_hung_after_s
            if silent >= limit:
                log.warning(
                    "engine_lost",
                    worker_id=spec.worker_id,
                    after_s=round(silent, 2),
                    cause="refused" if refused else "timed_out",
                )
                return "engine_lost"
        return "stopped"

    async def _report_kv_events(self, block_tokens: int, events: list[KvEvent]) -> None:
        """One batch of the engine's KV events to the registry's feed (``kv_events``)."""
        client, spec = self.client, self.spec
        if client is None or spec is None or not client.credential:
            raise RuntimeError("not registered")
        req = r.ReportKvEventsRequest(
            worker_id=spec.worker_id, credential=client.credential, block_tokens=block_tokens
        )
        for kind, keys in events:
            if kind == "c":
                req.events.append(r.KvCacheEvent(all_cleared=True))
            elif kind in ("s", "h"):
                blocks = r.KvBlocks(block_hashes=keys, from_prompt_start=kind == "h")
                req.events.append(r.KvCacheEvent(stored=blocks))
            else:
                req.events.append(r.KvCacheEvent(removed=r.KvBlocks(block_hashes=keys)))
        await self._registry.ReportKvEvents(req, timeout=self.timing.http_timeout_s)
        self.metrics.kv_events.inc(len(events))

    def _idle(self) -> bool:
        load = self._load
        return load is not None and load.batch_size == 0 and load.queue_depth == 0

    async def _scrape(self) -> str:
        """One scrape: the next heartbeat's figures, or none and UNHEALTHY on failure.
        Returns ``ok``, ``slow`` (timed out) or ``down`` (refused, or a bad answer)."""
        assert self._tracker is not None
        try:
            text = await self._get(self.adapter.metrics_path)
            sample = self.adapter.sample(text)
        except (aiohttp.ClientError, TimeoutError, EngineError) as exc:
            reason = f"engine scrape failed: {exc}" if str(exc) else "engine scrape timed out"
            self._load = None
            self._tracker.reset()
            self._failed_scrapes += 1
            # a refused connection or a bad answer is a fault at once; a slow answer is one
            # only the second time in a row (a busy engine can miss one scrape's deadline)
            slow = isinstance(exc, TimeoutError)
            if self.client is not None and (not slow or self._failed_scrapes >= 2):
                self.client.set_health(False, reason[:200])
            self.metrics.scrapes.labels("error").inc()
            self.metrics.engine_up.set(0)
            log.info("engine_scrape_failed", error=reason)
            return "slow" if slow else "down"
        self._load = self._tracker.update(sample, self._clock.now_ms())
        self._failed_scrapes = 0
        if self.client is not None:
            self.client.set_health(True)
        self.metrics.scrapes.labels("ok").inc()
        self.metrics.engine_up.set(1)
        return "ok"

    # -- directives -------------------------------------------------------------------------

    def _on_directive(self, d: c.Directive) -> None:
        kind = c.DirectiveKind.Name(d.kind).removeprefix("DIRECTIVE_KIND_").lower()
        if d.kind == c.DIRECTIVE_KIND_DRAIN:
            self.metrics.directives.labels(kind, "applied").inc()
            if not self._draining:
                self._draining = True
                self.metrics.draining.set(1)
                task = asyncio.get_running_loop().create_task(self._mark_draining(d.reason))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return
        self.metrics.directives.labels(kind, "unsupported").inc()
        log.warning(
            "directive_unsupported",
            kind=kind,
            engine=self.adapter.name,
            reason=d.reason,
            detail=f"{self.adapter.name} fixes this at start-up; restart the engine to change it",
        )

    async def _mark_draining(self, reason: str) -> None:
        """Tell the registry (and so the scheduler and the gateway) to send nothing new.
        Retried, each call with a deadline, until it is done or the worker is gone: a
        drain that only the agent knows of would still send the engine new requests."""
        attempt = 0
        while not self._stop.is_set():
            spec = self.spec
            if spec is None or not self.registered.is_set():
                return
            timeout = self.timing.scrape_period_s * 4 + 1.0
            try:
                got = await self._registry.GetWorker(
                    r.GetWorkerRequest(worker_id=spec.worker_id), timeout=timeout
                )
                client = self.client
                if not got.worker.status.draining:
                    await self._registry.DrainWorker(
                        r.DrainWorkerRequest(
                            worker_id=spec.worker_id,
                            reason=reason or "drain directive",
                            # a worker may drain only itself: its credential says so
                            credential=client.credential if client is not None else "",
                        ),
                        timeout=timeout,
                    )
                log.info("worker_draining", worker_id=spec.worker_id, reason=reason)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return  # deregistered meanwhile: nothing left to mark
                log.warning(
                    "drain_mark_failed",
                    worker_id=spec.worker_id,
                    code=exc.code().name,
                    attempt=attempt,
                )
            await self._sleep(min(0.2 * 2**attempt, 2.0))
            attempt += 1
