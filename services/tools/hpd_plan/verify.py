"""A candidate fleet as a cluster file of the simulator, and its verification: the same
engine as ``hpd sim --cluster FILE --trace T`` (``hpd_sim.engine.simulate``, the policy
core making every decision), each request judged by its tier's SLO.

The cluster written: one pool per (kind, worker size, role) with workers, all in one zone
(KV moves over the simulator's same-zone link, the link the cost model priced), the kind's
price per GPU-hour, its engine settings, and its learned figures as the pool's ``actual``.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from hpd_common import perfmodel
from hpd_scheduler.policy import Profile
from hpd_sim.cluster import ClusterSpec, parse_cluster
from hpd_sim.engine import SimConfig, simulate
from hpd_sim.metrics import TierSlos
from hpd_sim.traces import Trace

from .catalogue import Catalogue, GpuKind
from .traffic import TierSpec

__all__ = ["Progress", "TierResult", "Verdict", "cluster_doc", "to_cluster", "verify"]

Pool = tuple[str, int, str]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def _gpu_doc(kind: GpuKind) -> Any:
    """The pool's ``gpu``: the table's name, or the kind's figures."""
    if kind.known:
        return kind.gpu.name
    return {
        "name": kind.gpu.name,
        "peak_tflops": kind.gpu.peak_tflops_bf16,
        "hbm_gbps": kind.gpu.hbm_gbps,
        "hbm_gib": kind.gpu.hbm_gib,
        "price_per_hour": kind.price_per_hour,
    }


def _model_doc(model: perfmodel.ModelSpec) -> Any:
    if model.name in perfmodel.MODELS:
        return model.name
    return {
        "name": model.name,
        "params_b": model.params_b,
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "hidden_size": model.hidden_size,
    }


def cluster_doc(
    pools: Mapping[Pool, int],
    catalogue: Catalogue,
    model: perfmodel.ModelSpec,
    name: str,
    description: str = "",
) -> dict[str, Any]:
    """The cluster document (``hpd_sim.cluster`` schema) of a fleet ``{(kind, tp, role):
    workers}``; pool ids ``<kind>-<role>`` (``-tp<N>`` added when a kind has several sizes
    in a role)."""
    sizes: dict[tuple[str, str], int] = {}
    for kind_name, _, role in pools:
        sizes[(kind_name, role)] = sizes.get((kind_name, role), 0) + 1
    out: list[dict[str, Any]] = []
    for (kind_name, tp, role), count in sorted(pools.items()):
        if count <= 0:
            continue
        kind = catalogue.kind(kind_name)
        pid = f"{_slug(kind_name)}-{role}"
        if sizes[(kind_name, role)] > 1:
            pid += f"-tp{tp}"
        pool: dict[str, Any] = {
            "id": pid,
            "gpu": _gpu_doc(kind),
            "count": count,
            "tp": tp,
            "stage": role,
            "zone": "a",
            "price_per_gpu_hour": kind.price_per_hour,
        }
        if kind.max_batch_size != 256:
            pool["max_batch_size"] = kind.max_batch_size
        if kind.memory_fraction != 0.9:
            pool["memory_fraction"] = kind.memory_fraction
        if not kind.learned.is_declared:
            pool["actual"] = {
                "prefill_scale": kind.learned.prefill_scale,
                "prefill_fixed_ms": kind.learned.prefill_fixed_ms,
                "decode_scale": kind.learned.decode_scale,
                "decode_seq_ms": kind.learned.decode_seq_ms,
            }
        out.append(pool)
    doc: dict[str, Any] = {"name": name, "model": _model_doc(model), "pools": out}
    if description:
        doc["description"] = description
    return doc


