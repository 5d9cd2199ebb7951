"""The learner (hpd_scheduler.policy.learning): speeds measured from outcomes, robust to outliers,
speed changes and restarts, the same on every replica; and the planner taking them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from hpd_scheduler.policy.learner import SpeedLearner
from hpd_scheduler.policy.learning import (
    MIN_SAMPLES,
    SCALE_BOUNDS,
    SHIFT_RUN,
    WINDOW,
    Sample,
    fit,
    prefill_key,
    queue_key,
    samples_from,
    step_key,
)

TRUE_FIXED_MS = 80.0
TRUE_SCALE = 40.0


def _truth(
    x: float, ahead: float, fixed: float = TRUE_FIXED_MS, scale: float = TRUE_SCALE
) -> float:
    return scale * x + fixed * (1.0 + ahead)


def _draws(
    n: int, rng: random.Random, fixed: float = TRUE_FIXED_MS, scale: float = TRUE_SCALE
) -> list[Sample]:
    """Prompts of varied length (nominal 0.1-3 ms), a queue of 0-3 ahead, 5 % noise."""
    out = []
    for _ in range(n):
        x, ahead = rng.uniform(0.1, 3.0), float(rng.randint(0, 3))
        out.append(Sample(x, ahead, _truth(x, ahead, fixed, scale) * rng.gauss(1.0, 0.05), 7))
    return out


def _rel_err(f_pred: float, truth: float) -> float:
    return abs(f_pred / truth - 1.0)


def test_a_worker_slower_than_declared_is_learned_within_a_bounded_number_of_observations() -> None:
    rng = random.Random(1)
    pts = _draws(8, rng)
    assert fit(pts[: MIN_SAMPLES - 1]) is None  # too few to say
    f = fit(pts)
    assert f is not None
    # 40x slower than declared plus an 80 ms fixed cost: after 8 outcomes the fit predicts
    # the phase within 10 % over the range, and found both terms
    for x, ahead in ((0.1, 0.0), (1.5, 1.0), (3.0, 3.0)):
        assert _rel_err(f.predict(x, ahead), _truth(x, ahead)) < 0.1
    assert f.fixed_ms == pytest.approx(TRUE_FIXED_MS, rel=0.15)
    assert f.scale == pytest.approx(TRUE_SCALE, rel=0.25)


def test_stalls_and_outliers_do_not_move_the_fit_past_a_bound() -> None:
    rng = random.Random(2)
    pts = _draws(32, rng)
    for i in range(0, 32, 5):  # 7 of 32 are stalls: 20x the true time
        pts[i] = Sample(pts[i].x, pts[i].ahead, pts[i].y * 20.0, 7)
    pts[3] = Sample(pts[3].x, pts[3].ahead, 0.01, 7)  # and one absurdly fast
    f = fit(pts)
    assert f is not None
    for x, ahead in ((0.2, 0.0), (2.0, 2.0)):
        assert _rel_err(f.predict(x, ahead), _truth(x, ahead)) < 0.15


def test_a_worker_that_slows_down_is_planned_at_its_new_speed_after_a_few_requests() -> None:
    rng = random.Random(3)
    old = _draws(32, rng)
    slower = _draws(SHIFT_RUN, rng, fixed=4 * TRUE_FIXED_MS, scale=4 * TRUE_SCALE)
    f = fit(old + slower)
    assert f is not None
    assert f.samples == SHIFT_RUN
    assert _rel_err(f.predict(1.0, 1.0), _truth(1.0, 1.0, 4 * TRUE_FIXED_MS, 4 * TRUE_SCALE)) < 0.15
    # one slow request alone does not do it
    one = fit(old + slower[:1])
    assert one is not None
    assert _rel_err(one.predict(1.0, 1.0), _truth(1.0, 1.0)) < 0.1


def test_when_the_terms_cannot_be_told_apart_the_cost_goes_on_the_declared_shape() -> None:
    pts = [Sample(1.0, 0.0, 100.0 + i, 7) for i in range(8)]  # one length, no queue
    f = fit(pts)
    assert f is not None
    assert f.fixed_ms == 0.0
    assert f.scale == pytest.approx(103.5, rel=0.05)


def test_figures_past_their_bounds_are_held_with_a_reason() -> None:
    pts = [Sample(1e-9 * (i + 1), 0.0, 50.0, 7) for i in range(6)] + [
        Sample(1e-9, 3.0, 200.0, 7) for _ in range(3)
    ]
    f = fit(pts)
    assert f is not None
    assert f.scale >= SCALE_BOUNDS[0]
    assert f.note == "" or "scale" in f.note


def test_a_restarted_engine_starts_from_its_declaration_again() -> None:
    rng = random.Random(4)
    learner = SpeedLearner()
    for s in _draws(10, rng):
        learner.add(prefill_key("p0"), s, incarnation=7)
    got = learner.prefill("p0")
    assert got is not None
    assert got.samples == 10
    v = learner.version["p0"]
    learner.forget_incarnation("p0", 9)  # registered anew
    assert learner.prefill("p0") is None
    assert learner.version["p0"] == v + 1
    fast = [Sample(s.x, s.ahead, s.y / 4, 9) for s in _draws(MIN_SAMPLES, rng)]
    for s in fast:
        learner.add(prefill_key("p0"), s, incarnation=9)
    again = learner.prefill("p0")
    assert again is not None
    assert again.samples == MIN_SAMPLES  # only the new engine's samples


def test_replicas_with_the_same_samples_learn_the_same_figures() -> None:
    rng = random.Random(5)
    stored = {prefill_key("p0"): _draws(20, rng), prefill_key("p1"): _draws(12, rng)}
    a, b = SpeedLearner(), SpeedLearner()
    a.replace(stored, {"p0": 7, "p1": 7})
    b.replace({k: list(v) for k, v in reversed(stored.items())}, {"p0": 7, "p1": 7})
    assert a.fits == b.fits
    assert a.prefill("p0") == b.prefill("p0")


def test_a_worker_not_yet_measured_is_planned_like_its_measured_peers() -> None:
    learner = SpeedLearner()
    assert learner.prior(["p0", "p1", "new"]) is None  # nothing measured: the declaration
    rng = random.Random(8)
    for wid, slow in (("p0", 1.0), ("p1", 3.0)):
        for s in _draws(8, rng, fixed=TRUE_FIXED_MS * slow, scale=TRUE_SCALE * slow):
            learner.add(prefill_key(wid), s, 7)
    got = learner.prior(["p0", "p1", "new"])
    assert got is not None and got.samples == 0
    # the median of the two: between them, never the bare declaration (scale 1, fixed 0)
    assert TRUE_SCALE * 0.8 < got.scale < TRUE_SCALE * 3 * 1.2
    assert TRUE_FIXED_MS * 0.8 < got.fixed_ms < TRUE_FIXED_MS * 3 * 1.2
    gen = learner.generation
    learner.forget_incarnation("p1", 9)
    assert learner.generation > gen  # the prior moved: views of unmeasured workers rebuild


def test_an_outcome_teaches_the_engines_own_prefill_phase() -> None:
    base_est: dict[str, float] = {"prefill_nominal_ms": 2.0, "prefill_ahead": 0.5}
    plan: dict[str, Any] = {"mode": "transfer", "prefill_worker_id": "p0", "estimates": base_est}
    outcome = {"success": True, "ttft_ms": 150.0, "prefill_ms": 120.0}
    got = dict(samples_from(plan, outcome, 1_000, {"p0": 500}, 2_000))
    assert got == {prefill_key("p0"): Sample(2.0, 0.5, 120.0, 500, 2_000)}
    # a plan made before the engine's restart, a failure, or another mode teach nothing
    assert samples_from(plan, outcome, 400, {"p0": 500}, 2_000) == []
    assert samples_from(plan, {**outcome, "success": False}, 1_000, {"p0": 500}, 2_000) == []
    local = {**outcome, "mode_used": "recompute"}
    assert samples_from(plan, local, 1_000, {"p0": 500}, 2_000) == []
    # nor an outcome without the engine's own time (a TTFT holds the gateway's too)
    assert samples_from(plan, {**outcome, "prefill_ms": 0.0}, 1_000, {"p0": 500}, 0) == []
    # a plan that saw a queue goes to the queue's own samples (it teaches the queue share,
    # never the engine's speed)
    queued = {**plan, "estimates": {**base_est, "prefill_ahead": 2.0}}
    got = dict(samples_from(queued, outcome, 1_000, {"p0": 500}, 0))
    assert got == {queue_key("p0"): Sample(2.0, 2.0, 120.0, 500, 0)}
    # served whole on one worker: its time to the first token, less the decode admission
    # wait the plan predicted (the planner's term, not the prefill's)
    est = {**base_est, "prefill_wait_ms": 10.0, "prefill_ms": 30.0, "ttft_ms": 90.0}
    whole = {**plan, "mode": "same_pool", "estimates": est}
    got = dict(samples_from(whole, outcome, 1_000, {"p0": 500}, 0))
    assert got[prefill_key("p0")].y == pytest.approx(120.0 - 50.0)


def test_stored_samples_read_back_and_garbage_is_dropped() -> None:
    s = Sample(1.5, 2.0, 99.0, 7, 123)
    assert Sample.from_json(s.to_json()) == s
    for bad in ([], ["x", 1, 2, 3, 4], [1, 1, -5, 1, 1], [float("nan"), 0, 1, 1, 1]):
        assert Sample.from_json(bad) is None


def test_a_right_skewed_spread_is_fitted_through_its_middle_not_its_short_end() -> None:
    """Real latencies spread to the right (a request that lands behind another engine step
    waits): the fit's predictions sit at the middle of what is measured, so as many
    requests come late as early."""
    rng = random.Random(6)
    pts = [
        Sample(s.x, s.ahead, _truth(s.x, s.ahead) * rng.lognormvariate(0.0, 0.5), 7)
        for s in _draws(WINDOW, rng)
    ]
    f = fit(pts)
    assert f is not None
    fresh = _draws(400, rng)
    ratios = sorted(
        _truth(s.x, s.ahead) * rng.lognormvariate(0.0, 0.5) / f.predict(s.x, s.ahead) for s in fresh
    )
    assert 0.85 < ratios[len(ratios) // 2] < 1.2


def _queued(n: int, rng: random.Random, share: float, inc: int = 7) -> list[Sample]:
    """Samples with 1-6 requests ahead on an engine whose queued requests each add ``share``
    of the fixed cost (5 % noise)."""
    out = []
    for _ in range(n):
        x, ahead = rng.uniform(0.5, 8.0), float(rng.randint(1, 6))
        y = TRUE_SCALE * x + TRUE_FIXED_MS * (1.0 + share * ahead)
        out.append(Sample(x, ahead, y * rng.gauss(1.0, 0.05), inc))
    return out


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_the_queue_is_priced_at_the_share_of_fixed_cost_a_queued_request_really_adds(
    share: float,
) -> None:
    """An engine that batches prefills pays a step's fixed cost for several queued
    requests: the queued samples teach how much, and the planner's figure carries it."""
    rng = random.Random(11)
    learner = SpeedLearner()
    for s in _draws(12, rng):
        y = _truth(s.x, 0.0) * rng.gauss(1, 0.05)
        learner.add(prefill_key("p0"), Sample(s.x, 0.0, y, 7), 7)
    before = learner.prefill("p0")
    assert before is not None and before.queue_share == 1.0  # no queued sample: full price
    for i, s in enumerate(_queued(3 * WINDOW, rng, share)):
        learner.add(queue_key("p0"), s, 7)
        if i == MIN_SAMPLES - 2:  # still too few queued samples: full price
            assert learner.prefill("p0") == before
    got = learner.prefill("p0")
    assert got is not None
    assert got.queue_share == pytest.approx(share, abs=0.12)
    # a busy worker's queued samples never push out the ones its speed rests on
    assert got.samples == 12
    assert got.fixed_ms == pytest.approx(before.fixed_ms) and got.scale == before.scale
    fitted = learner.fits[prefill_key("p0")]
    assert fitted.queued == WINDOW
    for x, ahead in ((1.0, 2.0), (6.0, 5.0)):
        truth = TRUE_SCALE * x + TRUE_FIXED_MS * (1.0 + share * ahead)
        assert _rel_err(fitted.predict(x, ahead), truth) < 0.1


