"""Speeds as measured: the prefill phase of every worker, fitted from reported outcomes.
Pure (the Redis side is ``hpd_scheduler.learn_store``).

Why: a worker's declared GPU figures are a prior, not a measurement. On real engines the
plan's TTFT was tens of times off (a small model's prefill is nearly all fixed cost per
request: HTTP, tokenizing, scheduling, sampling, which FLOPs and bytes do not see), and a
throttled, shared or misdeclared GPU runs at a fraction of its declaration. The load
report's prefill tokens/s only nudges the declared speed within a clamp and cannot tell a
fixed cost from a slow GPU; outcomes can, because they come with the plan's own terms.

The model, a line through the origin in two terms (ms): the **prefill phase** of a worker
(the request sent to the engine until its first token, the engine's queue included: the
gateway's measured ``prefill_ms``, which it times from its call to the engine to the
engine's first answer in every mode, less the decode admission wait the plan predicted for a
request served whole on one worker; an outcome without it teaches nothing: a TTFT holds the
gateway's own time too, and a non-streamed answer's its whole decode) is ``y = scale x
nominal + fixed x (1 + ahead)``, with ``nominal`` the declared cost model's time for the
work queued ahead plus the request's own (the plan's ``prefill_nominal_ms``) and ``ahead``
the requests queued ahead (the plan's ``prefill_ahead``). It becomes the planner's
``LearnedSpeed``. The gateway's own time before the engine call (tokenizing, planning, a
retry while the state store is away) is no engine's speed and stays out.

**A worker not yet measured** is planned like the measured workers of its model, at the
median of their fits (``SpeedLearner.prior``): the host's fixed costs and the error of the
declarations are shared by a fleet far more often than not, and a worker left at its bare
declaration beside measured ones looked tens of times faster than they did on real
engines, so it drew requests it could not serve until its own fit arrived. Only a fleet
with no fit at all is planned as declared.

**The decode step** is fitted the same way from the TPOT the gateway measures, under the
decode worker's ``step_key``: ``y`` the bare step the measured TPOT shows, the TPOT less a
local prefill's stall the plan added (the planner's own term, as the prefill sample leaves
out the admission wait) and taken back by the prefill duty the plan saw (``x (1 - duty)``:
the planner stretches a step by ``1 / (1 - duty)``, ``WorkerState.tpot_ms``), against
``x`` the declared step for the batch's context (the plan's ``decode_nominal_ms``) and
``ahead`` the other sequences sharing the step (its
``decode_others``): ``y = scale x nominal + seq x (1 + others)``. A first cut fitted the
TPOT less only the prefill stretch, so the learned step held the real stalls and the
planner's stall term came on top: on the real unequal fleet at 4.9x its capacity 1,974 of
its 2,000 refusals were ``tpot_over_admission_limit``. Fitted against the plan's own TPOT
terms, the planner's whole TPOT estimate is what the fit makes unbiased. The declared step
is a roofline read of the weights and the KV, nearly flat in the batch; an engine whose step
grows with every sequence (a CPU engine computes; a GPU one past its memory-bound batch)
was planned at a fraction of its TPOT: the report's inter-token latency corrects the
declared step within a 4x clamp, and on real CPU engines the step was 50-450x the
declaration (bench/README.md, 2026-12-07): the planner admitted requests that then missed
their TPOT by 25 % at the p90. It becomes the planner's ``LearnedStep``.

The hand-off (KV transfer and the decode side's first step) is not fitted here: what the
gateway measures after a prefill holds its own planning time and the KV session's, which
made a learned hand-off look slower than recomputing on every decode worker (an emulated
fleet recomputed 59 % of its requests on an uncut link); the link model learns transfer
rates from reported transfer times as before (``hpd_scheduler.feedback``).

Fitted by iteratively reweighted least squares on *relative* residuals (the planner is
judged by ``actual / predicted``; relative to the prediction, ``_fit_rows`` says why) with
Huber weights (k = 1.345, the usual 95 % efficiency choice), so a stalled request or a
garbage collection pause weighs little; both terms are kept non-negative (a negative one is
dropped and the other refitted alone). When the two terms cannot be told apart (every
request alike and no queue), the whole cost goes on ``scale``, the declared model's shape,
which keeps waits growing with the queue.

What must not poison it:

* outliers: the Huber weights (tests: ``tests/unit/policy/test_learning.py``);
* a change of speed (throttling, a noisy neighbour): only the last ``WINDOW`` samples
  count, and when the last ``SHIFT_RUN`` all miss the fit on the same side by more than
  ``SHIFT_FACTOR`` the samples before them are dropped: a worker that slowed down is
  planned at its new speed after six requests, not after half a window;
* a restart: every prefill sample carries its worker's incarnation (the registration
  time); only the current incarnation's count, and a plan made before it teaches nothing;
* the planner's queue model: ``scale`` and ``fixed`` are fitted only on plans that saw
  less than ``AHEAD_MAX`` (one) request queued ahead on their worker, so what they measure
  is the engine's own speed, not the error of the planner's estimate of a queue (which
  counts inbound transfers and unreported prefills at the traffic's mean prompt). Fitted
  on every plan, the simulator's decode workers under 3x overload learned a scale of 0
  (their modelled queues were longer than the prefill work they really ran), the planner
  then priced their recomputes as free, and the admitted requests' attainment fell from
  0.99 to 0.70;
* the queue's price: the plans that saw a queue (``queue_key`` samples, a window of their
  own so a busy worker's queued samples never push out the ones its speed rests on) teach
  one figure more, the **queue share**: how much of a request's fixed cost each request
  queued ahead adds to the wait, ``y = scale x nominal + fixed x (1 + share x ahead)``.
  An engine that prefills one request at a time pays every queued request's fixed cost
  (share 1); one that batches the prefills of several requests into each step (vLLM's
  scheduler does, up to its token budget) pays a step's fixed cost for several of them,
  and with share 1 the plans of a busy real engine came out 1.2-2.2x long (bench/README.md,
  2026-12-07): admission refused requests the fleet could serve, and the fast engine's
  queue looked longer than it was. The share is the median, over the last ``WINDOW``
  queued samples, of each one's excess over the unqueued fit per request ahead, kept
  within [0, 1]: a median because a stalled request must not move it, and within [0, 1]
  because a queued request cannot add more than its own fixed cost nor give time back
  (an excess outside says the queue was estimated wrong, which the share must not
  absorb past its bounds). Until ``MIN_SAMPLES`` queued samples exist it is 1, the
  conservative price;
* an idle worker: nothing decays with time, an idle engine has not changed speed;
* absurd figures: ``scale`` within ``SCALE_BOUNDS`` and ``fixed`` within ``FIXED_MAX_MS``
  (a fit outside says the samples are broken, not the worker; the fit's ``note`` says so).

``WINDOW`` 32, ``MIN_SAMPLES`` 4, ``SHIFT_RUN`` 6, ``SHIFT_FACTOR`` 1.5 are statistical
choices, not fitted to a fleet: 4 is the fewest points on which a two-term fit with one
outlier still has a majority; 6 same-side misses past 1.5x happen by chance with
probability below 2^-6 even for an unbiased but noisy fit; 32 keeps the fit's cost (once
per change, off the request path) small.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .worker_state import DUTY_MAX

__all__ = [
    "AHEAD_MAX",
    "FIXED_MAX_MS",
    "MIN_SAMPLES",
    "SCALE_BOUNDS",
    "SHIFT_FACTOR",
    "SHIFT_RUN",
    "WINDOW",
    "Fit",
    "Sample",
    "fit",
    "median",
    "prefill_key",
    "queue_key",
    "queue_share",
    "samples_from",
    "step_key",
]

WINDOW = 32
MIN_SAMPLES = 4
SHIFT_RUN = 6
SHIFT_FACTOR = 1.5
SCALE_BOUNDS = (1e-3, 1e5)
FIXED_MAX_MS = 120_000.0
AHEAD_MAX = 1.0
_HUBER_K = 1.345
_ITERATIONS = 20
REFIT_EVERY = 4


@dataclass(frozen=True, slots=True)
class Sample:
    """One outcome's measurement: ``y`` ms against the terms ``x`` (nominal ms) and
    ``ahead``; ``inc`` the worker's incarnation, ``at_ms`` when it was reported."""

    x: float
    ahead: float
    y: float
    inc: int = 0
    at_ms: int = 0

    def stored(self) -> Sample:
        """The sample as it reads back from the store (rounded), so the replica that took
        it fits the same figures as the ones that read it."""
        return Sample.from_json(self.to_json()) or self

    def to_json(self) -> list[float | int]:
        return [round(self.x, 6), round(self.ahead, 4), round(self.y, 3), self.inc, self.at_ms]

    @staticmethod
    def from_json(raw: Sequence[Any]) -> Sample | None:
        """A sample from its stored form; None when it is not one."""
        try:
            x, ahead, y, inc, at = (float(raw[0]), float(raw[1]), float(raw[2]), raw[3], raw[4])
            s = Sample(x, ahead, y, int(inc), int(at))
        except (TypeError, ValueError, IndexError):
            return None
        ok = all(math.isfinite(v) for v in (s.x, s.ahead, s.y))
        return s if ok and s.x >= 0 and s.ahead >= 0 and s.y > 0 else None


