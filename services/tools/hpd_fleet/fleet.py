"""An emulated heterogeneous fleet: many emulated workers in one process, each an
:class:`~hpd_fleet.engine.EmulatedEngine` joined to the control plane by its own
:class:`~hpd_agent.worker_client.WorkerClient`.

The fleet is described by the simulator's cluster document (``hpd_sim.cluster``:
pools of GPUs with TP, stage, zone/rack, KV format, link classes), so the demo, the emulated
fleet and the simulator speak of the same clusters. Worker ids are ``<prefix><pool>-<n>``.

**Links.** The *physical* link a transfer uses is the cluster's link model
(``LinkModel.between``: locality class or pool-pair override, capped by both NICs); a
fault can divide one (source pool, destination pool) pair's bandwidth by a factor. The
scheduler is not told: it learns the slower rate from the transfer times the gateway
reports (its closed loop), as it would in production.
A transfer of ``B`` bytes takes ``B x 8 / (Gb/s x 10^6) + latency_ms + conversion_ms`` emulated
ms, where the conversion cost (ms per GiB of source KV) comes from the broker's negotiation.
Concurrent transfers do not contend (a limit of the emulation; the simulator models pipes).

**Directives** are applied to the engine: SET_MAX_BATCH_SIZE changes its batch cap, DRAIN
stops it accepting new work, THROTTLE and MIGRATE are recorded (an emulated engine has no
admission queue of its own to throttle or migrate).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import grpc

from hetero_pd.v1 import common_pb2 as c
from hpd_agent.worker_client import ClientTiming, WorkerClient
from hpd_common.clock import Clock
from hpd_common.gpus import gpu_profile
from hpd_common.logging import get_logger
from hpd_registry.convert import kv_format_to_pb
from hpd_scheduler.policy import Link, Stage, WorkerView
from hpd_sim.cluster import ClusterSpec, load_cluster

from .engine import EmulatedEngine, EmuTime, EngineSpec

__all__ = [
    "EmulatedWorker",
    "Fleet",
    "advertised_host",
    "capability_of",
    "default_cluster",
    "default_cluster_path",
    "engine_spec_of",
]

log = get_logger("fleet")


def default_cluster_path() -> Path:
    """The demo fleet shipped with the package (``demo_cluster.yaml``)."""
    return Path(str(resources.files("hpd_fleet") / "demo_cluster.yaml"))


def default_cluster() -> ClusterSpec:
    return load_cluster(default_cluster_path())


_STAGES = {
    Stage.PREFILL: [c.STAGE_PREFILL],
    Stage.DECODE: [c.STAGE_DECODE],
    Stage.BOTH: [c.STAGE_PREFILL, c.STAGE_DECODE],
}


def capability_of(view: WorkerView, worker_id: str, port: int) -> c.WorkerCapability:
    """The registry capability record of one emulated worker (``view`` from the cluster)."""
    loc = view.network
    return c.WorkerCapability(
        worker_id=worker_id,
        pool_id=view.pool_id,
        endpoint=f"{worker_id}.emulated:{port}",
        stages=_STAGES[view.stage],
        model_id=view.model_id,
        model_revision=view.model_revision,
        engine="hpd-emulated",
        engine_version="1",
        gpu_type=view.gpu_type,
        gpu_count=view.gpu_count,
        tp_size=view.tp_size,
        pp_size=1,
        kv_memory_total_bytes=view.kv_memory_total_bytes,
        max_batch_size=view.max_batch_size,
        kv_format=kv_format_to_pb(view.kv_format),
        network=c.NetworkLocation(
            zone=loc.zone, rack=loc.rack, host=worker_id, nic_gbps=loc.nic_gbps
        ),
        labels={"emulated": "true", **view.labels, "pool": view.pool_id},
    )


def advertised_host(host: str, advertise: str = "") -> str:
    """The host name of the endpoints emulated engines listening on ``host`` register with:
    ``advertise``, else ``host``. A gateway on this machine reaches the bound address; one
    elsewhere (another container of a compose stack) needs a name it resolves, with the
    engines on an address that answers on it (``0.0.0.0``). ValueError for a wildcard
    without a name: it would register endpoints nobody can call."""
    name = advertise or host
    if name in ("0.0.0.0", "::", ""):
        raise ValueError(f"listening on {host!r} needs a host name to advertise (--advertise)")
    return name


def engine_spec_of(cluster: ClusterSpec, view: WorkerView, worker_id: str) -> EngineSpec:
    """The engine figures of one worker: capacity in tokens = KV bytes / bytes per token."""
    per_token = view.kv_format.bytes_per_token()
    return EngineSpec(
        worker_id=worker_id,
        pool_id=view.pool_id,
        model=cluster.model,
        gpu=gpu_profile(view.gpu_type),
        tp=view.tp_size,
        kv_dtype=view.kv_format.dtype,
        kv_capacity_tokens=max(1, view.kv_memory_total_bytes // per_token),
        block_size_tokens=view.kv_format.block_size_tokens,
        max_batch_size=view.max_batch_size,
        efficiency=cluster.efficiency,
    )


@dataclass(slots=True)
class EmulatedWorker:
    """One worker: its static view, its engine and its control-plane client."""

    view: WorkerView
    engine: EmulatedEngine
    client: WorkerClient
    killed: bool = False
    killed_at_unix_ms: int = 0
    """When the worker was killed (0 while it lives)."""

    @property
    def worker_id(self) -> str:
        return self.engine.worker_id

    @property
    def serving(self) -> bool:
        """Alive and accepting work."""
        return self.engine.alive and self.engine.accepting and not self.killed

    def on_directive(self, d: c.Directive) -> None:
        if d.kind == c.DIRECTIVE_KIND_SET_MAX_BATCH_SIZE and d.max_batch_size > 0:
            self.engine.max_batch_size = min(d.max_batch_size, self.engine.spec.max_batch_size)
        elif d.kind == c.DIRECTIVE_KIND_DRAIN:
            self.engine.accepting = False


class Fleet:
    """The emulated workers of one cluster, registered with one registry and broker."""

    def __init__(
        self,
        cluster: ClusterSpec,
        registry: grpc.aio.Channel,
        broker: grpc.aio.Channel,
        time: EmuTime,
        clock: Clock,
        rng: random.Random,
        id_prefix: str = "",
        lease_ttl_ms: int = 0,
        timing: ClientTiming | None = None,
        tick_wall_s: float = 0.01,
    ) -> None:
        self.cluster = cluster
        self.time = time
        self.clock = clock
        self.workers: dict[str, EmulatedWorker] = {}
        self._slow: dict[tuple[str, str], float] = {}
        for n, view in enumerate(cluster.worker_views()):
            wid = f"{id_prefix}{view.worker_id}"
            engine = EmulatedEngine(engine_spec_of(cluster, view, wid), time, tick_wall_s)
            worker = EmulatedWorker(view, engine, None)  # type: ignore[arg-type]
            worker.client = WorkerClient(
                capability_of(view, wid, 8000 + n),
                registry,
                broker,
                load_fn=engine.load_report,
                clock=clock,
                rng=random.Random(rng.random()),
                on_directive=worker.on_directive,
                lease_ttl_ms=lease_ttl_ms,
                timing=timing,
            )
            self.workers[wid] = worker

    def __iter__(self) -> Iterator[EmulatedWorker]:
        return iter(self.workers.values())

    def pools(self) -> list[str]:
        return sorted({w.view.pool_id for w in self})

    def set_endpoints(self, endpoints: Mapping[str, str]) -> None:
        """Register these workers at these ``host:port`` endpoints (where
        :class:`~hpd_fleet.engine_http.FleetHttp` serves them) instead of their placeholder
        names; before :meth:`start`."""
        for wid, endpoint in endpoints.items():
            self.workers[wid].client.capability.endpoint = endpoint

    async def start(self) -> None:
        """Start every engine and register every worker."""
        for w in self:
            w.engine.start()
        for w in self:
            await w.client.start()

    async def stop(self) -> None:
        """Stop heartbeating and deregister every live worker; stop the engines."""
        for w in self:
            if not w.killed:
                await w.client.stop(deregister=True)
            await w.engine.stop()

    def get(self, worker_id: str) -> EmulatedWorker | None:
        """The worker if it is alive (None for an unknown or killed one)."""
        w = self.workers.get(worker_id)
        return w if w is not None and w.engine.alive and not w.killed else None

    # -- links ------------------------------------------------------------------------------

    def link(self, src_id: str, dst_id: str) -> Link:
        """The physical link from one worker to another, with any injected slowdown."""
        src, dst = self.workers[src_id].view, self.workers[dst_id].view
        _, link = self.cluster.links.between(src, dst)
        factor = self._slow.get((src.pool_id, dst.pool_id), 1.0)
        if factor != 1.0:
            link = Link(gbps=link.gbps / factor, latency_ms=link.latency_ms)
        return link

    @staticmethod
    def transfer_ms(link: Link, nbytes: int, conversion_ms_per_gib: float = 0.0) -> float:
        """Emulated ms to move ``nbytes``: the link time plus the format conversion."""
        return link.transfer_ms(nbytes) + conversion_ms_per_gib * nbytes / (1 << 30)

    # -- faults -----------------------------------------------------------------------------

    def slow_link(self, src_pool: str, dst_pool: str, factor: float) -> None:
        """Divide the bandwidth of every transfer from ``src_pool`` to ``dst_pool``."""
        if not factor >= 1.0:
            raise ValueError(f"slowdown factor must be >= 1, got {factor}")
        self._slow[(src_pool, dst_pool)] = factor
        log.warning("fault_link_slowed", src_pool=src_pool, dst_pool=dst_pool, factor=factor)

    async def kill(self, worker_id: str) -> None:
        """Crash one worker: its engine fails all its work, its heartbeats stop."""
        w = self.workers[worker_id]
        w.killed = True
        w.killed_at_unix_ms = self.clock.now_ms()
        w.engine.kill()
        await w.client.kill()
        log.warning("fault_worker_killed", worker_id=worker_id)

    def fill_pool(self, pool_id: str, fraction: float) -> list[str]:
        """Occupy ``fraction`` of every worker's KV memory in ``pool_id``; returns the ids."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        ids = []
        for w in self:
            if w.view.pool_id == pool_id:
                cap = w.engine.spec.kv_capacity_tokens
                w.engine.set_ballast(int(cap * fraction))
                ids.append(w.worker_id)
        if not ids:
            raise ValueError(f"no pool {pool_id!r}; pools: {', '.join(self.pools())}")
        log.warning("fault_pool_filled", pool_id=pool_id, fraction=fraction)
        return ids
