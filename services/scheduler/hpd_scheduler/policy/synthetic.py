"""Synthetic heterogeneous fleets, for tests, benchmarks and examples (seeded, no I/O).

Pools cycle through realistic shapes: H100 TP2 prefill pools, A100 / H200 / L40S decode pools
(some in fp8 or another layout, so hand-offs need conversions or recomputes), and H100
both-stage (colocated) pools; spread over two zones, 8 workers per rack.
"""

from __future__ import annotations

import random

from hpd_common.kvformat import KvDtype, KvLayout
from hpd_common.perfmodel import model_spec

from .domain import (
    Health,
    LoadReport,
    NetworkLocation,
    Stage,
    WorkerSpec,
    WorkerView,
    declared_stages,
)

__all__ = ["POOL_SHAPES", "synthetic_fleet"]

GIB = 1 << 30

POOL_SHAPES: tuple[tuple[str, Stage, str, int, KvDtype, KvLayout], ...] = (
    ("h100-prefill", Stage.PREFILL, "H100-SXM", 2, KvDtype.BF16, KvLayout.PAGED_NHD),
    ("a100-decode", Stage.DECODE, "A100-80G", 2, KvDtype.BF16, KvLayout.PAGED_NHD),
    ("l40s-decode", Stage.DECODE, "L40S", 1, KvDtype.BF16, KvLayout.PAGED_HND),
    ("h200-decode", Stage.DECODE, "H200", 1, KvDtype.BF16, KvLayout.PAGED_NHD),
    ("h100-both", Stage.BOTH, "H100-SXM", 1, KvDtype.BF16, KvLayout.PAGED_NHD),
    ("l4-prefill", Stage.PREFILL, "L4", 1, KvDtype.BF16, KvLayout.PAGED_NHD),
    ("a100-fp8-decode", Stage.DECODE, "A100-80G", 1, KvDtype.FP8_E4M3, KvLayout.PAGED_NHD),
)


def synthetic_fleet(
    n: int,
    rng: random.Random,
    now_s: float = 1000.0,
    model_id: str = "llama-3-8b",
    pool_size: int = 8,
    unhealthy_share: float = 0.03,
) -> list[WorkerView]:
    """``n`` worker views with random but plausible load (seeded by ``rng``)."""
    spec = model_spec(model_id)
    views: list[WorkerView] = []
    for i in range(n):
        pool_no = i // pool_size
        name, stage, gpu, tp, dtype, layout = POOL_SHAPES[pool_no % len(POOL_SHAPES)]
        kv_total = int(rng.uniform(20, 60) * GIB) * tp
        used = rng.uniform(0.05, 0.95)
        batch_max = 256
        health = Health.HEALTHY
        roll = rng.random()
        if roll < unhealthy_share:
            health = rng.choice(
                [Health.UNHEALTHY, Health.DRAINING, Health.CORDONED, Health.EXPIRED]
            )
        elif roll < unhealthy_share * 2:
            health = Health.SUSPECT
        views.append(
            WorkerView(
                WorkerSpec(
                    worker_id=f"w{i:05d}",
                    pool_id=f"{name}-{pool_no}",
                    endpoint=f"10.0.{i // 256}.{i % 256}:8000",
                    stages=declared_stages(stage),
                    model_id=model_id,
                    model_revision=model_id,
                    engine="vllm",
                    gpu_type=gpu,
                    gpu_count=tp,
                    tp_size=tp,
                    kv_memory_total_bytes=kv_total,
                    max_batch_size=batch_max,
                    kv_format=spec.kv_format(dtype=dtype, layout=layout, tp_size=tp),
                    network=NetworkLocation(
                        zone=f"z{pool_no % 2}", rack=f"r{i // 8}", host=f"h{i // 2}", nic_gbps=200.0
                    ),
                    labels=(("pool", name),),
                ),
                kv_available_bytes=int(kv_total * (1 - used)),
                hard_max_batch_size=512,
                health=health,
                load=LoadReport(
                    reported_at_ms=round((now_s - rng.uniform(0.0, 6.0)) * 1000),
                    queue_depth=rng.randint(0, 24),
                    queue_max=64,
                    running_prefills=rng.randint(0, 4),
                    batch_size=rng.randint(0, batch_max),
                    itl_p50_ms=rng.uniform(8, 60),
                    itl_p99_ms=rng.uniform(20, 120),
                    prefill_tokens_per_s=rng.uniform(5_000, 40_000)
                    if stage is not Stage.DECODE
                    else 0.0,
                    kv_blocks_free=int(1000 * (1 - used)),
                    kv_blocks_total=1000,
                    gpu_util=rng.uniform(0.1, 0.95),
                    memory_util=used,
                ),
            )
        )
    return views