@dataclass(frozen=True, slots=True)
class Fit:
    """``y = scale x x + fixed x (1 + share x ahead)``; ``samples`` the unqueued samples
    ``scale`` and ``fixed`` rest on, ``queued`` the queued ones ``queue_share`` rests on (0:
    none yet, the share is 1); ``note`` says why a figure sits at a bound or a term was
    dropped ('' when neither)."""

    scale: float
    fixed_ms: float
    samples: int
    note: str = ""
    queue_share: float = 1.0
    queued: int = 0

    def predict(self, x: float, ahead: float = 0.0) -> float:
        return self.scale * x + self.fixed_ms * (1.0 + self.queue_share * ahead)


def _solve(rows: Sequence[tuple[float, float, float]], w: Sequence[float]) -> tuple[float, float]:
    """Weighted least squares of ``y ~ c1 a + c2 b`` with both coefficients >= 0."""
    saa = sab = sbb = say = sby = 0.0
    for (a, b, y), wi in zip(rows, w, strict=True):
        saa += wi * a * a
        sab += wi * a * b
        sbb += wi * b * b
        say += wi * a * y
        sby += wi * b * y
    det = saa * sbb - sab * sab
    if saa > 0 and sbb > 0 and det > 1e-9 * saa * sbb:
        c1 = (say * sbb - sby * sab) / det
        c2 = (sby * saa - say * sab) / det
        if c1 >= 0 and c2 >= 0:
            return c1, c2
        if c2 < 0:
            return max(say / saa, 0.0), 0.0
        return 0.0, max(sby / sbb, 0.0)
    # the two terms cannot be told apart: the cost goes on the declared model's shape
    if saa > 0:
        return max(say / saa, 0.0), 0.0
    return 0.0, max(sby / sbb, 0.0) if sbb > 0 else 0.0


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _fit_rows(samples: Sequence[Sample]) -> tuple[float, float]:
    """Huber IRLS on relative residuals (module docstring).

    A residual is relative to the *prediction* (``(y - p) / p``, weight ``1 / p^2``, as a
    gamma regression weighs them), not to the measurement: weighted by ``1 / y^2`` a
    right-skewed spread of latencies pulls the fit below its middle (the short ones weigh
    most), and on real engines the plans came out 12-22 % short at the median."""
    # columns scaled to a mean of 1, for the conditioning of the 2 x 2 system
    ma = sum(s.x for s in samples) / len(samples) or 1.0
    rows = [(s.x / ma, 1.0 + s.ahead, s.y) for s in samples]
    w = [1.0 / (s.y * s.y) for s in samples]  # a first fit, before there is a prediction
    c1 = c2 = 0.0
    for _ in range(_ITERATIONS):
        was = (c1, c2)
        c1, c2 = _solve(rows, w)
        if abs(c1 - was[0]) <= 1e-4 * max(c1, 1e-9) and abs(c2 - was[1]) <= 1e-4 * max(c2, 1e-9):
            break  # converged (typically within a few rounds)
        pred = [max(c1 * a + c2 * b, 1e-9) for a, b, _ in rows]
        rel = [(y - p) / p for (_, _, y), p in zip(rows, pred, strict=True)]
        mad = median([abs(r - median(rel)) for r in rel]) * 1.4826
        cut = _HUBER_K * max(mad, 1e-3)
        w = [
            (1.0 if abs(r) <= cut else cut / abs(r)) / (p * p)
            for r, p in zip(rel, pred, strict=True)
        ]
    return c1 / ma, c2