def test_the_queue_share_stays_within_its_bounds_and_stalls_do_not_move_it() -> None:
    rng = random.Random(12)
    learner = SpeedLearner()
    for s in _draws(12, rng):
        learner.add(prefill_key("p0"), Sample(s.x, 0.0, _truth(s.x, 0.0), 7), 7)
    # a queue the planner overestimated: the requests came back sooner than the unqueued
    # fit of their own work: the share is 0, never negative (no time is given back)
    for s in _queued(8, rng, 0.0):
        learner.add(queue_key("p0"), Sample(s.x, s.ahead, 0.5 * s.y, 7), 7)
    got = learner.prefill("p0")
    assert got is not None and got.queue_share == 0.0
    # a queue underestimated: never more than each queued request's whole fixed cost
    for s in _queued(WINDOW, rng, 1.0):
        learner.add(queue_key("p0"), Sample(s.x, s.ahead, 3.0 * s.y, 7), 7)
    got = learner.prefill("p0")
    assert got is not None and got.queue_share == 1.0
    # a quarter of stalls (10x) among a batching engine's samples: the median holds
    mixed = _queued(WINDOW, rng, 0.25)
    for i, s in enumerate(mixed):
        y = s.y * 10.0 if i % 4 == 0 else s.y
        learner.add(queue_key("p0"), Sample(s.x, s.ahead, y, 7), 7)
    got = learner.prefill("p0")
    assert got is not None and got.queue_share < 0.6


