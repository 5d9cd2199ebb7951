"""The gateway's Prometheus metrics (served on the gateway's metrics listener, not its
public port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hpd_gateway_requests", "Client requests by HTTP status and hand-off mode used",
            ["status", "mode"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "hpd_gateway_ttft_seconds", "Time to first token seen by the client",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "hpd_gateway_tpot_seconds", "Time per output token after the first",
            buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "hpd_gateway_fallbacks", "Fallback steps taken, by the cause of the failed step",
            ["cause"], registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "hpd_gateway_upstream_errors", "Failed engine calls by engine endpoint and cause",
            ["engine", "cause"], registry=r,
        )  # fmt: skip
        self.phase = Histogram(
            "hpd_gateway_phase_seconds",
            "The gateway's own steps before the first engine call: tokenize, schedule",
            ["phase"], buckets=(*_TPOT_BUCKETS, 2.5, 5), registry=r,
        )  # fmt: skip
        self.tokenize_seconds = self.phase.labels("tokenize")  # per request: looked up once
        self.schedule_seconds = self.phase.labels("schedule")
        self.in_flight = Gauge("hpd_gateway_in_flight", "Requests being served", registry=r)
        self.refused = Counter(
            "hpd_gateway_refused", "Connections and requests refused before any work, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.connections = Gauge("hpd_gateway_connections", "Open client connections", registry=r)
        self.tenant_requests = Counter(
            "hpd_gateway_tenant_requests", "Requests per API key's tenant, by HTTP status",
            ["tenant", "status"], registry=r,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "hpd_gateway_tenant_tokens", "Prompt and planned output tokens admitted per tenant",
            ["tenant"], registry=r,
        )  # fmt: skip
