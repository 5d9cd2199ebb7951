"""Seed 001 factor shapes as pure functions, plus the capacity-aware forms we use instead.

Seed weights (they are defaults in ``profiles/seed.yaml`` and ``profiles/default.yaml``,
never hard-coded in a scorer): prefill compute 0.30, load 0.25, queue 0.20, network 0.15,
model 0.10; decode ITL 0.35, memory 0.25, batch 0.20, bandwidth 0.15, network 0.05.

Every function here returns a value in [0, 1]; where the seed's raw value can leave that
range (its ITL reward reaches 1.2, its compute score grows with sqrt(GPU count)) the
function says how it is brought back.
"""

from __future__ import annotations

import math

from .errors import InvalidInputError

__all__ = [
    "SEED_DECODE_WEIGHTS",
    "SEED_GPU_COMPUTE",
    "SEED_PREFILL_WEIGHTS",
    "batch_score",
    "budget_score",
    "itl_score",
    "memory_gate_ok",
    "memory_score",
    "seed_compute_score",
    "seed_load_score",
    "seed_network_score",
    "seed_queue_score",
]

SEED_PREFILL_WEIGHTS: dict[str, float] = {
    "compute": 0.30,
    "load": 0.25,
    "queue": 0.20,
    "network": 0.15,
    "model": 0.10,
}
SEED_DECODE_WEIGHTS: dict[str, float] = {
    "itl": 0.35,
    "memory": 0.25,
    "batch": 0.20,
    "bandwidth": 0.15,
    "network": 0.05,
}

SEED_GPU_COMPUTE: dict[str, float] = {
    "H100": 1.0,
    "H100-SXM": 1.0,
    "H800": 0.95,
    "A100-80G": 0.75,
    "A100-80GB": 0.75,
    "A100-40G": 0.65,
    "A100-40GB": 0.65,
    "A10": 0.30,
    "A10G": 0.30,
}
"""The seed's GPU-name table (unknown names score 0.5): a fixed ranking, blind to the model."""

MEMORY_HEADROOM = 1.2
"""Seed: a decode worker needs 20 % more free KV memory than the request's KV size."""


def seed_compute_score(gpu_name: str, tp_size: int, gpu_count: int, max_gpus: int = 8) -> float:
    """Seed compute factor: ``table[gpu] x (0.85 if tp > 1 else 1) x sqrt(gpus)``, divided by
    ``sqrt(max_gpus)`` and clamped to [0, 1] (the seed's raw value exceeds 1 beyond one GPU)."""
    base = SEED_GPU_COMPUTE.get(gpu_name, 0.5)
    tp_eff = 0.85 if tp_size > 1 else 1.0
    raw = base * tp_eff * math.sqrt(max(gpu_count, 1))
    return min(1.0, max(0.0, raw / math.sqrt(max(max_gpus, 1))))


def seed_load_score(gpu_util: float, mem_util: float) -> float:
    """Seed load factor: ``1 - (0.6 gpu_util + 0.4 mem_util)``, clamped to [0, 1]."""
    return min(1.0, max(0.0, 1.0 - (0.6 * gpu_util + 0.4 * mem_util)))


def seed_queue_score(queue_depth: int, max_queue_depth: int) -> float:
    """Seed queue factor: ``1 - min(depth / max_depth, 1)``; an undeclared bound (0) is
    treated as 64, a typical engine's waiting-queue size."""
    bound = max_queue_depth if max_queue_depth > 0 else 64
    return 1.0 - min(max(queue_depth, 0) / bound, 1.0)


def seed_network_score(transfer_ms: float, budget_ms: float = 100.0) -> float:
    """Seed network factor: ``max(0, 1 - transfer_ms / budget_ms)`` with its fixed 100 ms."""
    return max(0.0, 1.0 - transfer_ms / budget_ms)


def budget_score(cost_ms: float, budget_ms: float) -> float:
    """``budget / (budget + cost)``: 1 at zero cost, 0.5 when the cost uses the whole budget,
    falling smoothly beyond it (no plateau at 0, so overloaded workers still rank).
    Our form for costs measured in time against a tier's budget."""
    if not budget_ms > 0:
        raise InvalidInputError("budget_ms", f"must be > 0, got {budget_ms}")
    return budget_ms / (budget_ms + max(cost_ms, 0.0))


def itl_score(itl_ms: float, target_ms: float) -> float:
    """Seed ITL factor, divided by its maximum 1.2 to stay in [0, 1]:

    above target: ``max(0, 1 - (itl - target) / target)``; at or below target:
    ``1 + (target - itl) / target x 0.2``. So 1.0 at zero ITL, 1/1.2 at the target, 0 at
    twice the target.
    """
    if not target_ms > 0:
        raise InvalidInputError("target_ms", f"must be > 0, got {target_ms}")
    if itl_ms > target_ms:
        raw = max(0.0, 1.0 - (itl_ms - target_ms) / target_ms)
    else:
        raw = 1.0 + (target_ms - max(itl_ms, 0.0)) / target_ms * 0.2
    return raw / 1.2


def memory_gate_ok(
    available_bytes: float, kv_bytes: float, headroom: float = MEMORY_HEADROOM
) -> bool:
    """Seed decode gate: excluded when ``available < kv_bytes x headroom`` (equal passes)."""
    return available_bytes >= kv_bytes * headroom


def memory_score(available_bytes: float, kv_bytes: float) -> float:
    """Seed memory factor on ``ratio = available / kv_bytes``:

    ratio < 1.2: 0; 1.2 <= ratio < 2: ``(ratio - 1.2) / 0.8 x 0.5`` (0 to 0.5);
    ratio >= 2: ``0.5 + min(0.5, (ratio - 2) / 4 x 0.5)`` (0.5 to 1, saturating at 6).
    A zero-byte request has infinite ratio: 1.
    """
    if kv_bytes <= 0:
        return 1.0
    ratio = available_bytes / kv_bytes
    if ratio < 1.2:
        return 0.0
    if ratio < 2.0:
        return (ratio - 1.2) / 0.8 * 0.5
    return 0.5 + min(0.5, (ratio - 2.0) / 4.0 * 0.5)


def batch_score(current_batch: float, max_batch: int) -> float:
    """Seed batch factor: ideal batch at 70 % of max; ``max(0, 1 - |current - ideal| / ideal)``.
    A worker at the ideal scores 1, empty or at twice the ideal scores 0."""
    if max_batch <= 0:
        return 0.0
    ideal = max_batch * 0.7
    return max(0.0, 1.0 - abs(current_batch - ideal) / ideal)
