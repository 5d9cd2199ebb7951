"""The learner's state: every worker's samples and fits, kept as outcomes come in or as the
store shares them (``hpd_scheduler.learn_store``), and the figures the planner takes from
them. The fitting itself, what an outcome teaches and why, is ``learning.py``. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .domain import LearnedSpeed, LearnedStep
from .learning import (
    REFIT_EVERY,
    SHIFT_FACTOR,
    WINDOW,
    Fit,
    Sample,
    fit,
    median,
    prefill_key,
    queue_key,
    queue_share,
    step_key,
)

__all__ = ["SpeedLearner"]


class SpeedLearner:
    """The samples and fits of every worker (``prefill_key``; its queued samples under
    ``queue_key`` set the fit's queue share; its decode step under ``step_key``).

    ``version[worker]`` increments when a worker's fit changes and ``generation`` when any
    does (a worker planned by the fleet's prior follows the others' fits), so cached views
    know to rebuild. Every replica holds the same samples (``learn_store``), so every
    replica fits the same."""

    def __init__(self) -> None:
        self.samples: dict[str, list[Sample]] = {}
        self.fits: dict[str, Fit] = {}
        self.version: dict[str, int] = {}
        self.generation = 0
        self._since: dict[str, int] = {}  # samples added since the key's last fit
        self._base: dict[str, Fit] = {}  # the fit of the unqueued samples alone

    def add(self, key: str, sample: Sample, incarnation: int = 0) -> None:
        """One new sample, kept locally (the store shares it with the other replicas).

        A fit costs about a millisecond of Python, so it is redone only when it can have
        moved: while it rests on fewer than ``WINDOW`` samples, when the new one misses it
        by more than ``SHIFT_FACTOR`` (a speed change starts so), and otherwise every
        ``REFIT_EVERY`` samples. A queued sample only moves the queue share (a median of
        at most ``WINDOW`` figures: microseconds), redone every time."""
        self._keep(key, sample)
        if key.startswith("q:"):
            self._reshare(key[2:], incarnation)
        elif self._due(key, sample):  # a prefill (p:) or decode step (d:) sample
            self._refit(key, incarnation)

    def add_batch(self, batch: Iterable[tuple[str, Sample]]) -> None:
        """Several samples at once (``hpd_scheduler.learning_queue``), each under its own
        incarnation: every key is refitted at most once, when any of its new samples would
        have refitted it alone (``add``'s rule), and every queue share redone once, after
        the fits it rests on."""
        refit: dict[str, int] = {}
        reshare: dict[str, int] = {}
        for key, sample in batch:
            self._keep(key, sample)
            if key.startswith("q:"):
                reshare[key[2:]] = sample.inc
            elif key in refit or self._due(key, sample):
                refit[key] = sample.inc  # refitted once, with every sample of the batch
        for key, inc in refit.items():
            self._refit(key, inc)  # a prefill key's refit reshares its worker too
        for worker, inc in reshare.items():
            if prefill_key(worker) not in refit:
                self._reshare(worker, inc)

    def _keep(self, key: str, sample: Sample) -> None:
        kept = self.samples.setdefault(key, [])
        kept.append(sample)
        del kept[: -2 * WINDOW]

    def _due(self, key: str, sample: Sample) -> bool:
        """Whether ``sample`` (just kept) should refit its key (``add``'s rule); counts it
        toward the next periodic refit when not."""
        f = self.fits.get(key)
        n = self._since.get(key, 0) + 1
        if f is not None and f.samples >= WINDOW and n < REFIT_EVERY:
            ratio = sample.y / max(f.predict(sample.x, sample.ahead), 1e-9)
            if 1 / SHIFT_FACTOR <= ratio <= SHIFT_FACTOR:
                self._since[key] = n
                return False
        self._since[key] = 0
        return True

    def replace(
        self, stored: Mapping[str, Iterable[Sample]], incarnations: Mapping[str, int]
    ) -> None:
        """Every key's samples as the store holds them (oldest first)."""
        for key, got in stored.items():
            new = list(got)[-2 * WINDOW :]
            if key[:2] in ("p:", "q:", "d:") and new != self.samples.get(key):
                self.samples[key] = new
                inc = incarnations.get(key[2:], 0)
                if key.startswith("q:"):
                    self._reshare(key[2:], inc)
                else:
                    self._refit(key, inc)

    def forget_incarnation(self, worker_id: str, incarnation: int) -> None:
        """The worker registered anew: its fits of an earlier engine no longer apply."""
        key = prefill_key(worker_id)
        if key in self.samples or key in self.fits or queue_key(worker_id) in self.samples:
            self._refit(key, incarnation)
        key = step_key(worker_id)
        if key in self.samples or key in self.fits:
            self._refit(key, incarnation)

    def _refit(self, key: str, incarnation: int) -> None:
        pts = [s for s in self.samples.get(key, []) if s.inc == incarnation]
        base = fit(pts)
        if key.startswith("d:"):
            self._set(key, base)
            return
        if base is None:
            self._base.pop(key, None)
        else:
            self._base[key] = base
        self._reshare(key[2:], incarnation)

    def _reshare(self, worker_id: str, incarnation: int) -> None:
        """The worker's fit: its unqueued fit with the share its queued samples set."""
        key = prefill_key(worker_id)
        base = self._base.get(key)
        queued = [s for s in self.samples.get(queue_key(worker_id), []) if s.inc == incarnation]
        self._set(key, None if base is None else queue_share(base, queued))

    def _set(self, key: str, new: Fit | None) -> None:
        if new == self.fits.get(key):
            return
        if new is None:
            self.fits.pop(key, None)
        else:
            self.fits[key] = new
        self.version[key[2:]] = self.version.get(key[2:], 0) + 1
        self.generation += 1

    def prefill(self, worker_id: str) -> LearnedSpeed | None:
        f = self.fits.get(prefill_key(worker_id))
        if f is None:
            return None
        return LearnedSpeed(f.fixed_ms, f.scale, f.samples, f.queue_share)

    def step(self, worker_id: str) -> LearnedStep | None:
        """The worker's decode step as fitted (``fixed`` of the fit is the step's cost per
        sequence), or None before it has one."""
        f = self.fits.get(step_key(worker_id))
        return None if f is None else LearnedStep(f.scale, f.fixed_ms, f.samples)

    def step_prior(self, worker_ids: Iterable[str]) -> LearnedStep | None:
        """The decode step a worker without a fit is planned at: the median of its model's
        fits (as ``prior``), 0 samples of its own; None when none has one."""
        fits = [f for w in worker_ids if (f := self.fits.get(step_key(w))) is not None]
        if not fits:
            return None
        return LearnedStep(median([f.scale for f in fits]), median([f.fixed_ms for f in fits]), 0)

    def prior(self, worker_ids: Iterable[str]) -> LearnedSpeed | None:
        """The speed a worker without a fit is planned at: the median fixed cost, scale
        and queue share of the fits among ``worker_ids`` (its model's workers; module
        docstring), with 0 samples of its own; None when none of them has a fit."""
        fits = [f for w in worker_ids if (f := self.fits.get(prefill_key(w))) is not None]
        if not fits:
            return None
        return LearnedSpeed(
            median([f.fixed_ms for f in fits]),
            median([f.scale for f in fits]),
            0,
            median([f.queue_share for f in fits]),
        )
