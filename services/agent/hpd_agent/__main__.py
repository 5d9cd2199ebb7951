"""`hpd agent`: put one running engine (vLLM, SGLang) under hetero-pd.

Run one agent beside each engine instance. It needs nothing from the engine but its HTTP
port (and the model folder's ``config.json``, for the KV geometry):

    hpd agent --engine-url http://127.0.0.1:8100 --model-dir /models/llama-3-8b \\
        --role prefill --gpu-type H100-SXM --zone z1 \\
        --kv-connector nixl --kv-side-channel 10.0.0.5:5600

Every setting is also an environment variable (``HPD_<NAME>``) and a key of the YAML file
given by ``--config``. Exit codes: 0 after SIGTERM/SIGINT or a completed drain, 2 when the
engine cannot be described (the message names the flag to give).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import REGISTRY

from hpd_common import tracing
from hpd_common.channels import CallIdentity
from hpd_common.clock import SystemClock
from hpd_common.errors import InvalidArgument
from hpd_common.logging import configure_logging
from hpd_common.metrics import serve_metrics
from hpd_common.settings import load_settings, settings_parser, split_csv

from .agent import EXIT_CONFIG, Agent, AgentMetrics, AgentTiming
from .capability import ROLES, AgentFlags
from .engines import ADAPTERS, adapter_for


@dataclass(frozen=True)
class AgentSettings:
    """Flags of `hpd agent` (each also HPD_<NAME> and a YAML key)."""

    engine_url: str = field(
        default="", metadata={"help": "the engine's HTTP base URL, e.g. http://127.0.0.1:8000"}
    )
    engine: str = field(default="vllm", metadata={"help": f"engine family: {', '.join(ADAPTERS)}"})
    model_dir: str = field(
        default="", metadata={"help": "model folder holding config.json (layers, KV heads, ...)"}
    )
    role: str = field(default="both", metadata={"help": f"P/D role: {', '.join(ROLES)}"})
    registry: str = field(default="127.0.0.1:50051", metadata={"help": "registry host:port"})
    worker_id: str = field(
        default="", metadata={"help": "worker id (default <engine>-<host>-<port>)"}
    )
    pool_id: str = field(default="", metadata={"help": "pool (default <model>-<role>-<gpu type>)"})
    endpoint: str = field(
        default="", metadata={"help": "host:port gateways reach the engine at (default: the URL's)"}
    )
    model_id: str = field(default="", metadata={"help": "model id (default: the engine's first)"})
    model_revision: str = field(
        default="", metadata={"help": "model revision (default: cfg-<sha256 of config.json>)"}
    )
    gpu_type: str = field(
        default="", metadata={"help": "GPU profile (H100-SXM, A100-80G, L40S, ...); required"}
    )
    gpu_count: int = field(default=1, metadata={"help": "GPUs of the instance"})
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel size of the instance"})
    peak_tflops: float = field(
        default=0.0, metadata={"help": "peak TFLOP/s per GPU (needed for an unknown --gpu-type)"}
    )
    hbm_gbps: float = field(
        default=0.0, metadata={"help": "memory GB/s per GPU (needed for an unknown --gpu-type)"}
    )
    zone: str = field(default="", metadata={"help": "network zone"})
    rack: str = field(default="", metadata={"help": "rack"})
    host: str = field(default="", metadata={"help": "host name (default: the engine URL's host)"})
    nic_gbps: float = field(
        default=0.0, metadata={"help": "NIC Gb/s for KV transfer (0 = unknown)"}
    )
    kv_connector: str = field(
        default="", metadata={"help": "KV connector the engine runs, e.g. nixl (label)"}
    )
    kv_side_channel: str = field(
        default="", metadata={"help": "host:port of the connector's handshake (label)"}
    )
    kv_events_endpoint: str = field(
        default="",
        metadata={
            "help": "the engine's ZMQ KV event publisher, e.g. tcp://127.0.0.1:5557 (vLLM:"
            " --kv-events-config with publisher zmq): stored and evicted prefix blocks go to"
            " the scheduler's prefix index; empty = no prefix-aware routing for this engine"
        },
    )
    kv_events_topic: str = field(
        default="", metadata={"help": "topic of the KV event messages ('' = every topic)"}
    )
    kv_events_replay_endpoint: str = field(
        default="",
        metadata={
            "help": "the engine's KV event replay socket, e.g. tcp://127.0.0.1:5558 (vLLM:"
            " replay_endpoint in --kv-events-config): on start and after lost messages the"
            " agent reports the engine's kept history, so the prefix index holds what the"
            " engine cached before this agent started; empty = the index starts empty"
        },
    )
    kv_role: str = field(
        default="",
        metadata={
            "help": "which way the connector moves KV: producer, consumer, both, or none"
            " for an engine without a KV connector (never a transfer's end; label;"
            " default: prefill -> producer, decode -> consumer, both -> both)"
        },
    )
    kv_dtype: str = field(
        default="", metadata={"help": "KV dtype, only for an engine that does not state it"}
    )
    attention_backend: str = field(
        default="", metadata={"help": "attention kernels (default: the engine family's name)"}
    )
    max_batch_size: int = field(
        default=0, metadata={"help": "sequences per batch (default: the engine's, else 256)"}
    )
    labels: str = field(default="", metadata={"help": "extra labels, k=v,k=v"})
    scrape_period_s: float = field(
        default=1.0, metadata={"help": "seconds between engine scrapes (and heartbeats)"}
    )
    engine_down_after_s: float = field(
        default=3.0,
        metadata={"help": "an engine refusing connections this long is deregistered"},
    )
    engine_hung_after_s: float = field(
        default=30.0,
        metadata={
            "help": "an engine whose scrapes only time out (busy, not gone) is deregistered"
            " after this long; until then it stays registered as unhealthy"
        },
    )
    lease_ttl_ms: int = field(default=0, metadata={"help": "requested lease (0 = registry's)"})
    token: str = field(
        default="",
        metadata={"help": "bearer token (role worker) for a registry that runs with auth"},
    )
    ca_file: str = field(default="", metadata={"help": "PEM CA of the registry (TLS to it)"})
    cert_file: str = field(default="", metadata={"help": "PEM client certificate (mTLS)"})
    key_file: str = field(default="", metadata={"help": "PEM key of cert_file"})
    metrics_port: int = field(default=0, metadata={"help": "the agent's own /metrics (0 = off)"})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "address of /metrics"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    json_logs: bool | None = field(default=None, metadata={"help": "JSON logs (default: no TTY)"})
    tracing: bool = field(
        default=False,
        metadata={"help": "OpenTelemetry traces of the agent's calls to the registry, exported "
                  "over OTLP as the standard OTEL_* variables say (OTEL_EXPORTER_OTLP_ENDPOINT,"
                  " OTEL_TRACES_SAMPLER, ...)"},
    )  # fmt: skip


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in split_csv(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidArgument("labels", f"{item!r} is not key=value")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def flags_of(s: AgentSettings) -> AgentFlags:
    """The capability-relevant settings (InvalidArgument naming a bad one)."""
    if not s.engine_url:
        raise InvalidArgument("engine_url", "is required, e.g. --engine-url http://127.0.0.1:8000")
    return AgentFlags(
        engine_url=s.engine_url,
        role=s.role,
        worker_id=s.worker_id,
        pool_id=s.pool_id,
        endpoint=s.endpoint,
        model_id=s.model_id,
        model_revision=s.model_revision,
        gpu_type=s.gpu_type,
        gpu_count=s.gpu_count,
        tp_size=s.tp_size,
        peak_tflops=s.peak_tflops,
        hbm_gbps=s.hbm_gbps,
        zone=s.zone,
        rack=s.rack,
        host=s.host,
        nic_gbps=s.nic_gbps,
        kv_connector=s.kv_connector,
        kv_side_channel=s.kv_side_channel,
        kv_role=s.kv_role,
        kv_dtype=s.kv_dtype,
        attention_backend=s.attention_backend,
        max_batch_size=s.max_batch_size,
        labels=_labels(s.labels),
    )


async def _run(s: AgentSettings, flags: AgentFlags) -> int:
    agent = Agent(
        flags,
        adapter_for(s.engine),
        Path(s.model_dir) if s.model_dir else None,
        s.registry,
        SystemClock(),
        AgentTiming(
            scrape_period_s=s.scrape_period_s,
            engine_down_after_s=s.engine_down_after_s,
            lease_ttl_ms=s.lease_ttl_ms,
            engine_hung_after_s=s.engine_hung_after_s,
        ),
        AgentMetrics(REGISTRY),
        identity=CallIdentity(s.token, s.ca_file, s.cert_file, s.key_file),
        kv_events_endpoint=s.kv_events_endpoint,
        kv_events_topic=s.kv_events_topic,
        kv_events_replay_endpoint=s.kv_events_replay_endpoint,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)
    return await agent.run()


def main(argv: Sequence[str] | None = None) -> int:
    prog = "hpd agent"
    parser = settings_parser(prog, __doc__, AgentSettings)
    args = parser.parse_args(argv)
    try:
        settings = load_settings(AgentSettings, args)
        configure_logging(settings.log_level, settings.json_logs)
        flags = flags_of(settings)
        adapter_for(settings.engine)
        if settings.role not in ROLES:
            raise InvalidArgument("role", f"must be one of {', '.join(ROLES)}")
        AgentTiming(
            settings.scrape_period_s,
            settings.engine_down_after_s,
            engine_hung_after_s=settings.engine_hung_after_s,
        )
    except (InvalidArgument, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    serve_metrics(settings.metrics_port, settings.metrics_host)
    tracing.configure(settings.tracing, "hpd-agent")
    try:
        return asyncio.run(_run(settings, flags))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