def test_replicas_and_restarts_treat_queued_samples_as_the_rest() -> None:
    rng = random.Random(13)
    stored = {
        prefill_key("p0"): [Sample(s.x, 0.0, _truth(s.x, 0.0), 7) for s in _draws(10, rng)],
        queue_key("p0"): _queued(10, rng, 0.4),
    }
    a, b = SpeedLearner(), SpeedLearner()
    a.replace(stored, {"p0": 7})
    b.replace(dict(reversed(stored.items())), {"p0": 7})
    assert a.fits == b.fits
    got = a.prefill("p0")
    assert got is not None and got.queue_share == pytest.approx(0.4, abs=0.12)
    # a new engine: the old one's queued samples no longer price its queue
    for s in _draws(MIN_SAMPLES, rng):
        a.add(prefill_key("p0"), Sample(s.x, 0.0, _truth(s.x, 0.0), 9), 9)
    a.forget_incarnation("p0", 9)
    again = a.prefill("p0")
    assert again is not None and again.queue_share == 1.0
    # the prior carries the share of the measured peers
    prior = a.prior(["p0", "new"])
    assert prior is not None and prior.queue_share == again.queue_share


def test_an_outcome_teaches_the_decode_workers_step_from_its_tpot() -> None:
    est = {"prefill_nominal_ms": 2.0, "decode_nominal_ms": 0.5, "decode_others": 3.0,
           "decode_step_ms": 6.0, "tpot_ms": 8.0}  # fmt: skip
    plan: dict[str, Any] = {"mode": "transfer", "prefill_worker_id": "p0",
                            "decode_worker_id": "d0", "estimates": est}  # fmt: skip
    outcome = {"success": True, "ttft_ms": 150.0, "prefill_ms": 120.0, "tpot_ms": 10.0}
    got = dict(samples_from(plan, outcome, 1_000, {"p0": 500, "d0": 600}, 2_000))
    # the step itself: the TPOT less what the plan added to its step (8 - 6 ms)
    assert got[step_key("d0")] == Sample(0.5, 3.0, 8.0, 600, 2_000)
    # the plan's own terms past the whole TPOT leave nothing to fit
    over = {**plan, "estimates": {**est, "tpot_ms": 20.0}}
    assert step_key("d0") not in dict(samples_from(over, outcome, 1_000, {"p0": 500, "d0": 600}, 0))
    # no TPOT (one output token), or a plan older than the decode engine: no step sample
    assert step_key("d0") not in dict(
        samples_from(plan, {**outcome, "tpot_ms": 0.0}, 1_000, {"p0": 500, "d0": 600}, 0)
    )
    assert step_key("d0") not in dict(
        samples_from(plan, outcome, 1_000, {"p0": 500, "d0": 5_000}, 0)
    )


