"""Engine adapters: what an engine says about itself, read from its own HTTP answers. Pure.

An agent needs nothing from its engine but the engine's normal HTTP port. Each adapter
knows which paths to read and how to turn the answers into two values:

* :class:`EngineFacts`, once per (re)registration: the served model, the engine's KV
  geometry (block size, blocks, bytes) and, for SGLang, its P/D role and bootstrap port;
* :class:`EngineSample`, every scrape: the counters and gauges that load is made of.

:class:`LoadTracker` turns consecutive samples into the registry's load report (rates
and latency percentiles come from the differences between two scrapes, never from the
counters' lifetime totals, so a busy minute an hour ago does not colour the report).

The KV dtype is derived, not assumed: vLLM publishes its KV memory in bytes and its size
in tokens (``vllm:cache_config_info``), so the bytes per element are
``kv_cache_memory_bytes / (kv_cache_size_tokens x 2 x layers x kv_heads x head_dim)``
with the geometry from the model's ``config.json``; 2 bytes is read as the model's own
16-bit type (``torch_dtype``: bf16 or fp16), 4 as fp32, 1 as the 8-bit type the engine
names (``cache_dtype``). An engine run with ``--dtype float32`` next to bf16 ones thus
registers as fp32, which is what decides whether its KV can be handed over.

Parsing uses prometheus_client's text parser (the format has escapes, label quoting and
histogram conventions a hand-written splitter gets wrong).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from hpd_common.kvformat import KvDtype, KvLayout

if TYPE_CHECKING:  # the model's config.json (model_config.py raises this module's EngineError)
    from .model_config import ModelGeometry

__all__ = [
    "ADAPTERS",
    "EngineError",
    "EngineFacts",
    "EngineSample",
    "SglangAdapter",
    "VllmAdapter",
    "adapter_for",
    "kv_dtype_from_bytes",
    "parse_metrics",
]


class EngineError(ValueError):
    """An engine answer that cannot be used; ``source`` names the path or file."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
        self.message = message


_SIXTEEN_BIT = {"bfloat16": KvDtype.BF16, "bf16": KvDtype.BF16, "float16": KvDtype.FP16,
                "fp16": KvDtype.FP16, "half": KvDtype.FP16}  # fmt: skip
_NAMED = {
    "fp8": KvDtype.FP8_E4M3,
    "fp8_e4m3": KvDtype.FP8_E4M3,
    "fp8_e5m2": KvDtype.FP8_E5M2,
    "int8": KvDtype.INT8,
    "float32": KvDtype.FP32,
    "fp32": KvDtype.FP32,
    **_SIXTEEN_BIT,
}


def kv_dtype_from_bytes(elem_bytes: float, cache_dtype: str, model_dtype: str) -> KvDtype:
    """The KV element type from its measured width (module docstring).

    ``cache_dtype`` is the engine's ``--kv-cache-dtype`` ("auto" = the model's dtype);
    ``model_dtype`` the config's ``torch_dtype``. A width that fits neither raises.
    """
    named = _NAMED.get(cache_dtype.lower()) if cache_dtype else None
    width = round(elem_bytes * 4) / 4
    if named is not None and named.bytes == width:
        return named
    if width == 4:
        return KvDtype.FP32
    if width == 2:
        return _SIXTEEN_BIT.get(model_dtype.lower(), KvDtype.BF16)
    if width == 1:
        return named if named is not None and named.bytes == 1 else KvDtype.FP8_E4M3
    raise EngineError(
        "cache_config_info",
        f"KV bytes per element {elem_bytes:g} fit no known dtype (layers, heads or head_dim "
        "of config.json do not match the engine's model?)",
    )


# -- Prometheus text -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Series:
    """One sample line: metric name (with suffix), labels, value."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_metrics(text: str, source: str = "/metrics") -> list[Series]:
    """Every sample of a Prometheus text exposition; malformed text raises EngineError.

    The format ends every line with a newline; text that does not was cut short in transit
    (a number cut inside its digits would read as a smaller one), so it is refused.
    """
    if text and not text.endswith("\n"):
        raise EngineError(
            source, "not a Prometheus text exposition: truncated (the last line has no newline)"
        )
    try:
        return [
            Series(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]
    except (ValueError, TypeError, IndexError) as exc:
        raise EngineError(source, f"not a Prometheus text exposition ({exc})") from exc


def _values(series: Sequence[Series], name: str, match: Mapping[str, str]) -> list[float]:
    vals = [
        s.value
        for s in series
        if s.name == name and all(s.labels.get(k) == v for k, v in match.items())
    ]
    bad = [v for v in vals if not math.isfinite(v)]
    if bad:
        raise EngineError("/metrics", f"{name} is {bad[0]} (not a finite number)")
    return vals


def _sum(series: Sequence[Series], name: str, **match: str) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``match``; None if absent.

    For counts (requests, tokens): an engine running several data-parallel ranks exports
    one series per rank, and the worker's count is their sum.
    """
    vals = _values(series, name, match)
    return math.fsum(vals) if vals else None


