"""Prometheus metrics shared by every service, and the HTTP endpoint that serves them."""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RPC_SECONDS = Histogram(
    "hpd_rpc_seconds",
    "Server-side RPC handling time.",
    ["method"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5),
)
RPC_ERRORS = Counter(
    "hpd_rpc_errors_total", "RPCs that ended with a non-OK status.", ["method", "code"]
)
REDIS_UP = Gauge("hpd_redis_up", "1 while the state store answers pings.", ["service"])
REDIS_MEMORY_RATIO = Gauge(
    "hpd_redis_memory_used_ratio",
    "Redis used_memory / maxmemory at the last probe (0 when Redis has no maxmemory).",
    ["service"],
)
REDIS_UNREPLICATED = Counter(
    "hpd_redis_unreplicated_writes_total",
    "Script calls acknowledged with fewer replicas than wait_replicas connected (see redis_conn).",
)
DIRECTIVES_DROPPED = Counter(
    "hpd_registry_directives_dropped_total",
    "Directives dropped, oldest first, from a worker's queue that was full of un-acked ones.",
)

GC_PAUSE_SECONDS = Histogram(
    "hpd_gc_pause_seconds",
    "Time the process spent in each garbage collection (every thread stops meanwhile), by"
    " generation; a service freezes its start-up heap (server.freeze_startup_heap), so a"
    " full collection walks only what was allocated since.",
    ["generation"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
)

_started: set[int] = set()
_gc_started: list[float] = []
# one child per generation, made here: the callback then takes no label lock per collection
_GC_PAUSE = {g: GC_PAUSE_SECONDS.labels(str(g)) for g in range(3)}


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_started.append(time.perf_counter())
    elif _gc_started:
        child = _GC_PAUSE.get(info.get("generation", -1))
        elapsed = time.perf_counter() - _gc_started.pop()
        if child is not None:
            child.observe(elapsed)


def watch_gc() -> None:
    """Time every collection of this process into ``hpd_gc_pause_seconds`` (once)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Starts the /metrics HTTP endpoint once per port; port 0 disables it. A process that
    exports metrics also times its garbage collections (:func:`watch_gc`)."""
    if port and port not in _started:
        start_http_server(port, addr=host)
        _started.add(port)
        watch_gc()
