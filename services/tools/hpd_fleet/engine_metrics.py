"""An emulated worker's ``/metrics`` under vLLM's names (``hpd_fleet.engine_http`` serves
them): what its HTTP server counts (prompt tokens by where their KV came from, tokens
generated, requests finished, KV bytes pulled, requests running) and what its engine
holds (queue, KV cache use and configuration), read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .fleet import EmulatedWorker

__all__ = ["Counters", "EngineMetrics"]


@dataclass(slots=True)
class Counters:
    prompt_by_source: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("local_compute", "local_cache_hit", "external_kv_transfer"), 0
        )
    )
    generation: int = 0
    success: int = 0
    kv_bytes_pulled: int = 0
    running: int = 0


class EngineMetrics(Collector):
    """vLLM's metric names over one emulated worker's state, read at scrape time."""

    def __init__(self, worker: EmulatedWorker, counters: Counters) -> None:
        self.worker = worker
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        eng, cnt = self.worker.engine, self.counters
        spec = eng.spec
        model = self.worker.view.model_id
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([model], value)
            return g

        yield gauge("vllm:num_requests_running", "Requests in the batch.", cnt.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting.", eng.queue_depth())
        used = eng.used_tokens + eng.ballast_tokens
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage (1 = full).",
            min(1.0, used / spec.kv_capacity_tokens),
        )  # fmt: skip
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache configuration.",
            labels=["block_size", "num_gpu_blocks", "cache_dtype"],
        )  # fmt: skip
        info.add_metric(
            [
                str(spec.block_size_tokens),
                str(spec.kv_capacity_tokens // spec.block_size_tokens),
                str(spec.kv_dtype.value),
            ],
            1.0,
        )
        yield info
        src = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
            labels=["model_name", "source"],
        )  # fmt: skip
        for source, n in cnt.prompt_by_source.items():
            src.add_metric([model, source], n)
        yield src
        gen = CounterMetricFamily("vllm:generation_tokens", "Tokens generated.", labels=labels)
        gen.add_metric([model], cnt.generation)
        yield gen
        ok = CounterMetricFamily("vllm:request_success", "Requests finished.", labels=labels)
        ok.add_metric([model], cnt.success)
        yield ok
        pulled = CounterMetricFamily(
            "vllm:nixl_bytes_transferred", "KV bytes pulled from prefill engines.", labels=labels
        )
        pulled.add_metric([model], cnt.kv_bytes_pulled)
        yield pulled
