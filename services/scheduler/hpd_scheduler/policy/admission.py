"""The option filters: the stage after pairing that keeps the (prefill, decode) options
within a limit and refuses the request, with the filter's reason, when none is
(``OptionFilter``; registered with the other plugins in ``plugins.py``).

A profile lists its option filters (``option_filters:``, applied in order); a profile that
lists none gets the built-in ones its tier and SLO objective ask for
(:func:`default_option_filters`): the tier's hard TTFT, then the admission limits past
capacity by TTFT and by TPOT (``SloObjective.admit_ttft_factor`` / ``admit_tpot_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .config import SloObjective
from .domain import Request
from .errors import InvalidInputError
from .framework import Option, OptionFilter, RequestContext
from .pairing import own_ms

__all__ = [
    "ADMISSION_RETRY_FLOOR_MS",
    "AdmissionLimitFilter",
    "HardTtftFilter",
    "LimitParams",
    "TpotAdmissionFilter",
    "TtftAdmissionFilter",
    "admission_retry_ms",
    "default_option_filters",
    "solo_step_ms",
]

ADMISSION_RETRY_FLOOR_MS = 100.0
"""The shortest retry delay an admission refusal suggests (gRPC carries milliseconds; the
gateway's HTTP Retry-After rounds up to whole seconds)."""


def admission_retry_ms(best_ttft_ms: float, limit_ms: float, most_ms: float) -> float:
    """The retry delay of an admission refusal: how far the best option's predicted TTFT is
    past the limit, i.e. how long the work queued ahead of this request must drain before a
    request like it fits (with no new arrivals), at least ``ADMISSION_RETRY_FLOOR_MS`` and at
    most ``most_ms`` (the tier's queue budget, the delay every other refusal suggests). The
    fixed queue budget told every refused client of the batch tier to stay away 20 s, however
    close to the limit its request was: three such refusals cut a real-engine benchmark's
    throughput at 8 in flight to 0.36 of the peer's (bench/README.md, gateway.py)."""
    return min(most_ms, max(ADMISSION_RETRY_FLOOR_MS, best_ttft_ms - limit_ms))


def solo_step_ms(o: Option, request: Request) -> float:
    """The decode step of ``o``'s decode worker with only this request running (its prompt
    and half its output resident; the same figures as ``Candidate.step_ms``)."""
    ws = o.d.ws
    own = request.prompt_tokens + request.expected_output_tokens * 0.5
    return ws.cap.decode_step_ms(own) * ws.m_d + ws.d_seq


@dataclass(frozen=True, slots=True)
class LimitParams:
    """``factor``: the limit is ``factor x`` the tier's target (0: the filter is off; at most
    4, as ``SloObjective`` bounds its admission factors)."""

    factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.factor <= 4.0:
            raise InvalidInputError("factor", f"must be in [0, 4], got {self.factor}")


class HardTtftFilter(OptionFilter):
    """The tier's hard TTFT (``Tier.hard_ttft_ms``; none: off): keeps ``ttft_est <= hard``;
    refuses ``exceeds_hard_ttft`` with the tier's queue budget as the retry delay."""

    type_name: ClassVar[str] = "hard-ttft-filter"
    note: ClassVar[str] = "hard_ttft_ms"
    reject_reason: ClassVar[str] = "exceeds_hard_ttft"

    def bound(self, ctx: RequestContext) -> float | None:
        return ctx.tier.hard_ttft_ms

    def keep(self, options: list[Option], ctx: RequestContext, bound: float) -> list[Option]:
        return [o for o in options if o.ttft_ms <= bound]


class AdmissionLimitFilter(OptionFilter):
    """The admission limits past capacity: ``L = factor x target_ms(ctx)``, one of the
    tier's targets (``LimitParams``; factor 0: the filter is off). Each admission filter
    names its target and how it keeps options against ``L``."""

    Params: ClassVar[type[LimitParams]] = LimitParams

    def target_ms(self, ctx: RequestContext) -> float:
        raise NotImplementedError

    def bound(self, ctx: RequestContext) -> float | None:
        factor = float(self.params.factor)
        return self.target_ms(ctx) * factor if factor > 0 else None


class TtftAdmissionFilter(AdmissionLimitFilter):
    """Admission past capacity by TTFT, limit ``L = factor x tier.ttft_ms``: keeps the options
    with ``ttft_est + admit_extra_ms <= L`` (a request expecting ``k`` times the traffic's
    mean output is judged with ``k`` times its decode admission wait: past capacity the
    longest are refused first). When the prompt's own work (prefill, hand-off: ``own_ms``)
    is past ``L`` on every option, an option whose estimate is at most twice its own work is
    kept too: a prompt too long for the limit is served while it waits no longer than it
    works, so an idle fleet never refuses. None kept: ``ttft_over_admission_limit``, retry
    after how far the best estimate is past ``L`` (:func:`admission_retry_ms`)."""

    type_name: ClassVar[str] = "ttft-admission-filter"
    note: ClassVar[str] = "admission_ttft_ms"
    reject_reason: ClassVar[str] = "ttft_over_admission_limit"

    def target_ms(self, ctx: RequestContext) -> float:
        return ctx.tier.ttft_ms

    def keep(self, options: list[Option], ctx: RequestContext, bound: float) -> list[Option]:
        too_long = bool(options) and min(own_ms(o) for o in options) > bound
        return [
            o
            for o in options
            if o.ttft_ms + o.admit_extra_ms <= bound or (too_long and o.ttft_ms <= 2.0 * own_ms(o))
        ]

    def retry_ms(self, options: list[Option], bound: float, default_ms: float) -> float:
        return admission_retry_ms(min(o.ttft_ms for o in options), bound, default_ms)


class TpotAdmissionFilter(AdmissionLimitFilter):
    """Admission past capacity by TPOT, limit ``L = factor x tier.tpot_ms``: keeps the options
    with ``tpot_est <= L`` (the decode worker's step with this request and the prefills it is
    taking). When none is, a worker too slow for ``L`` even decoding this request alone
    (``solo_step_ms > L``) whose load at most doubles that step is kept: not past capacity,
    and an idle fleet must not refuse. Only then and only such workers: applied beside options
    within the limit, or to workers that could meet it alone, it let through requests that
    then missed (bench/README.md). None kept: ``tpot_over_admission_limit``."""

    type_name: ClassVar[str] = "tpot-admission-filter"
    note: ClassVar[str] = "admission_tpot_ms"
    reject_reason: ClassVar[str] = "tpot_over_admission_limit"

    def target_ms(self, ctx: RequestContext) -> float:
        return ctx.tier.tpot_ms

    def keep(self, options: list[Option], ctx: RequestContext, bound: float) -> list[Option]:
        kept = [o for o in options if o.tpot_ms <= bound]
        if kept:
            return kept
        request = ctx.request
        return [
            o
            for o in options
            if solo_step_ms(o, request) > bound and o.tpot_ms <= 2.0 * solo_step_ms(o, request)
        ]


def default_option_filters(slo: SloObjective | None) -> tuple[OptionFilter, ...]:
    """The option filters of a profile that lists none: the hard TTFT (always; it applies
    to tiers that set one), then the TTFT and TPOT admission limits the SLO objective's
    ``admit_ttft_factor`` / ``admit_tpot_factor`` ask for (0 or no objective: none)."""
    out: list[OptionFilter] = [HardTtftFilter("hard-ttft")]
    if slo is not None and slo.admit_ttft_factor > 0:
        out.append(TtftAdmissionFilter("ttft-admission", LimitParams(slo.admit_ttft_factor)))
    if slo is not None and slo.admit_tpot_factor > 0:
        out.append(TpotAdmissionFilter("tpot-admission", LimitParams(slo.admit_tpot_factor)))
    return tuple(out)