def _bounded(scale: float, fixed: float, n: int) -> Fit:
    lo, hi = SCALE_BOUNDS
    notes = []
    if scale < lo:
        notes.append(f"scale {scale:.3g} raised to {lo:g}: the cost is all fixed per request")
        scale = lo
    elif scale > hi:
        notes.append(f"scale {scale:.3g} cut to {hi:g}: the samples contradict the declaration")
        scale = hi
    if fixed > FIXED_MAX_MS:
        notes.append(f"fixed {fixed:.0f} ms cut to {FIXED_MAX_MS:.0f}: not a request's cost")
        fixed = FIXED_MAX_MS
    return Fit(scale, fixed, n, "; ".join(notes))


def fit(samples: Sequence[Sample]) -> Fit | None:
    """The fit of the latest regime among the last ``WINDOW`` samples (oldest first), or
    None with fewer than ``MIN_SAMPLES``."""
    pts = list(samples[-WINDOW:])
    if len(pts) < MIN_SAMPLES:
        return None
    c1, c2 = _fit_rows(pts)
    tail = pts[-SHIFT_RUN:]
    if len(pts) > SHIFT_RUN and len(tail) == SHIFT_RUN:
        ratios = [s.y / max(c1 * s.x + c2 * (1.0 + s.ahead), 1e-9) for s in tail]
        if all(r > SHIFT_FACTOR for r in ratios) or all(r < 1 / SHIFT_FACTOR for r in ratios):
            pts = tail  # the worker changed speed: only what came since counts
            c1, c2 = _fit_rows(pts)
    return _bounded(c1, c2, len(pts))


