"""From engine samples to load reports: delta-based rates, ITL percentiles, carried values."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from hpd_agent.engines import EngineSample, SglangAdapter, VllmAdapter
from hpd_agent.load import LoadTracker, histogram_quantile
from hpd_common.worker_model import LoadReport
from hpd_registry.validation import validate_load
from tests.unit.agent.recorded import read

NOW = 1_700_000_000_000
INF = math.inf
Buckets = tuple[tuple[float, float], ...]


def sample(**changes: Any) -> EngineSample:
    base = EngineSample(running=0, waiting=0, kv_usage=0.0)
    return replace(base, **changes)


def tracker(kv_blocks_total: int = 1000, queue_max: int = 0) -> LoadTracker:
    return LoadTracker(kv_blocks_total=kv_blocks_total, queue_max=queue_max)


def rates(report: LoadReport) -> tuple[float, float, float, float]:
    return (
        report.prefix_cache_hit_rate,
        report.prefill_tokens_per_s,
        report.itl_p50_ms,
        report.itl_p99_ms,
    )


def plus(base: Buckets, added: Sequence[float]) -> Buckets:
    """Cumulative buckets ``base`` after ``added`` more observations per bucket (cumulative)."""
    return tuple((le, count + more) for (le, count), more in zip(base, added, strict=True))


# Hand-built ITL histogram: 100 new observations, cumulative 10 / 60 / 100 / 100.
#   p50: rank 50 falls in (0.01, 0.02], which holds 60 - 10 = 50 of them:
#        0.01 + 0.01 x (50 - 10) / 50 = 0.018 s = 18 ms
#   p99: rank 99 falls in (0.02, 0.05], which holds 100 - 60 = 40:
#        0.02 + 0.03 x (99 - 60) / 40 = 0.04925 s = 49.25 ms
ZERO: Buckets = ((0.01, 0.0), (0.02, 0.0), (0.05, 0.0), (INF, 0.0))
NEW_ITL = (10.0, 60.0, 100.0, 100.0)
P50_MS = 18.0
P99_MS = 49.25
# A long fast past: 1000 observations all under 10 ms, before the two scrapes.
PAST: Buckets = ((0.01, 1000.0), (0.02, 1000.0), (0.05, 1000.0), (INF, 1000.0))


# -- histogram_quantile ----------------------------------------------------------------------

QUANTILES = [
    pytest.param(0.5, (), None, id="empty"),
    pytest.param(0.5, ((0.1, 0.0), (INF, 0.0)), None, id="no-observations"),
    pytest.param(0.5, ((0.1, 0.0), (0.2, 0.0), (INF, 5.0)), 0.2, id="all-in-inf-is-top-bound"),
    pytest.param(0.99, ((0.1, 0.0), (0.2, 0.0), (INF, 5.0)), 0.2, id="p99-all-in-inf"),
    pytest.param(0.5, ((INF, 5.0),), 0.0, id="only-an-inf-bucket"),
    pytest.param(0.5, ((1.0, 10.0), (INF, 10.0)), 0.5, id="first-bucket-from-zero"),
    pytest.param(0.5, ((0.01, 10.0), (0.02, 60.0), (0.05, 100.0), (INF, 100.0)), 0.018, id="p50"),
    pytest.param(
        0.99, ((0.01, 10.0), (0.02, 60.0), (0.05, 100.0), (INF, 100.0)), 0.04925, id="p99"
    ),
    pytest.param(0.5, ((1.0, 5.0), (2.0, 10.0), (INF, 10.0)), 1.0, id="rank-on-a-bound"),
    pytest.param(1.0, ((1.0, 5.0), (2.0, 10.0), (INF, 10.0)), 2.0, id="q1-is-top-filled-bound"),
    pytest.param(
        0.7, ((1.0, 5.0), (2.0, 5.0), (4.0, 10.0), (INF, 10.0)), 2.8, id="skips-empty-bucket"
    ),
    pytest.param(0.9, ((1.0, 5.0), (2.0, 8.0), (INF, 10.0)), 2.0, id="tail-in-inf-bucket"),
    pytest.param(0.25, ((4.0, 8.0), (INF, 8.0)), 1.0, id="linear-inside-bucket"),
]


@pytest.mark.parametrize(("q", "buckets", "expected"), QUANTILES)
def test_histogram_quantile(q: float, buckets: Buckets, expected: float | None) -> None:
    got = histogram_quantile(q, buckets)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


# -- LoadTracker: gauges ---------------------------------------------------------------------


def test_first_update_passes_gauges_and_has_no_rates() -> None:
    first = sample(
        running=4,
        waiting=2,
        kv_usage=0.25,
        prefix_queries=500.0,
        prefix_hits=100.0,
        prompt_tokens_computed=9000.0,
        prefill_time_s=3.0,
        itl_buckets=plus(ZERO, NEW_ITL),
    )
    report = tracker(kv_blocks_total=16384, queue_max=64).update(first, NOW)
    assert report == LoadReport(
        gpu_util=0.0,
        memory_util=0.25,
        kv_blocks_free=12288,
        kv_blocks_total=16384,
        queue_depth=2,
        queue_max=64,
        running_prefills=0,
        batch_size=4,
        itl_p50_ms=0.0,
        itl_p99_ms=0.0,
        prefill_tokens_per_s=0.0,
        reported_at_ms=NOW,
        prefix_cache_hit_rate=0.0,
    )


FREE_BLOCKS = [
    pytest.param(16384, 0.25, 12288, id="quarter-used"),
    pytest.param(16384, 0.0, 16384, id="empty"),
    pytest.param(16384, 1.0, 0, id="full"),
    pytest.param(100, 0.333, 67, id="rounded-66.7-up"),
    pytest.param(100, 0.337, 66, id="rounded-66.3-down"),
    pytest.param(0, 0.5, 0, id="unknown-total"),
]


@pytest.mark.parametrize(("total", "usage", "free"), FREE_BLOCKS)
def test_kv_blocks_free_is_total_times_unused(total: int, usage: float, free: int) -> None:
    report = tracker(kv_blocks_total=total).update(sample(kv_usage=usage), NOW)
    assert (report.kv_blocks_free, report.kv_blocks_total) == (free, total)


def test_negative_counts_are_reported_as_zero() -> None:
    report = tracker().update(sample(running=-1, waiting=-3), NOW)
    assert (report.batch_size, report.queue_depth) == (0, 0)


# -- LoadTracker: rates from deltas ----------------------------------------------------------


def test_prefix_hit_rate_is_the_ratio_of_counter_deltas() -> None:
    t = tracker()
    t.update(sample(prefix_queries=1000.0, prefix_hits=900.0), NOW)
    report = t.update(sample(prefix_queries=1200.0, prefix_hits=1000.0), NOW + 1000)
    # 100 / 200 over the last interval, not the lifetime 1000 / 1200
    assert report.prefix_cache_hit_rate == pytest.approx(0.5)


def test_prefix_hit_rate_is_clamped_to_one() -> None:
    t = tracker()
    t.update(sample(prefix_queries=10.0, prefix_hits=0.0), NOW)
    report = t.update(sample(prefix_queries=20.0, prefix_hits=50.0), NOW + 1000)
    assert report.prefix_cache_hit_rate == 1.0


def test_prefill_throughput_is_computed_tokens_over_prefill_seconds() -> None:
    t = tracker()
    t.update(sample(prompt_tokens_computed=1000.0, prefill_time_s=2.0), NOW)
    report = t.update(sample(prompt_tokens_computed=5000.0, prefill_time_s=4.0), NOW + 1000)
    # (5000 - 1000) tokens / (4 - 2) s
    assert report.prefill_tokens_per_s == pytest.approx(2000.0)


def test_prefill_busy_prices_new_tokens_at_the_phase_seconds_per_token() -> None:
    t = tracker()
    first = t.update(sample(prompt_tokens_computed=1000.0, prefill_time_s=2.0), NOW)
    assert first.prefill_busy == 0.0  # no earlier scrape to measure against
    # 1,000 more tokens in 4 s; over the engine's life 2,000 tokens took 4 s of prefill
    # phase (the second request's phase was recorded when it finished, in this window)
    report = t.update(sample(prompt_tokens_computed=2000.0, prefill_time_s=4.0), NOW + 4000)
    assert report.prefill_busy == pytest.approx(1000 * (4.0 / 2000) / 4)


def test_prefill_busy_counts_tokens_computed_before_their_phase_is_recorded() -> None:
    """vLLM adds a request's prefill phase to its histogram only when the request finishes:
    a window in which the engine prefilled but nothing finished still shows the share."""
    t = tracker()
    t.update(sample(prompt_tokens_computed=1000.0, prefill_time_s=0.5), NOW)
    report = t.update(sample(prompt_tokens_computed=1400.0, prefill_time_s=0.5), NOW + 1000)
    assert report.prefill_busy == pytest.approx(400 * (0.5 / 1400))


def test_prefill_busy_is_zero_when_idle_or_never_measured_and_capped_at_one() -> None:
    t = tracker()
    t.update(sample(prompt_tokens_computed=100.0), NOW)
    # tokens computed, but no request has finished yet: no price for a token
    assert t.update(sample(prompt_tokens_computed=500.0), NOW + 1000).prefill_busy == 0.0
    t.update(sample(prompt_tokens_computed=500.0, prefill_time_s=5.0), NOW + 2000)
    # 1,000 tokens at 10 ms each in one second: capped
    busy = t.update(sample(prompt_tokens_computed=1500.0, prefill_time_s=15.0), NOW + 3000)
    assert busy.prefill_busy == 1.0
    # nothing computed since: not the last value, 0
    idle = t.update(sample(prompt_tokens_computed=1500.0, prefill_time_s=15.0), NOW + 4000)
    assert idle.prefill_busy == 0.0


def test_prefill_busy_restarts_after_a_counter_reset() -> None:
    t = tracker()
    t.update(sample(prompt_tokens_computed=9000.0, prefill_time_s=9.0), NOW)
    reset = t.update(sample(prompt_tokens_computed=100.0, prefill_time_s=0.1), NOW + 1000)
    assert reset.prefill_busy == 0.0
    after = t.update(sample(prompt_tokens_computed=400.0, prefill_time_s=0.4), NOW + 2000)
    assert after.prefill_busy == pytest.approx(300 * (0.4 / 400))


def test_prefill_busy_spreads_the_phase_over_tokens_received_from_another_engine() -> None:
    """A decode engine's prefill phase for a request whose KV came from another engine is
    mostly the wait for it: the phase seconds are spread over every prompt token it
    computed or received, so the few it computes itself cost little."""
    t = tracker()
    t.update(sample(prompt_tokens_computed=10.0, prompt_tokens_external=990.0), NOW)
    report = t.update(
        sample(prompt_tokens_computed=20.0, prompt_tokens_external=1980.0, prefill_time_s=1.0),
        NOW + 1000,
    )
    assert report.prefill_busy == pytest.approx(10 * (1.0 / 2000))


def test_itl_percentiles_come_from_the_histogram_delta() -> None:
    t = tracker()
    t.update(sample(itl_buckets=ZERO), NOW)
    report = t.update(sample(itl_buckets=plus(ZERO, NEW_ITL)), NOW + 1000)
    assert report.itl_p50_ms == pytest.approx(P50_MS)
    assert report.itl_p99_ms == pytest.approx(P99_MS)


def test_itl_percentiles_ignore_observations_before_the_previous_scrape() -> None:
    t = tracker()
    t.update(sample(itl_buckets=PAST), NOW)
    report = t.update(sample(itl_buckets=plus(PAST, NEW_ITL)), NOW + 1000)
    assert report.itl_p50_ms == pytest.approx(P50_MS)
    assert report.itl_p99_ms == pytest.approx(P99_MS)
    lifetime_p50 = histogram_quantile(0.5, plus(PAST, NEW_ITL))
    assert lifetime_p50 is not None and lifetime_p50 * 1000 < 10.0


def test_rates_from_the_recorded_idle_then_decode_scrapes() -> None:
    adapter = VllmAdapter()
    t = tracker(kv_blocks_total=16384)
    t.update(adapter.sample(read("vllm", "metrics_prefill_idle.txt")), NOW)
    report = t.update(adapter.sample(read("vllm", "metrics_decode.txt")), NOW + 1000)
    assert report.prefix_cache_hit_rate == pytest.approx(256 / 722)
    assert report.prefill_tokens_per_s == pytest.approx(105 / 0.1054722449999872)
    # 105 prompt tokens computed in the second between the scrapes, priced at 0.105 s of
    # prefill phase over the 105 computed and 361 received from the prefill engine
    assert report.prefill_busy == pytest.approx(105 * 0.1054722449999872 / (105 + 361))
    # 14 inter-token gaps: 0 <= 10 ms, 11 <= 25 ms, 14 <= 50 ms.
    # p50: rank 7 in (10, 25] ms holding 11: 10 + 15 x 7 / 11
    # p99: rank 13.86 in (25, 50] ms holding 3: 25 + 25 x (13.86 - 11) / 3
    assert report.itl_p50_ms == pytest.approx(10 + 15 * 7 / 11)
    assert report.itl_p99_ms == pytest.approx(25 + 25 * (13.86 - 11) / 3)
    assert report.kv_blocks_free == 16384
    validate_load("load", report, NOW + 1000)


def test_rates_are_carried_forward_when_nothing_new_happened() -> None:
    t = tracker()
    busy = sample(
        prefix_queries=200.0,
        prefix_hits=100.0,
        prompt_tokens_computed=4000.0,
        prefill_time_s=2.0,
        itl_buckets=plus(ZERO, NEW_ITL),
    )
    t.update(
        sample(
            prefix_queries=0.0,
            prefix_hits=0.0,
            prompt_tokens_computed=0.0,
            prefill_time_s=0.0,
            itl_buckets=ZERO,
        ),
        NOW,
    )
    measured = rates(t.update(busy, NOW + 1000))
    assert measured == pytest.approx((0.5, 2000.0, P50_MS, P99_MS))
    idle = t.update(replace(busy, running=0, kv_usage=0.0), NOW + 2000)
    assert rates(idle) == measured
    assert rates(t.update(busy, NOW + 3000)) == measured
    assert t.update(busy, NOW + 3000).reported_at_ms == NOW + 3000


def test_rates_are_carried_forward_when_a_scrape_lacks_the_counters() -> None:
    t = tracker()
    t.update(sample(prefix_queries=0.0, prefix_hits=0.0, itl_buckets=ZERO), NOW)
    measured = rates(
        t.update(
            sample(prefix_queries=10.0, prefix_hits=5.0, itl_buckets=plus(ZERO, NEW_ITL)),
            NOW + 1000,
        )
    )
    assert rates(t.update(sample(), NOW + 2000)) == measured


def test_a_new_measurement_replaces_the_carried_one() -> None:
    t = tracker()
    t.update(sample(prefix_queries=0.0, prefix_hits=0.0), NOW)
    t.update(sample(prefix_queries=100.0, prefix_hits=100.0), NOW + 1000)
    report = t.update(sample(prefix_queries=200.0, prefix_hits=110.0), NOW + 2000)
    assert report.prefix_cache_hit_rate == pytest.approx(0.1)


def test_prefill_throughput_needs_both_tokens_and_time() -> None:
    t = tracker()
    t.update(sample(prompt_tokens_computed=0.0, prefill_time_s=0.0), NOW)
    # tokens counted, no prefill finished in the interval: nothing to divide by
    r1 = t.update(sample(prompt_tokens_computed=100.0, prefill_time_s=0.0), NOW + 1000)
    # time passed, no token computed (all prefix hits): no speed measured
    r2 = t.update(sample(prompt_tokens_computed=100.0, prefill_time_s=1.0), NOW + 2000)
    assert (r1.prefill_tokens_per_s, r2.prefill_tokens_per_s) == (0.0, 0.0)


# -- LoadTracker: restarts -------------------------------------------------------------------


def test_counters_going_backwards_keep_the_last_rates() -> None:
    t = tracker()
    t.update(
        sample(
            prefix_queries=1000.0,
            prefix_hits=500.0,
            prompt_tokens_computed=10_000.0,
            prefill_time_s=10.0,
            itl_buckets=PAST,
        ),
        NOW,
    )
    measured = rates(
        t.update(
            sample(
                prefix_queries=1200.0,
                prefix_hits=600.0,
                prompt_tokens_computed=14_000.0,
                prefill_time_s=12.0,
                itl_buckets=plus(PAST, NEW_ITL),
            ),
            NOW + 1000,
        )
    )
    assert measured == pytest.approx((0.5, 2000.0, P50_MS, P99_MS))
    restarted = sample(
        prefix_queries=10.0,
        prefix_hits=9.0,
        prompt_tokens_computed=50.0,
        prefill_time_s=0.01,
        itl_buckets=((0.01, 3.0), (0.02, 3.0), (0.05, 3.0), (INF, 3.0)),
    )
    report = t.update(restarted, NOW + 2000)
    assert rates(report) == measured
    assert all(value >= 0 for value in rates(report))


def test_deltas_start_afresh_from_the_first_scrape_after_a_restart() -> None:
    t = tracker()
    t.update(sample(prefix_queries=1000.0, prefix_hits=900.0, itl_buckets=PAST), NOW)
    t.update(sample(prefix_queries=10.0, prefix_hits=1.0, itl_buckets=ZERO), NOW + 1000)
    report = t.update(
        sample(prefix_queries=110.0, prefix_hits=51.0, itl_buckets=plus(ZERO, NEW_ITL)),
        NOW + 2000,
    )
    assert report.prefix_cache_hit_rate == pytest.approx(0.5)
    assert (report.itl_p50_ms, report.itl_p99_ms) == pytest.approx((P50_MS, P99_MS))


def test_one_bucket_going_backwards_discards_the_histogram_delta() -> None:
    t = tracker()
    t.update(sample(itl_buckets=plus(ZERO, (5.0, 5.0, 5.0, 5.0))), NOW)
    report = t.update(sample(itl_buckets=plus(ZERO, (4.0, 50.0, 60.0, 60.0))), NOW + 1000)
    assert (report.itl_p50_ms, report.itl_p99_ms) == (0.0, 0.0)


def test_histograms_of_different_bucket_sets_are_not_compared() -> None:
    t = tracker()
    t.update(sample(itl_buckets=ZERO[:2]), NOW)
    report = t.update(sample(itl_buckets=plus(ZERO, NEW_ITL)), NOW + 1000)
    assert (report.itl_p50_ms, report.itl_p99_ms) == (0.0, 0.0)


def test_reset_forgets_the_previous_scrape() -> None:
    t = tracker()
    t.update(sample(prefix_queries=0.0, prefix_hits=0.0), NOW)
    t.reset()
    report = t.update(sample(prefix_queries=100.0, prefix_hits=100.0), NOW + 1000)
    assert report.prefix_cache_hit_rate == 0.0


# -- LoadTracker: engines that export a hit-rate gauge ---------------------------------------


def test_sglang_hit_rate_gauge_is_used_as_is_from_the_first_scrape() -> None:
    t = tracker(kv_blocks_total=1024, queue_max=64)
    report = t.update(SglangAdapter().sample(read("sglang", "metrics.txt")), NOW)
    assert report.prefix_cache_hit_rate == 0.4
    assert (report.batch_size, report.queue_depth, report.memory_util) == (3, 2, 0.25)
    assert report.kv_blocks_free == 768
    validate_load("load", report, NOW)


def test_hit_rate_gauge_wins_over_counters() -> None:
    t = tracker()
    t.update(sample(prefix_queries=0.0, prefix_hits=0.0, prefix_hit_rate=0.9), NOW)
    report = t.update(
        sample(prefix_queries=100.0, prefix_hits=10.0, prefix_hit_rate=0.7), NOW + 1000
    )
    assert report.prefix_cache_hit_rate == 0.7


def test_sglang_scrapes_carry_no_prefill_speed() -> None:
    t = tracker()
    adapter = SglangAdapter()
    t.update(adapter.sample(read("sglang", "metrics_prefill.txt")), NOW)
    report = t.update(adapter.sample(read("sglang", "metrics.txt")), NOW + 1000)
    # SGLang exports no prefill-time histogram: 0 = "not measured" for the scheduler
    assert report.prefill_tokens_per_s == 0.0


# -- reports are valid load reports ----------------------------------------------------------


def test_every_report_of_a_sequence_passes_registry_validation() -> None:
    t = tracker(kv_blocks_total=100, queue_max=8)
    scrapes = [
        sample(kv_usage=0.0, itl_buckets=ZERO, prefix_queries=0.0, prefix_hits=0.0),
        sample(
            running=3,
            kv_usage=0.5,
            itl_buckets=plus(ZERO, NEW_ITL),
            prefix_queries=40.0,
            prefix_hits=10.0,
        ),
        sample(running=1, waiting=9, kv_usage=1.0, itl_buckets=ZERO),
        sample(kv_usage=0.1, itl_buckets=plus(ZERO, (0.0, 0.0, 0.0, 7.0))),
    ]
    for i, scrape in enumerate(scrapes):
        now = NOW + i * 1000
        report = t.update(scrape, now)
        validate_load("load", report, now)
        assert report.itl_p50_ms <= report.itl_p99_ms
