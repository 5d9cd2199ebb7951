"""The closed loop: reported outcomes become per-worker and per-link estimates. Pure.

Each figure is an exponentially weighted moving average, ``v <- v + alpha (x - v)``
(the first sample sets ``v = x``), so an estimate follows a worker that slows down or
speeds up within roughly ``1 / alpha`` outcomes and forgets old behaviour geometrically.

What an outcome teaches (ms unless stated):

* decode ITL of the decode worker: the reported TPOT;
* prefill throughput (tokens/s) of the worker that ran the prefill (the prefill worker for
  a transfer, the decode worker when it recomputed or the pool served both stages):
  ``prompt_tokens / prefill_ms x 1000``, with ``prefill_ms`` measured when the gateway
  reports it, otherwise derived from the TTFT as
  ``max(ttft - planned wait - planned transfer, ttft / 4)`` (the floor keeps a bad wait
  estimate from producing absurd throughput);
* link rate (Gb/s) between the two pools, for transfers that report ``transfer_ms``:
  ``kv_bytes x 8 / (transfer_ms x 10^6)``; latency is folded into the rate.

Failed outcomes release capacity but teach nothing: an error says nothing about speed.
The speed a worker's prefill really runs at is fitted from the same outcomes by
``policy/learning.py`` (``learner``), from samples every replica shares; the averages here
fill what that fit does not cover (ITL, the link rates, and a worker's speed while no
worker of its model has a fit).
How the figures are used: ``views.py`` puts them into the worker views the planner sees
(the cost model corrects prefill and step times from them) and the link model's
per-pool-pair overrides; ``GetRecommendations`` reports them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpd_scheduler.policy.learner import SpeedLearner

__all__ = ["Ewma", "Observation", "ObservedEstimates"]


@dataclass(slots=True)
class Ewma:
    """One decaying average: value, how many samples fed it, and when the last came."""

    value: float = 0.0
    samples: int = 0
    updated_at_s: float = 0.0

    def add(self, x: float, alpha: float, now_s: float) -> None:
        self.value = x if self.samples == 0 else self.value + alpha * (x - self.value)
        self.samples += 1
        self.updated_at_s = now_s


@dataclass(frozen=True, slots=True)
class Observation:
    """What one successful outcome measured, resolved against its plan."""

    prefill_worker_id: str
    decode_worker_id: str
    prefill_pool_id: str
    decode_pool_id: str
    prompt_tokens: int
    prefill_ms: float
    tpot_ms: float
    kv_bytes: int
    transfer_ms: float


def observation_from(plan: Mapping[str, Any], outcome: Mapping[str, Any]) -> Observation | None:
    """The observation an outcome makes about its plan (a record head's ``plan``), or None
    when it failed or measured nothing usable."""
    if not outcome.get("success"):
        return None
    mode_used = outcome.get("mode_used") or plan.get("mode")
    planned = plan.get("mode")
    est = plan.get("estimates") or {}
    decode = str(plan.get("decode_worker_id", ""))
    prefill = str(plan.get("prefill_worker_id", ""))
    prefill_pool = str(plan.get("prefill_pool_id", ""))
    if mode_used != "transfer":
        prefill, prefill_pool = decode, str(plan.get("decode_pool_id", ""))
    ttft = float(outcome.get("ttft_ms") or 0.0)
    prefill_ms = float(outcome.get("prefill_ms") or 0.0)
    transfer_ms = float(outcome.get("transfer_ms") or 0.0)
    if prefill_ms <= 0 and ttft > 0:
        wait = float(est.get("prefill_wait_ms") or 0.0)
        xfer = float(est.get("transfer_ms") or 0.0) if mode_used == "transfer" else 0.0
        if mode_used != planned:
            wait = 0.0  # the planned wait was for another worker
        prefill_ms = max(ttft - wait - xfer, ttft / 4.0)
    return Observation(
        prefill_worker_id=prefill,
        decode_worker_id=decode,
        prefill_pool_id=prefill_pool,
        decode_pool_id=str(plan.get("decode_pool_id", "")),
        prompt_tokens=int(plan.get("prefill_tokens") or 0),
        prefill_ms=prefill_ms,
        tpot_ms=float(outcome.get("tpot_ms") or 0.0),
        kv_bytes=int(est.get("kv_bytes") or 0) if mode_used == "transfer" else 0,
        transfer_ms=transfer_ms if mode_used == "transfer" else 0.0,
    )


class ObservedEstimates:
    """Decaying averages per worker (prefill tokens/s, ITL ms) and per pool pair (Gb/s).

    ``version[worker]`` increments whenever that worker's figures change, so cached views
    know to rebuild; ``links_version`` likewise for the link table.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.prefill_tps: dict[str, Ewma] = {}
        self.itl_ms: dict[str, Ewma] = {}
        self.link_gbps: dict[tuple[str, str], Ewma] = {}
        self.version: dict[str, int] = {}
        self.links_version = 0
        # the prefill speeds fitted from the outcomes of every replica (policy/learning.py);
        # the views take them over these averages
        self.learner = SpeedLearner()

    def observe(self, obs: Observation, now_s: float) -> None:
        a = self.alpha
        if obs.prompt_tokens > 0 and obs.prefill_ms > 0 and obs.prefill_worker_id:
            tps = obs.prompt_tokens / obs.prefill_ms * 1000.0
            if math.isfinite(tps):
                self.prefill_tps.setdefault(obs.prefill_worker_id, Ewma()).add(tps, a, now_s)
                self._bump(obs.prefill_worker_id)
        if obs.tpot_ms > 0 and obs.decode_worker_id:
            self.itl_ms.setdefault(obs.decode_worker_id, Ewma()).add(obs.tpot_ms, a, now_s)
            self._bump(obs.decode_worker_id)
        if obs.kv_bytes > 0 and obs.transfer_ms > 0:
            gbps = obs.kv_bytes * 8.0 / (obs.transfer_ms * 1e6)
            key = (obs.prefill_pool_id, obs.decode_pool_id)
            self.link_gbps.setdefault(key, Ewma()).add(gbps, a, now_s)
            self.links_version += 1

    def _bump(self, worker_id: str) -> None:
        self.version[worker_id] = self.version.get(worker_id, 0) + 1

    def version_of(self, worker_id: str) -> int:
        """Changes whenever anything the worker's view takes from here changes."""
        return self.version.get(worker_id, 0) + self.learner.version.get(worker_id, 0)

    def samples(self, worker_id: str) -> int:
        p = self.prefill_tps.get(worker_id)
        d = self.itl_ms.get(worker_id)
        return (p.samples if p else 0) + (d.samples if d else 0)