def _mean(series: Sequence[Series], name: str, **match: str) -> float | None:
    """Mean of the matching samples; None if absent. For fractions (KV usage, hit rate):
    one series per data-parallel rank, each of the same capacity, so the mean is the
    worker's fraction where a sum would exceed 1."""
    vals = _values(series, name, match)
    return math.fsum(vals) / len(vals) if vals else None


def _buckets(series: Sequence[Series], name: str) -> tuple[tuple[float, float], ...]:
    """Cumulative (upper bound, count) pairs of a histogram, summed over label sets."""
    acc: dict[float, float] = {}
    for s in series:
        if s.name == name + "_bucket" and "le" in s.labels:
            le = float(s.labels["le"])
            acc[le] = acc.get(le, 0.0) + s.value
    return tuple(sorted(acc.items()))


# -- what an adapter returns ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine states about itself (read at registration).

    ``kv_dtype`` is None when the engine's answers cannot tell it (the agent then needs a
    ``--kv-dtype`` flag). ``kv_blocks_total`` and ``kv_memory_bytes`` are 0 when unknown.
    """

    engine: str
    engine_version: str
    model_id: str
    max_model_len: int
    block_size_tokens: int
    kv_blocks_total: int
    kv_memory_bytes: int
    kv_dtype: KvDtype | None
    kv_layout: KvLayout = KvLayout.PAGED_NHD
    max_num_seqs: int = 0
    pd_role: str = ""  # SGLang's disaggregation_mode: "prefill", "decode" or "" (null)
    bootstrap_port: int = 0  # SGLang's disaggregation bootstrap port (prefill side)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape's gauges and counters (counters are lifetime totals; ``None`` = absent).

    ``itl_buckets`` and ``prefill_time`` come from histograms: cumulative ``(le, count)``
    pairs and (sum of seconds, count).
    """

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    prefix_hit_rate: float | None = None  # engines that export a rate gauge, not counters
    prompt_tokens_computed: float | None = None
    prompt_tokens_external: float | None = None  # KV received from another engine
    generation_tokens: float | None = None
    prefill_time_s: float | None = None
    itl_buckets: tuple[tuple[float, float], ...] = ()


class EngineAdapter(Protocol):
    """One engine family: the paths it answers on and how to read them."""

    @property
    def name(self) -> str:
        """Engine family, as registered (``engine`` of the capability record)."""
        ...

    @property
    def info_paths(self) -> tuple[str, ...]:
        """Paths read at registration, in order; each answer goes to :meth:`facts` by path."""
        ...

    @property
    def metrics_path(self) -> str: ...

    @property
    def health_path(self) -> str: ...

    def facts(self, answers: Mapping[str, str], geometry: ModelGeometry | None) -> EngineFacts:
        """The engine's facts from the answers to ``info_paths``."""
        ...

    def sample(self, metrics_text: str) -> EngineSample:
        """One scrape of ``metrics_path``."""
        ...


def _models(text: str, source: str) -> tuple[str, int]:
    """(model id, max_model_len or 0) of an OpenAI ``/v1/models`` answer (the first model)."""
    try:
        body = json.loads(text)
        first = body["data"][0]
        model_id = str(first["id"])
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise EngineError(source, "no model listed (expected {'data': [{'id': ...}]})") from exc
    max_len = first.get("max_model_len") or 0
    return model_id, int(max_len) if isinstance(max_len, int) else 0


def _int_label(labels: Mapping[str, str], key: str) -> int:
    raw = labels.get(key, "")
    try:
        return int(float(raw))
    except ValueError:
        return 0