def test_the_step_is_taken_back_by_the_prefill_duty_its_plan_saw() -> None:
    """The planner stretches a step by ``1 / (1 - duty)`` (``WorkerState.tpot_ms``): the
    fit takes each measured TPOT back to the bare step by the duty its plan saw, so a busy
    moment does not teach a slower engine and the stretch is not counted twice."""
    # the plan: a 6 ms step at a duty of 0.5 is a 12 ms TPOT, plus a 1 ms stall: 13 ms
    est = {"decode_nominal_ms": 0.5, "decode_others": 3.0, "decode_step_ms": 6.0,
           "decode_duty": 0.5, "tpot_ms": 13.0}  # fmt: skip
    plan: dict[str, Any] = {"mode": "transfer", "prefill_worker_id": "p0",
                            "decode_worker_id": "d0", "estimates": est}  # fmt: skip
    outcome = {"success": True, "ttft_ms": 150.0, "prefill_ms": 120.0, "tpot_ms": 17.0}
    got = dict(samples_from(plan, outcome, 1_000, {"p0": 500, "d0": 600}, 2_000))
    # 17 ms measured, less the 1 ms stall, at half the engine's time: an 8 ms bare step
    assert got[step_key("d0")] == Sample(0.5, 3.0, 8.0, 600, 2_000)
    # a plan that saw no duty (or a record from before it was kept): the TPOT as measured
    calm = {**plan, "estimates": {**est, "decode_duty": 0.0, "tpot_ms": 7.0}}
    got = dict(samples_from(calm, outcome, 1_000, {"p0": 500, "d0": 600}, 2_000))
    assert got[step_key("d0")] == Sample(0.5, 3.0, 16.0, 600, 2_000)