@dataclass(frozen=True, slots=True)
class TierResult:
    """One tier's figures in a run: the share of its requests meeting both targets, the
    shares meeting TTFT (of those whose first token came, or that were rejected) and TPOT
    (of those that finished), and its request count."""

    attainment: float
    ttft_ok: float
    tpot_ok: float
    requests: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """A candidate's run: per-tier figures, whether every tier reached the target, and
    whether the run stopped once it could not (its attainments then lower bounds)."""

    per_tier: Mapping[str, TierResult]
    passed: bool
    stopped_early: bool
    wall_s: float

    @property
    def worst(self) -> float:
        """The lowest per-tier attainment."""
        return min(t.attainment for t in self.per_tier.values())


class Progress:
    """A progress line on a stream during verification: redrawn in place on a terminal, one
    line per run elsewhere; silent when disabled."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.label = ""
        self.t0 = time.perf_counter()

    def start(self, label: str) -> None:
        """A run begins."""
        self.label = label
        self.t0 = time.perf_counter()
        if self.enabled and not self.tty:
            self.stream.write(f"{label} ...\n")
            self.stream.flush()

    def step(self, done: int, total: int) -> None:
        """``done`` of ``total`` requests completed."""
        if not self.tty:
            return
        width = 24
        fill = int(width * done / total) if total else width
        el = time.perf_counter() - self.t0
        bar = "#" * fill + "-" * (width - fill)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} {el:5.1f}s")
        self.stream.flush()

    def end(self, result: str) -> None:
        """The run's outcome."""
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        prefix = "\r\033[K" if self.tty else ""
        self.stream.write(f"{prefix}{self.label}: {result} ({el:.1f}s)\n")
        self.stream.flush()


def _tier_results(outcomes: Sequence[Any], tiers: Sequence[TierSpec]) -> dict[str, TierResult]:
    slos = {t.name: t.slo for t in tiers}
    out: dict[str, TierResult] = {}
    for t in tiers:
        mine = [o for o in outcomes if o.tier == t.name]
        slo = slos[t.name]
        met = sum(1 for o in mine if slo.met(o))
        started = [o for o in mine if o.rejected or not math.isnan(o.first_s)]
        ttft = sum(1 for o in started if not o.rejected and o.ttft_ms <= slo.ttft_ms)
        done = [o for o in mine if not o.rejected and not math.isnan(o.finish_s)]
        tpot = sum(1 for o in done if o.tpot_ms <= slo.tpot_ms)
        n = len(mine)
        out[t.name] = TierResult(
            met / n if n else 1.0,
            ttft / len(started) if started else 1.0,
            tpot / len(done) if done else 1.0,
            n,
        )
    return out


def verify(
    cluster: ClusterSpec,
    profile: Profile,
    trace: Trace,
    tiers: Sequence[TierSpec],
    target: float,
    seed: int = 0,
    progress: Progress | None = None,
    stop_early: bool = True,
) -> Verdict:
    """Simulate ``cluster`` on ``trace`` under ``profile`` (``hpd sim``'s engine and
    defaults: ``SimConfig(seed, tiers)``) and judge each tier by its SLO. ``stop_early``:
    stop once the overall share meeting its targets cannot reach ``target`` (some tier
    then cannot either)."""
    config = SimConfig(seed=seed, tiers=tuple((t.name, t.weight) for t in tiers))
    judge = TierSlos(tiers[0].slo, {t.name: t.slo for t in tiers})
    cb = progress.step if progress is not None else None
    t0 = time.perf_counter()
    result = simulate(
        cluster,
        profile,
        trace.requests,
        config,
        1.0,
        cb,
        judge,
        target if stop_early else 0.0,
    )
    per_tier = _tier_results(result.outcomes, tiers)
    passed = not result.stopped_early and all(r.attainment >= target for r in per_tier.values())
    return Verdict(per_tier, passed, result.stopped_early, time.perf_counter() - t0)


def to_cluster(doc: Mapping[str, Any]) -> ClusterSpec:
    """The document through the simulator's own loader (what ``hpd sim --cluster`` reads)."""
    return parse_cluster(doc)