class VllmAdapter:
    """vLLM's OpenAI server: ``/v1/models``, ``/version``, ``/metrics`` (``vllm:*``).

    Facts: the model and max length from ``/v1/models``; block size, GPU blocks, KV bytes and
    KV size in tokens from the labels of ``vllm:cache_config_info``; the KV dtype from those
    bytes (module docstring). Load: ``vllm:num_requests_running`` / ``_waiting``,
    ``vllm:kv_cache_usage_perc``, the prefix-cache query/hit counters,
    ``vllm:prompt_tokens_by_source_total{source="local_compute"}`` (tokens this engine really
    computed), the prefill-time and inter-token-latency histograms.
    """

    name = "vllm"
    info_paths = ("/v1/models", "/version", "/metrics")
    metrics_path = "/metrics"
    health_path = "/health"

    def facts(self, answers: Mapping[str, str], geometry: ModelGeometry | None) -> EngineFacts:
        model_id, max_len = _models(answers["/v1/models"], "/v1/models")
        version = ""
        try:
            version = str(json.loads(answers.get("/version") or "{}").get("version", ""))
        except (json.JSONDecodeError, AttributeError):
            version = ""
        series = parse_metrics(answers["/metrics"])
        info = [s for s in series if s.name == "vllm:cache_config_info"]
        if not info:
            raise EngineError("/metrics", "has no vllm:cache_config_info (is this vLLM?)")
        labels = info[0].labels
        block = _int_label(labels, "block_size")
        if block <= 0:
            raise EngineError("/metrics", "vllm:cache_config_info has no block_size")
        # one series per data-parallel rank (label ``engine``): the worker holds them all
        ranks = {s.labels.get("engine", ""): s.labels for s in info}.values()
        blocks = sum(_int_label(r, "num_gpu_blocks") for r in ranks)
        kv_bytes = sum(_int_label(r, "kv_cache_memory_bytes") for r in ranks)
        kv_tokens = sum(_int_label(r, "kv_cache_size_tokens") for r in ranks) or blocks * block
        cache_dtype = labels.get("cache_dtype", "auto")
        dtype: KvDtype | None = None
        if _int_label(labels, "num_gpu_blocks_override") > 0 and geometry is not None:
            # the blocks were set by the operator, not sized from the memory: the memory
            # figure is the budget, not what the blocks hold (64 blocks against a 1 GiB budget
            # read as 341 bytes an element, and the engine never joined its fleet), so the
            # width is the named one and the size is the blocks'
            dtype = _NAMED.get(cache_dtype.lower()) or _NAMED.get(
                geometry.dtype.lower(), KvDtype.BF16
            )
            tokens = blocks * block or kv_tokens
            elements = tokens * 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim
            kv_bytes = round(elements * dtype.bytes)
        elif geometry is not None and kv_bytes > 0 and kv_tokens > 0:
            per_elem = kv_bytes / (
                kv_tokens * 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim
            )
            dtype = kv_dtype_from_bytes(per_elem, cache_dtype, geometry.dtype)
        elif cache_dtype.lower() in _NAMED:
            dtype = _NAMED[cache_dtype.lower()]
        layout_name = labels.get("kv_cache_layout", "None").upper()
        layout = KvLayout.PAGED_HND if layout_name == "HND" else KvLayout.PAGED_NHD
        return EngineFacts(
            engine="vllm",
            engine_version=version,
            model_id=model_id,
            max_model_len=max_len,
            block_size_tokens=block,
            kv_blocks_total=blocks,
            kv_memory_bytes=kv_bytes,
            kv_dtype=dtype,
            kv_layout=layout,
        )

    def sample(self, metrics_text: str) -> EngineSample:
        s = parse_metrics(metrics_text)
        running = _sum(s, "vllm:num_requests_running")
        waiting = _sum(s, "vllm:num_requests_waiting")
        usage = _mean(s, "vllm:kv_cache_usage_perc")
        if running is None or waiting is None or usage is None:
            raise EngineError(
                "/metrics",
                "lacks vllm:num_requests_running, vllm:num_requests_waiting or "
                "vllm:kv_cache_usage_perc",
            )
        return EngineSample(
            running=int(running),
            waiting=int(waiting),
            kv_usage=min(1.0, max(0.0, usage)),
            prefix_queries=_sum(s, "vllm:prefix_cache_queries_total"),
            prefix_hits=_sum(s, "vllm:prefix_cache_hits_total"),
            prompt_tokens_computed=_sum(
                s, "vllm:prompt_tokens_by_source_total", source="local_compute"
            ),
            prompt_tokens_external=_sum(
                s, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
            ),
            generation_tokens=_sum(s, "vllm:generation_tokens_total"),
            prefill_time_s=_sum(s, "vllm:request_prefill_time_seconds_sum"),
            itl_buckets=_buckets(s, "vllm:inter_token_latency_seconds"),
        )