def test_a_decode_step_that_grows_with_the_batch_is_learned() -> None:
    """A CPU engine's step: 3x the declared read plus 0.8 ms per sequence in the batch."""
    rng = random.Random(14)
    learner = SpeedLearner()
    assert learner.step("d0") is None and learner.step_prior(["d0"]) is None
    for _ in range(16):
        x, others = rng.uniform(0.2, 1.0), float(rng.randint(0, 30))
        y = (3.0 * x + 0.8 * (1.0 + others)) * rng.gauss(1.0, 0.05)
        learner.add(step_key("d0"), Sample(x, others, y, 7), 7)
    got = learner.step("d0")
    assert got is not None and got.samples == 16
    assert got.scale == pytest.approx(3.0, rel=0.25)
    assert got.seq_ms == pytest.approx(0.8, rel=0.15)
    assert learner.prefill("d0") is None  # the decode step is no prefill speed
    prior = learner.step_prior(["d0", "new"])
    assert prior is not None and prior.samples == 0 and prior.seq_ms == got.seq_ms
    learner.forget_incarnation("d0", 9)  # a new engine
    assert learner.step("d0") is None


def test_a_batch_learns_what_its_samples_one_by_one_would_with_one_fit_per_key() -> None:
    """``add_batch`` (the scheduler learns outcomes in batches): each key refitted at most
    once however many samples it brings, the queue share after the fit it rests on, and the
    figures those of a learner fed the same samples one at a time."""
    rng = random.Random(5)
    plain = _draws(2 * WINDOW, rng)
    queued = _queued(WINDOW, rng, 0.4)
    steps = _draws(WINDOW, rng, fixed=3.0, scale=9.0)
    batch = [(prefill_key("p0"), s) for s in plain] + [(queue_key("p0"), s) for s in queued]
    batch += [(step_key("d0"), s) for s in steps]
    rng.shuffle(batch)

    class Counting(SpeedLearner):
        refits: list[str]

        def _refit(self, key: str, incarnation: int) -> None:
            self.refits.append(key)
            super()._refit(key, incarnation)

    together = Counting()
    together.refits = []
    together.add_batch(batch)
    assert sorted(together.refits) == sorted({prefill_key("p0"), step_key("d0")})
    one_by_one = SpeedLearner()
    for key, s in batch:
        one_by_one.add(key, s, s.inc)
    for key in (prefill_key("p0"), step_key("d0")):  # the last sample refitted each here too
        one_by_one._refit(key, 7)
    assert together.prefill("p0") == one_by_one.prefill("p0")
    assert together.step("d0") == one_by_one.step("d0")
    got = together.prefill("p0")
    assert got is not None and got.queue_share == pytest.approx(0.4, abs=0.12)
    assert together.version["p0"] >= 1 and together.generation >= 2