def queue_share(base: Fit, queued: Sequence[Sample]) -> Fit:
    """``base`` with the queue share of the last ``WINDOW`` of ``queued`` (oldest first;
    module docstring); ``base`` as it is with fewer than ``MIN_SAMPLES`` of them or no
    fixed cost to share."""
    pts = [s for s in queued[-WINDOW:] if s.ahead > 0]
    if len(pts) < MIN_SAMPLES or base.fixed_ms <= 0:
        return replace(base, queue_share=1.0, queued=0)
    excess = [(s.y - base.scale * s.x - base.fixed_ms) / (base.fixed_ms * s.ahead) for s in pts]
    share = min(max(median(excess), 0.0), 1.0)
    return replace(base, queue_share=share, queued=len(pts))


def prefill_key(worker_id: str) -> str:
    return f"p:{worker_id}"


def step_key(worker_id: str) -> str:
    """The key of a worker's decode step samples (``LearnedStep``)."""
    return f"d:{worker_id}"


def queue_key(worker_id: str) -> str:
    """The key of a worker's samples taken with a queue ahead (``queue_share``)."""
    return f"q:{worker_id}"


def samples_from(
    plan: Mapping[str, Any],
    outcome: Mapping[str, Any],
    created_at_ms: int,
    incarnations: Mapping[str, int],
    now_ms: int,
) -> list[tuple[str, Sample]]:
    """What one successful outcome teaches (module docstring): a sample of the prefill
    phase of the worker that prefilled, under ``prefill_key`` or, when its plan saw a queue
    ahead (``AHEAD_MAX``), under ``queue_key``. Nothing from a failed outcome, from one
    served otherwise than planned (its terms were another worker's), from a plan without
    the nominal terms (made by an older scheduler) or made before its worker's current
    incarnation. And, from its TPOT, a sample of the decode worker's step under
    ``step_key`` (``_step_sample``); ``incarnations`` holds both workers'."""
    if not outcome.get("success"):
        return []
    mode = plan.get("mode")
    if (outcome.get("mode_used") or mode) != mode:
        return []
    est = plan.get("estimates") or {}
    nominal = float(est.get("prefill_nominal_ms") or 0.0)
    ahead = float(est.get("prefill_ahead") or 0.0)
    y = float(outcome.get("prefill_ms") or 0.0)
    if mode != "transfer" and y > 0:
        # served on one worker: the engine's time to the first token, less the decode
        # admission wait the plan predicted (a full batch: the planner's own term, not the
        # prefill's)
        parts = sum(float(est.get(k) or 0.0) for k in ("prefill_wait_ms", "prefill_ms"))
        y -= max(0.0, float(est.get("ttft_ms") or 0.0) - parts)
    worker = str(plan.get("prefill_worker_id", ""))
    inc = incarnations.get(worker, 0)
    fresh = inc and created_at_ms >= inc
    out = []
    if worker and nominal > 0 and y > 0 and fresh:
        key = prefill_key(worker) if ahead < AHEAD_MAX else queue_key(worker)
        out.append((key, Sample(nominal, max(ahead, 0.0), y, inc, now_ms).stored()))
    step = _step_sample(plan, est, outcome, created_at_ms, incarnations, now_ms)
    return out if step is None else [*out, step]


def _step_sample(
    plan: Mapping[str, Any],
    est: Mapping[str, Any],
    outcome: Mapping[str, Any],
    created_at_ms: int,
    incarnations: Mapping[str, int],
    now_ms: int,
) -> tuple[str, Sample] | None:
    """The decode step the outcome's TPOT measured (module docstring), or None: no TPOT
    (one output token, or not reported), a plan without the step's terms, or a plan made
    before the decode worker's current incarnation."""
    tpot = float(outcome.get("tpot_ms") or 0.0)
    nominal = float(est.get("decode_nominal_ms") or 0.0)
    worker = str(plan.get("decode_worker_id", ""))
    inc = incarnations.get(worker, 0)
    if not (worker and tpot > 0 and nominal > 0 and inc and created_at_ms >= inc):
        return None
    # the bare step: the TPOT less a local prefill's stall the plan added (its TPOT less its
    # stretched step), taken back by the prefill duty that stretched it (``tpot_ms``)
    duty = min(max(float(est.get("decode_duty") or 0.0), 0.0), DUTY_MAX)
    stretched = float(est.get("decode_step_ms") or 0.0) / (1.0 - duty)
    extra = float(est.get("tpot_ms") or 0.0) - stretched
    others = max(float(est.get("decode_others") or 0.0), 0.0)
    y = (tpot - max(0.0, extra)) * (1.0 - duty)
    if y <= 0:
        return None  # the plan's own terms overshot the whole TPOT: nothing left to fit
    return step_key(worker), Sample(nominal, others, y, inc, now_ms).stored()
