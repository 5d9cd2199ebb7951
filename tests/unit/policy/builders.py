"""Small builders for worker views and fleets used by the policy tests."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpd_common.kvformat import KvDtype, KvLayout
from hpd_common.perfmodel import model_spec
from hpd_scheduler import policy
from hpd_scheduler.policy import (
    Decision,
    Fleet,
    Health,
    LinkModel,
    LoadReport,
    NetworkLocation,
    Planner,
    Profile,
    Request,
    Role,
    Stage,
    WorkerSpec,
    WorkerView,
    builtin_profile,
    declared_stages,
)
from hpd_scheduler.policy.domain import ResourceNeed
from hpd_scheduler.policy.framework import RequestContext
from hpd_scheduler.policy.worker_state import WorkerState

GIB = 1 << 30
NOW = 1000.0
MODEL = "llama-3-8b"


def worker(
    worker_id: str,
    stage: Stage = Stage.DECODE,
    *,
    pool: str | None = None,
    gpu: str = "H100-SXM",
    tp: int = 1,
    dtype: KvDtype = KvDtype.BF16,
    layout: KvLayout = KvLayout.PAGED_NHD,
    kv_total_gib: float = 40.0,
    kv_free_gib: float = 30.0,
    queue: int = 0,
    batch: int = 0,
    itl_p50_ms: float = 0.0,
    prefill_tps: float = 0.0,
    prefill_busy: float = 0.0,
    reported_at: float | None = NOW,
    health: Health = Health.HEALTHY,
    zone: str = "z1",
    rack: str = "r1",
    host: str | None = None,
    nic_gbps: float = 400.0,
    revision: str = MODEL,
    **extra: Any,
) -> WorkerView:
    """A worker serving llama-3-8b with sensible defaults."""
    load = None
    if reported_at is not None:
        load = LoadReport(
            reported_at_ms=round(reported_at * 1000),
            queue_depth=queue,
            queue_max=64,
            batch_size=batch,
            itl_p50_ms=itl_p50_ms,
            prefill_tokens_per_s=prefill_tps,
            prefill_busy=prefill_busy,
        )
    spec_extra = {k: extra.pop(k) for k in list(extra) if k in WorkerSpec.__dataclass_fields__}
    if "labels" in spec_extra:
        spec_extra["labels"] = tuple(sorted(dict(spec_extra["labels"]).items()))
    spec = WorkerSpec(
        **{
            "worker_id": worker_id,
            "pool_id": pool or f"pool-{worker_id}",
            "endpoint": f"{worker_id}:8000",
            "stages": declared_stages(stage),
            "model_id": MODEL,
            "model_revision": revision,
            "engine": "vllm",
            "gpu_type": gpu,
            "gpu_count": tp,
            "tp_size": tp,
            "kv_memory_total_bytes": int(kv_total_gib * GIB),
            "max_batch_size": 256,
            "kv_format": model_spec(MODEL).kv_format(dtype=dtype, layout=layout, tp_size=tp),
            "network": NetworkLocation(
                zone=zone, rack=rack, host=host or f"host-{worker_id}", nic_gbps=nic_gbps
            ),
            **spec_extra,
        }
    )
    return WorkerView(
        spec, kv_available_bytes=int(kv_free_gib * GIB), health=health, load=load, **extra
    )


def state(**kw: Any) -> WorkerState:
    """The snapshot entry of one A100 decode worker built with ``worker(**kw)``."""
    ws = Fleet.build([worker("d", gpu="A100-80G", **kw)], NOW).worker("d")
    assert ws is not None
    return ws


def request(
    prompt: int = 3000, output: int = 128, tier: str = "standard", rid: str = "r1", **extra: Any
) -> Request:
    """A llama-3-8b request."""
    return Request(rid, MODEL, prompt, output, tier, **extra)


# the planner tests' profiles and shortcuts
DEFAULT = builtin_profile("default")
# the default profile with every decode worker's own prefill offered only where the seed rule
# would (no pair can transfer faster): for tests about the choice among prefill workers,
# which an idle decode worker prefilling for itself would otherwise pre-empt
DISAGGREGATED = replace(
    DEFAULT,
    slo_objective=replace(DEFAULT.slo_objective, conditional=False),  # type: ignore[type-var]
)


def plan(
    views: list[WorkerView],
    req: Request | None = None,
    profile: Profile = DEFAULT,
    links: LinkModel | None = None,
) -> tuple[Decision, Fleet]:
    fleet = Fleet.build(views, NOW, links=links)
    return Planner(profile).plan(req or request(), fleet, NOW, random.Random(7)), fleet


def ctx_for(fleet: Fleet, tier: str = "standard", req: Request | None = None) -> RequestContext:
    r = req or request(tier=tier)
    return RequestContext(
        r,
        DEFAULT.tier(tier),
        ResourceNeed.SHARED,
        NOW,
        fleet,
        fleet.index(MODEL, Role.PREFILL),
        fleet.index(MODEL, Role.DECODE),
    )


DEFAULT_PATH = Path(str(policy.__file__)).parent / "profiles" / "default.yaml"
"""The default profile's YAML (tests edit a copy of it)."""
