"""One worker inside a fleet snapshot (`fleet.py`): its view, its capacity and the
corrections its own reports and observed figures make to it, and the reservations counted
against it; the per-worker predictions the planner and the preselection keys read (prefill
wait and time, decode step, KV use, queue depth), and the prompt mix its queued requests
are priced at."""

from __future__ import annotations

import math
from collections.abc import Container

from .capacity import Capacity, StalenessPolicy, confidence
from .domain import WorkerView

__all__ = ["PromptMix", "WorkerState"]

_CLAMP_LO, _CLAMP_HI = 0.25, 4.0
"""How far a worker's own reported speed may correct its capacity model, either way."""


DUTY_MAX = 0.9
"""The largest prefill busy share :meth:`WorkerState.tpot_ms` divides by: a report of 1
(an engine that did nothing but prefill) counts as a step seen ten times as long, which keeps
the estimate finite."""


class WorkerState:
    """One worker inside a snapshot: its view, capacity, corrections and live reservations.

    Mutable only through :meth:`Fleet.reserve` / :meth:`Fleet.release` (the ``live_*``
    fields); everything else is fixed for the snapshot's life.
    """

    __slots__ = (
        "backlog_tokens",
        "batch",
        "cap",
        "conf",
        "ctx_tokens",
        "d_seq",
        "duty",
        "fixed_per_token",
        "gpu_util",
        "held",
        "held_block_tokens",
        "host",
        "idx",
        "itl_p50_ms",
        "kv_avail",
        "kv_total",
        "link_class",
        "live_kv",
        "live_reqs",
        "live_tokens",
        "m_d",
        "m_p",
        "p_fixed",
        "pool_id",
        "queue",
        "queue_max",
        "ref_tokens",
        "reported_at_s",
        "view",
        "worker_id",
    )

    def __init__(
        self,
        view: WorkerView,
        cap: Capacity,
        idx: int,
        now_s: float,
        staleness: StalenessPolicy,
        ref_tokens: int,
        known: int = 0,
        inbound: int = 0,
    ) -> None:
        self.view = view
        self.cap = cap
        self.idx = idx
        self.worker_id = view.worker_id
        self.pool_id = view.pool_id
        load = view.load
        # The report's and the spec's figures read on every decision, kept here as typed
        # fields of this (compiled) class. The declared types matter: the shared worker
        # model is outside the compiled build, so a figure read from it is untyped there and
        # everything computed from it would be boxed arithmetic (bench/policy_decision.py:
        # a fifth more per decision without them).
        self.reported_at_s: float | None = load.reported_at_s if load is not None else None
        self.queue_max: int = load.queue_max if load is not None else 0
        self.itl_p50_ms: float = load.itl_p50_ms if load is not None else 0.0
        self.gpu_util: float = min(max(load.gpu_util, 0.0), 1.0) if load is not None else 0.0
        self.host: str = view.network.host
        self.conf = confidence(self.reported_at_s, now_s, staleness)
        # the share of its recent time the engine spent prefilling, trusted as far as the
        # report is fresh; at most DUTY_MAX so that tpot_ms() stays finite
        busy: float = load.prefill_busy if load is not None else 0.0
        self.duty: float = min(max(busy, 0.0), DUTY_MAX) * self.conf
        queue: int = load.queue_depth if load is not None else 0
        running: int = load.running_prefills if load is not None else 0
        self.queue: int = queue + view.pending_requests
        self.batch: int = load.batch_size if load is not None else 0
        # The prefill work queued here, in prompt tokens: the prefills the report shows
        # waiting or running, less the ``known`` ones the scheduler counts by their true
        # tokens (its own plans: reservations, ``pending_prefill_tokens``), at the traffic's
        # mean prompt; and, at the mean prompt too, each of the ``inbound`` transfers on
        # their way here whose prefill elsewhere is not done. Those are no prefill of this
        # worker's: they stand for the decode work already promised to it, so that a decode
        # worker with sequences on their way takes fewer prefills of its own. The simulator
        # has always counted them so, and every figure of the scheduling-quality suite was
        # measured with them; without them (bench/README.md, 2026-12-06, "a term the
        # service lacked") recomputes crowd the decode workers past capacity and the admitted
        # requests' attainment at 3x the homogeneous cluster's bound falls from 0.95 to 0.73.
        unknown_q = max(0, queue - known)
        unknown_r = max(0, running - max(0, known - queue))
        self.backlog_tokens = (
            unknown_q + 0.5 * unknown_r + inbound
        ) * ref_tokens + view.pending_prefill_tokens
        self.kv_total = view.kv_memory_total_bytes
        self.kv_avail = max(0, view.kv_available_bytes - view.pending_kv_bytes)
        used = max(0, view.kv_memory_total_bytes - view.kv_available_bytes)
        self.ctx_tokens = used / cap.kv_bytes_per_token if cap.kv_bytes_per_token else 0.0
        self.ref_tokens = max(ref_tokens, 1)
        self.p_fixed = 0.0
        self.fixed_per_token = 0.0
        self.m_p = self._prefill_scale(view, cap)
        self.d_seq = 0.0
        self.m_d = self._decode_scale(view, cap)
        self.live_reqs = 0
        self.live_kv = 0
        self.live_tokens = 0
        # the worker's class for hand-off figures (Fleet.handoff_terms), set by Fleet.build
        self.link_class = 0
        # the prefix keys this worker's engine holds (policy.prefix), None when unknown
        self.held: Container[int] | None = None
        self.held_block_tokens = 0

    def _prefill_scale(self, view: WorkerView, cap: Capacity) -> float:
        """The factor on the declared prefill time (``m_p``), setting the fixed cost.

        The prefill speed as measured (``LearnedSpeed``): the fitted scale of the declared
        compute time, unclamped, and a fixed cost per request, which the queued prompt
        tokens carry at the traffic's mean prompt (``fixed_per_token``), as the wait prices
        them, each request queued ahead at its learned share of the fixed cost (an engine
        that batches prefills pays a step's fixed cost for several). Without it, the
        report's prefill tokens/s corrects the declared speed within a clamp, weighed by the
        report's freshness (a report alone cannot tell a fixed cost from a slow GPU)."""
        learned = view.learned
        if learned is not None:
            self.p_fixed = learned.fixed_ms
            self.fixed_per_token = learned.queue_share * learned.fixed_ms / self.ref_tokens
            return learned.scale
        load = view.load
        c = self.conf
        reported_tps: float = load.prefill_tokens_per_s if load is not None else 0.0
        if reported_tps > 0 and c > 0:
            ratio = min(max(cap.prefill_tps / reported_tps, _CLAMP_LO), _CLAMP_HI)
            return c * ratio + (1.0 - c)
        return 1.0

    def _decode_scale(self, view: WorkerView, cap: Capacity) -> float:
        """The factor on the declared decode step (``m_d``), setting the cost per sequence.

        The step as measured (``LearnedStep``): the declared step's scale, unclamped, and a
        cost per sequence in the batch (``d_seq``). Without it the report's inter-token
        latency corrects the declared step within a clamp, weighed by its freshness."""
        step = view.learned_step
        if step is not None:
            self.d_seq = step.seq_ms
            return step.scale
        c = self.conf
        if self.itl_p50_ms > 0 and c > 0:
            nominal = cap.decode_step_ms(self.ctx_tokens)
            ratio = min(max(self.itl_p50_ms / nominal, _CLAMP_LO), _CLAMP_HI)
            return c * ratio + (1.0 - c)
        return 1.0

    # -- live figures (snapshot + reservations) -------------------------------------------

    def available_kv(self) -> int:
        """KV bytes free for a new request: reported free minus every reservation."""
        return self.kv_avail - self.live_kv

    def kv_used_fraction(self) -> float:
        """Used share of KV memory, reservations included, in [0, 1]."""
        if self.kv_total <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.available_kv() / self.kv_total))

    def queue_depth(self) -> int:
        """Queued requests, reservations included."""
        return self.queue + self.live_reqs

    def prefill_wait_ms(self) -> float:
        """Seconds of this worker's own prefill work queued ahead, in ms:
        ``backlog tokens x (1000 x m_p / (prefill tokens/s) + fixed per token)``."""
        q = self.backlog_tokens + self.live_tokens
        return q / self.cap.prefill_tps * 1000.0 * self.m_p + q * self.fixed_per_token

    def prefill_ms(self, tokens: int) -> float:
        """This worker's time to prefill ``tokens`` (observed-corrected, with the learned
        fixed cost of a request)."""
        return self.cap.prefill_ms(tokens) * self.m_p + self.p_fixed

    def requests_ahead(self) -> float:
        """The requests queued ahead of a new prefill here, as the wait prices them: the
        queued prompt tokens at the traffic's mean prompt (``LearnedSpeed``'s ``ahead``)."""
        return (self.backlog_tokens + self.live_tokens) / self.ref_tokens

    def admission_wait_ms(self, kv_need: int, seq_steps: float) -> float:
        """Expected wait, in ms, before a new sequence gets a decode slot on this worker.

        Continuous batching admits a sequence only while the batch is below
        ``max_batch_size`` and its KV fits; otherwise it waits for running sequences to
        finish. With ``B`` sequences running, each living ``L = seq_steps`` decode steps on
        average (the traffic's mean output), about ``B / L`` finish per step (Little's law,
        steady state), so

        * slots: ``deficit = B + Q + 1 - max_batch`` (``Q``: sequences queued or routed
          here ahead of this one) waits ``deficit x L / B`` steps;
        * memory: ``deficit = kv_need - free KV`` (free after reservations) waits
          ``deficit / (used KV / L)`` steps, since finishing sequences free ``used / L``
          bytes per step;

        the larger of the two, times the worker's step as its prefills stretch it
        (``tpot_ms(step_ms())``): sequences finish only as fast as decode steps run, and an
        engine prefilling a share of its time runs that much fewer of them. With the bare
        step a worker serving both stages whose prefills crowded out its decode steps looked
        a slot away from admitting while its joiners waited seconds (bench/README.md,
        2026-12-06, "the admission wait at the stretched step"). 0 when the sequence fits
        now. Seed 001 has no such term: its batch factor packs sequences toward 70 % of the
        cap and its TTFT ignores the wait a full batch imposes."""
        b = max(self.batch, 0)
        running = max(b, 1)
        steps = 0.0
        cap = self.view.max_batch_size
        if cap > 0:
            slot_deficit = b + self.queue_depth() + 1 - cap
            if slot_deficit > 0:
                steps = slot_deficit * seq_steps / running
        free = self.available_kv()
        if kv_need > free:
            used = max(self.kv_total - self.kv_avail, 1)
            steps = max(steps, (kv_need - free) * seq_steps / used)
        return steps * self.tpot_ms(self.step_ms()) if steps > 0 else 0.0

    def tpot_ms(self, step_ms: float) -> float:
        """The time per output token a running sequence sees with decode steps of
        ``step_ms``: prefills run between (or inside) the steps, so with the engine
        prefilling a share ``duty`` of its time (its report's ``prefill_busy``) a step is
        seen ``1 / (1 - duty)`` times as long. Without it the estimate was the bare step,
        and a pool reachable only by recompute kept receiving prefills until every sequence
        in its batch missed TPOT (bench/README.md, 2026-12-06).

        A learned step (``LearnedStep``) is stretched the same way: it is fitted to the bare
        step, each measured TPOT taken back by the duty its plan saw
        (``learning._step_sample``), so a busier engine is planned slower and a quieter one
        faster than the average duty the samples came from. Fitted to the TPOT as measured
        and stretched again, the duty counted twice: 1,508 of the real unequal fleet's 1,514
        refusals were ``tpot_over_admission_limit`` (bench/README.md, 2026-12-07); fitted as
        measured and not stretched, the step held the average duty, and past capacity the
        admitted requests' TPOT p90 was 59 ms against a 41 ms target."""
        return step_ms / (1.0 - self.duty)

    def step_ms(self, extra_context_tokens: float = 0.0) -> float:
        """Predicted decode step (ITL) in ms with ``extra_context_tokens`` more KV resident
        and one more sequence: ``(weights read + context x kv ms/token) x m_d + d_seq x
        sequences`` (the running batch, the queued and reserved ones, and this one; ``d_seq``
        is 0 until the step is learned)."""
        cap = self.cap
        return (
            cap.weights_ms + (self.ctx_tokens + extra_context_tokens) * cap.kv_ms_per_token
        ) * self.m_d + self.d_seq * self.step_sequences()

    def step_sequences(self) -> int:
        """The sequences a new one shares a decode step with, itself included: the larger of
        what the engine reports (running and queued) and what the scheduler holds there
        (its reservations, held from the plan to the outcome, so they count the running
        ones too: summed, a busy engine's batch was counted about twice), and it."""
        reported = self.batch + self.queue
        return (reported if reported > self.live_reqs else self.live_reqs) + 1


