"""The simulator learns speeds the way the scheduler service does: the same samples
(``hpd_scheduler.policy.learning.samples_from``) from the same terms of each plan and the same
measured figures of each outcome, fed to the same learner (``SpeedLearner``), whose fits
become the worker views' ``learned`` figures (a worker without one: the fleet's prior).

What the service gets from the gateway, the simulator reads off its own clock: the prefill
phase of a transfer is from the plan (the request's arrival: the simulator plans at once)
to the end of its prefill iteration, as the gateway times its prefill call; for a request
served on one worker, to its first token. An outcome is reported when the request
finishes, as the gateway reports it after the stream's end, so the learner lags the
traffic as the service's does.

This matters when a pool's engines do not run at their declaration (a cluster pool's
``actual`` figures: ``ClusterSpec``): the planner then learns their real speed from
outcomes, exactly as it would on real engines, and ``hpd sim`` shows what that costs or
saves. With engines that run as declared the learned scale stays near 1 (0.94-1.06 on the
homogeneous cluster at half and at three times its capacity, admitted attainment 1.00 and
0.998 against 1.00 and 0.993 without), so ``SimConfig.learn`` is on by default only for a
cluster with a pool that runs otherwise than declared. The decode step is learned the same
way from each request's TPOT (its finish less its first token over its output), where a
pool's decode runs otherwise than declared (``learn_steps``; the engine module says why).
"""

from __future__ import annotations

from typing import Any

from hpd_scheduler.policy import LearnedSpeed, LearnedStep, RoutePlan
from hpd_scheduler.policy.learner import SpeedLearner
from hpd_scheduler.policy.learning import samples_from

__all__ = ["SimLearner"]

_INCARNATION = 1
"""Simulated engines never restart: one incarnation each."""


class SimLearner:
    """Per-request plan terms and prefill end times, fed to a :class:`SpeedLearner`."""

    def __init__(self, learn_steps: bool = True) -> None:
        self.learner = SpeedLearner()
        self.learn_steps = learn_steps
        self._plans: dict[int, dict[str, Any]] = {}
        self._planned_at: dict[int, float] = {}
        self._prefill_end: dict[int, float] = {}
        self._prior: tuple[int, LearnedSpeed | None] = (-1, None)
        self._step_prior: tuple[int, LearnedStep | None] = (-1, None)

    def planned(self, i: int, plan: RoutePlan, now_s: float) -> None:
        e = plan.estimates
        self._plans[i] = {
            "mode": plan.mode.value,
            "prefill_worker_id": plan.prefill_worker_id,
            "decode_worker_id": plan.decode_worker_id,
            "prefill_pool_id": plan.prefill_pool_id,
            "decode_pool_id": plan.decode_pool_id,
            "estimates": {
                "prefill_nominal_ms": e.prefill_nominal_ms,
                "prefill_ahead": e.prefill_ahead,
                "decode_nominal_ms": e.decode_nominal_ms,
                "decode_others": e.decode_others,
                "decode_step_ms": e.decode_step_ms,
                "decode_duty": e.decode_duty,
                "tpot_ms": e.tpot_ms,
                "kv_bytes": e.kv_bytes,
            },
        }
        self._planned_at[i] = now_s

    def prefill_done(self, i: int, now_s: float) -> None:
        self._prefill_end[i] = now_s

    def finished(self, i: int, first_s: float, now_s: float, output_tokens: int = 0) -> None:
        """Request ``i`` ended (its first token at ``first_s``, ``output_tokens`` in all):
        learn from it (its TPOT too, as the gateway measures it, with two tokens or more)."""
        plan = self._plans.pop(i, None)
        at = self._planned_at.pop(i, now_s)
        end = self._prefill_end.pop(i, 0.0)
        if plan is None:
            return
        ttft_ms = (first_s - at) * 1000.0
        outcome = {
            "success": True,
            "ttft_ms": ttft_ms,
            "prefill_ms": (end - at) * 1000.0 if plan["mode"] == "transfer" and end else ttft_ms,
            "tpot_ms": (now_s - first_s) * 1000.0 / (output_tokens - 1)
            if output_tokens > 1
            else 0.0,
        }
        workers = {str(plan["prefill_worker_id"]), str(plan["decode_worker_id"])}
        for key, sample in samples_from(
            plan, outcome, 1, dict.fromkeys(workers, _INCARNATION), round(now_s * 1000)
        ):
            if self.learn_steps or not key.startswith("d:"):
                self.learner.add(key, sample, _INCARNATION)

    def step(self, worker_id: str) -> LearnedStep | None:
        """Its own decode step fit, else the fleet's prior (as :meth:`prefill`); None
        always when the run does not learn decode steps (``learn_steps``)."""
        own = self.learner.step(worker_id)
        if own is not None:
            return own
        gen = self.learner.generation
        if self._step_prior[0] != gen:
            peers = {k[2:] for k in self.learner.fits}
            self._step_prior = (gen, self.learner.step_prior(peers))
        return self._step_prior[1]

    def prefill(self, worker_id: str) -> LearnedSpeed | None:
        """Its own fit, else the fleet's prior (one model: every worker's fits)."""
        own = self.learner.prefill(worker_id)
        if own is not None:
            return own
        gen = self.learner.generation
        if self._prior[0] != gen:
            self._prior = (gen, self.learner.prior(k[2:] for k in self.learner.fits))
        return self._prior[1]
