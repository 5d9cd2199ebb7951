"""Hand-built planning problems: kinds, buckets and per-request costs set by hand (not by the
performance model), so that the integer program's answer is known."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpd_common.gpus import gpu_profile
from hpd_plan.capacity import Cost, Group, Headroom
from hpd_plan.catalogue import GpuKind
from hpd_plan.milp import Problem
from hpd_plan.traffic import Bucket
from hpd_sim.metrics import Slo

SLO = Slo(1000.0, 50.0)
FULL = Headroom(1.0, 1.0, 1.0)


def kind(name: str, price: float, available: int | None = None) -> GpuKind:
    return GpuKind(name, gpu_profile("L40S"), price, available, (1,), True)


def bucket(rate: float, tier: str = "standard", share: float = 1.0) -> Bucket:
    return Bucket(tier, SLO, 1000, 100, rate, share, ((1000, 0, 100),))


def problem(
    buckets: Sequence[Bucket],
    speeds: Mapping[str, tuple[GpuKind, float, float]],
    headroom: Headroom = FULL,
    miss: Mapping[tuple[int, str], float] | None = None,
    roles: Sequence[str] = ("prefill", "decode"),
) -> Problem:
    """Groups of each kind in ``roles``; a request costs (prefill s, decode s) of
    ``speeds[name]`` on that kind, for every bucket scaled by nothing."""
    groups: list[Group] = []
    costs: dict[tuple[int, int], Cost] = {}
    for name, (k, ps, ds) in speeds.items():
        for role in roles:
            j = len(groups)
            groups.append(Group(k, 1, role, 0.5 if role == "both" else 0.0))
            for i in range(len(buckets)):
                m = (miss or {}).get((i, name), 0.0)
                p = ps if role != "decode" else 0.0
                d = ds if role != "prefill" else 0.0
                costs[(i, j)] = Cost(p, d, m)
    available = {k.name: k.available for k, _, _ in speeds.values()}
    return Problem(buckets, groups, costs, headroom, 0.05, available)


def by_kind(pools: Mapping[tuple[str, int, str], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (k, _, _), n in pools.items():
        out[k] = out.get(k, 0) + n
    return out
