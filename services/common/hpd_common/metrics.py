"""Prometheus metrics shared by every service, and the HTTP endpoint that serves them."""

from __future__ import annotations

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

_started: set[int] = set()


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Starts the /metrics HTTP endpoint once per port; port 0 disables it."""
    if port and port not in _started:
        start_http_server(port, addr=host)
        _started.add(port)
