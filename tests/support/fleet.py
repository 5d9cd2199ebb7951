"""Capability records for tests: a small heterogeneous fleet, as protobuf messages."""

from __future__ import annotations

from typing import Any

from hetero_pd.v1 import common_pb2 as c

LLAMA8B = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}


def kv_format(
    tp: int = 1,
    dtype: Any = c.KV_DTYPE_BF16,
    layout: Any = c.KV_LAYOUT_PAGED_NHD,
    block: int = 16,
    revision: str = "rev-a",
    backend: str = "flash_attn",
) -> c.KvFormat:
    return c.KvFormat(
        dtype=dtype,
        layout=layout,
        block_size_tokens=block,
        tp_size=tp,
        attention_backend=backend,
        model_revision=revision,
        **LLAMA8B,
    )


def capability(
    worker_id: str,
    pool_id: str = "h100-prefill",
    stages: tuple[Any, ...] = (c.STAGE_PREFILL,),
    gpu: str = "H100-SXM",
    tp: int = 1,
    model: str = "llama-3-8b",
    revision: str = "rev-a",
    kv_gib: float = 40.0,
    zone: str = "z1",
    rack: str = "r1",
    host: str = "",
    labels: dict[str, str] | None = None,
    **kv: object,
) -> c.WorkerCapability:
    return c.WorkerCapability(
        worker_id=worker_id,
        pool_id=pool_id,
        endpoint=f"{worker_id}.local:8000",
        stages=list(stages),
        model_id=model,
        model_revision=revision,
        engine="vllm",
        engine_version="0.9.0",
        gpu_type=gpu,
        gpu_count=tp,
        tp_size=tp,
        pp_size=1,
        kv_memory_total_bytes=int(kv_gib * 2**30),
        max_batch_size=256,
        kv_format=kv_format(tp=tp, revision=revision, **kv),  # type: ignore[arg-type]
        network=c.NetworkLocation(zone=zone, rack=rack, host=host or worker_id, nic_gbps=200),
        labels=labels or {},
    )


def load(
    queue: int = 0, batch: int = 0, free: int = 1000, total: int = 1000, **kw: float
) -> c.LoadReport:
    return c.LoadReport(
        gpu_util=kw.get("gpu_util", 0.3),
        memory_util=kw.get("memory_util", 0.4),
        kv_blocks_free=free,
        kv_blocks_total=total,
        queue_depth=queue,
        queue_max=64,
        batch_size=batch,
        itl_p50_ms=kw.get("itl_p50_ms", 20.0),
        itl_p99_ms=kw.get("itl_p99_ms", 35.0),
        prefill_tokens_per_s=kw.get("prefill_tokens_per_s", 0.0),
    )