class SglangAdapter:
    """SGLang's server: ``/v1/models``, ``/get_server_info``, ``/metrics`` (``sglang:*``).

    Facts: the model from ``/v1/models``; page size, KV dtype, context length, the maximum
    running requests, the P/D role (``disaggregation_mode``) and bootstrap port from the
    server arguments that ``/get_server_info`` returns; the KV pool's size in tokens
    (``max_total_num_tokens``) gives the blocks. Load: ``sglang:num_running_reqs``,
    ``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:cache_hit_rate`` (a ratio,
    used as is), ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total`` and the
    ``sglang:inter_token_latency_seconds`` histogram.
    """

    name = "sglang"
    info_paths = ("/v1/models", "/get_server_info", "/metrics")
    metrics_path = "/metrics"
    health_path = "/health"

    def facts(self, answers: Mapping[str, str], geometry: ModelGeometry | None) -> EngineFacts:
        model_id, max_len = _models(answers["/v1/models"], "/v1/models")
        try:
            info = json.loads(answers["/get_server_info"])
        except json.JSONDecodeError as exc:
            raise EngineError("/get_server_info", "not JSON") from exc
        if not isinstance(info, dict):
            raise EngineError("/get_server_info", "must be a JSON object")
        nested = info.get("server_args")
        args: dict[str, Any] = nested if isinstance(nested, dict) else info
        page = args.get("page_size")
        page = 1 if page is None else page  # SGLang's default: token-granular pages
        if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
            raise EngineError("/get_server_info", f"page_size must be positive, got {page!r}")
        tokens = info.get("max_total_num_tokens") or args.get("max_total_num_tokens") or 0
        kv_name = str(args.get("kv_cache_dtype") or "auto").lower()
        model_dtype = str(args.get("dtype") or "auto").lower()
        if kv_name in _NAMED:
            dtype: KvDtype | None = _NAMED[kv_name]
        elif model_dtype in _NAMED:
            dtype = _NAMED[model_dtype]
        elif geometry is not None and geometry.dtype.lower() in _NAMED:
            dtype = _NAMED[geometry.dtype.lower()]
        else:
            dtype = None
        kv_bytes = 0
        if geometry is not None and dtype is not None and isinstance(tokens, int):
            kv_bytes = int(
                tokens * 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_dim
                * dtype.bytes
            )  # fmt: skip
        mode = str(args.get("disaggregation_mode") or "null").lower()
        boot = args.get("disaggregation_bootstrap_port") or 0
        ctx = args.get("context_length") or info.get("context_length") or max_len
        return EngineFacts(
            engine="sglang",
            engine_version=str(info.get("version", "")),
            model_id=model_id,
            max_model_len=int(ctx) if isinstance(ctx, int) else max_len,
            block_size_tokens=page,
            kv_blocks_total=int(tokens) // page if isinstance(tokens, int) else 0,
            kv_memory_bytes=kv_bytes,
            kv_dtype=dtype,
            max_num_seqs=int(args.get("max_running_requests") or 0),
            pd_role="" if mode == "null" else mode,
            bootstrap_port=int(boot) if isinstance(boot, int) else 0,
        )

    def sample(self, metrics_text: str) -> EngineSample:
        s = parse_metrics(metrics_text)
        running = _sum(s, "sglang:num_running_reqs")
        waiting = _sum(s, "sglang:num_queue_reqs")
        usage = _mean(s, "sglang:token_usage")
        if running is None or waiting is None or usage is None:
            raise EngineError(
                "/metrics",
                "lacks sglang:num_running_reqs, sglang:num_queue_reqs or sglang:token_usage",
            )
        hit_rate = _mean(s, "sglang:cache_hit_rate")
        return EngineSample(
            running=int(running),
            waiting=int(waiting),
            kv_usage=min(1.0, max(0.0, usage)),
            prefix_hit_rate=None if hit_rate is None else min(1.0, max(0.0, hit_rate)),
            prompt_tokens_computed=_sum(s, "sglang:prompt_tokens_total"),
            generation_tokens=_sum(s, "sglang:generation_tokens_total"),
            itl_buckets=_buckets(s, "sglang:inter_token_latency_seconds"),
        )


ADAPTERS: dict[str, EngineAdapter] = {"vllm": VllmAdapter(), "sglang": SglangAdapter()}


def adapter_for(name: str) -> EngineAdapter:
    """The adapter of an engine family; ValueError naming the known ones otherwise."""
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ADAPTERS))}") from None
