"""From engine scrapes to the registry's load report. Pure.

Gauges go through as they are: ``batch_size`` = requests running, ``queue_depth`` =
requests waiting, ``kv_blocks_free`` = ``round(total x (1 - KV usage))``, ``memory_util`` =
KV usage. Rates come from the difference between the two latest scrapes:

* prefix-cache hit rate = delta(hits) / delta(queries) (an engine that exports a rate gauge
  instead, like SGLang, is taken as is);
* prefill throughput = delta(prompt tokens the engine computed itself) / delta(seconds in
  the prefill phase), a per-request speed rather than the engine's load-dependent output;
* prefill busy share = delta(prompt tokens the engine computed itself) x (seconds in the
  prefill phase per prompt token, over the engine's life) / delta(wall seconds), capped at
  1: how much of the time the engine's running batch was held up by prefills (the
  scheduler's TPOT estimate divides the decode step by ``1 - share``). The token counter
  moves when the engine computes, but vLLM adds a request's prefill phase to its histogram
  only when the request finishes, so the phase seconds only price a token; prompt tokens
  received from another engine are in the price's denominator, since a decode engine's
  phase for them is mostly the wait for the transfer, which holds no batch up. An engine
  with no new prompt tokens reports 0 (it is not prefilling), and so does one that has not
  yet finished a request or exports no prefill-phase time (SGLang);
* ITL p50 / p99 from the delta of the inter-token latency histogram, interpolated linearly
  inside the bucket that holds the quantile (as PromQL's ``histogram_quantile`` does).

A quantity with no new observations between two scrapes keeps its last measured value
(an idle engine has not become faster or slower); until it has ever been measured it is 0,
which the scheduler reads as "not measured" and replaces with its own outcome-fed figure.
A counter that went backwards (the engine restarted) starts the deltas afresh.
``gpu_util`` stays 0: no engine here exports it, and the registry never invents load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpd_common.worker_model import LoadReport

from .engines import EngineSample

__all__ = ["LoadTracker", "histogram_quantile"]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative ``(upper bound, count)`` buckets; None when empty.

    Linear inside the bucket holding rank ``q x total``; the +Inf bucket answers its lower
    bound (the largest finite bound), as nothing is known above it.
    """
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            span = count - lower_count
            frac = (rank - lower_count) / span if span > 0 else 1.0
            return lower_bound + (bound - lower_bound) * frac
        lower_bound, lower_count = bound, count
    return lower_bound


def _delta(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or new < old:
        return None
    return new - old


@dataclass(slots=True)
class LoadTracker:
    """Keeps the previous scrape and the last measured rates (module docstring)."""

    kv_blocks_total: int
    queue_max: int
    _prev: EngineSample | None = None
    _prev_ms: int = 0
    _hit_rate: float = 0.0
    _prefill_tps: float = 0.0
    _itl_p50_ms: float = 0.0
    _itl_p99_ms: float = 0.0

    def reset(self) -> None:
        """Forget the previous scrape (after the engine restarted)."""
        self._prev = None

    @staticmethod
    def _busy(sample: EngineSample, new_tokens: float, seconds: float) -> float:
        """The prefill busy share (module docstring): ``new_tokens`` computed in ``seconds``
        at the engine's lifetime phase seconds per prompt token."""
        phase, local = sample.prefill_time_s, sample.prompt_tokens_computed
        if not phase or not local:
            return 0.0
        tokens = local + (sample.prompt_tokens_external or 0.0)
        return min(1.0, new_tokens * phase / tokens / seconds)

    def update(self, sample: EngineSample, now_ms: int) -> LoadReport:
        """Fold in one scrape taken at ``now_ms`` and return the report to send."""
        prev, self._prev = self._prev, sample
        prev_ms, self._prev_ms = self._prev_ms, now_ms
        prefill_busy = 0.0
        if sample.prefix_hit_rate is not None:
            self._hit_rate = sample.prefix_hit_rate
        elif prev is not None:
            dq = _delta(sample.prefix_queries, prev.prefix_queries)
            dh = _delta(sample.prefix_hits, prev.prefix_hits)
            if dq and dh is not None:
                self._hit_rate = min(1.0, max(0.0, dh / dq))
        if prev is not None:
            dt = _delta(sample.prefill_time_s, prev.prefill_time_s)
            dn = _delta(sample.prompt_tokens_computed, prev.prompt_tokens_computed)
            if dt and dn:
                self._prefill_tps = dn / dt
            if dn and now_ms > prev_ms:
                prefill_busy = self._busy(sample, dn, (now_ms - prev_ms) / 1000.0)
            if sample.itl_buckets and len(sample.itl_buckets) == len(prev.itl_buckets):
                diff = [
                    (b, c - pc)
                    for (b, c), (_, pc) in zip(sample.itl_buckets, prev.itl_buckets, strict=True)
                ]
                if all(c >= 0 for _, c in diff):
                    p50 = histogram_quantile(0.5, diff)
                    p99 = histogram_quantile(0.99, diff)
                    if p50 is not None and p99 is not None:
                        self._itl_p50_ms, self._itl_p99_ms = p50 * 1000, max(p50, p99) * 1000
        total = self.kv_blocks_total
        free = round(total * (1.0 - sample.kv_usage)) if total else 0
        return LoadReport(
            memory_util=sample.kv_usage,
            kv_blocks_free=max(0, min(total, free)),
            kv_blocks_total=total,
            queue_depth=max(0, sample.waiting),
            queue_max=self.queue_max,
            batch_size=max(0, sample.running),
            itl_p50_ms=self._itl_p50_ms,
            itl_p99_ms=self._itl_p99_ms,
            prefill_tokens_per_s=self._prefill_tps,
            reported_at_ms=now_ms,
            prefix_cache_hit_rate=self._hit_rate,
            prefill_busy=prefill_busy,
        )