_GRID_LOG = math.log(1.25)


class PromptMix:
    """The prompt length the snapshot counts a queued request as (``Fleet.build``'s
    ``ref_prompt_tokens``): an exponentially weighted mean of the prompts seen, so that a
    queue of 40k-token prompts is not priced as a queue of 1k-token ones. Engines report
    how many requests wait, not how long they are; a fixed reference fitted one trace's
    mean (1,024 tokens: the Azure conversation trace) and made every queue of a long-context
    trace look 13x shorter than it was (the Mooncake trace: prefill waits predicted at 50 ms
    were 1.8 s in the simulator).

    ``alpha`` (0.02): the weight of each new prompt, about 50 requests of memory, which
    follows a shift in the mix within seconds at a few requests per second yet does not jump
    with one outlier. The value reported is rounded to a geometric grid (steps of x1.25),
    so consecutive snapshots mostly keep the same reference and reuse their workers'
    capacity entries (``Fleet.build(previous=..)``).

    With ``initial_tokens=None`` the mix has no prior: the first sample sets the mean and
    :meth:`ref_tokens` is 0 (unknown) until then. The scheduler keeps one such over the
    requests' expected outputs (``Fleet.build``'s ``ref_output_tokens``: how many decode
    steps a running sequence lives, which sets how fast a full batch frees a slot)."""

    __slots__ = ("alpha", "mean")

    def __init__(self, initial_tokens: float | None = 1024.0, alpha: float = 0.02) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.mean = 0.0 if initial_tokens is None else max(1.0, initial_tokens)

    def observe(self, tokens: int) -> None:
        if tokens > 0:
            if self.mean <= 0.0:
                self.mean = float(tokens)
            else:
                self.mean += self.alpha * (tokens - self.mean)

    def ref_tokens(self) -> int:
        """The mean on the grid 1.25^k, at least 16 tokens; 0 before any sample when the
        mix has no prior."""
        if self.mean <= 0.0:
            return 0
        k = round(math.log(max(self.mean, 16.0)) / _GRID_LOG)
        return max(16, round(math.exp(k * _GRID_LOG)))
