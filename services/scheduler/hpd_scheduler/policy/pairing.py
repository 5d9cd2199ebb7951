"""Pairing, the stage between scoring and picking: turn each side's candidates into
options (a prefill worker, a decode worker and how the KV gets across) and score each
option as a pair. Two strategies: `Pairing.joint` (every prefill candidate with every
decode candidate, with the link between them, plus the decode worker's own prefill where
it can win) and `Pairing.independent` (the best prefill worker, then each decode worker
against it); a colocated profile runs `joint` with local options only. With an SLO
objective, each decode worker's options are then judged against the tier's targets
(`_apply_slo`).
"""

from __future__ import annotations

import random

from .config import Profile, SloObjective
from .domain import Mode, Role, Stage
from .framework import Candidate, Option, RequestContext, Scorer
from .mechanisms import handoff_mode
from .preselect import Preselection

__all__ = ["NO_LOCAL_LABEL", "NO_LOCAL_VALUE", "Pairing", "handoff_cost", "own_ms"]

NO_LOCAL_LABEL = "local-prefill"
NO_LOCAL_VALUE = "never"
"""A decode-only worker labelled ``local-prefill=never`` is offered no prefill of its own
(recompute) while some prefill worker's KV can reach it: the operator keeps its batches
free of prefills whatever the estimates say (a transfer slower than recomputing is
planned all the same). Where no KV can reach it, it still recomputes: serving beats
refusing."""


class Pairing:
    """The pairing strategies for one profile (module docstring)."""

    __slots__ = ("_dp", "_inv_wd", "_inv_wp", "_pp", "preselection", "profile")

    def __init__(self, profile: Profile, preselection: Preselection) -> None:
        self.profile = profile
        self.preselection = preselection
        self._pp: list[tuple[Scorer, float]] = [
            (s, w) for s, w in profile.prefill.scorers if s.pairwise
        ]
        self._dp: list[tuple[Scorer, float]] = [
            (s, w) for s, w in profile.decode.scorers if s.pairwise
        ]
        self._inv_wp = 1.0 / profile.prefill.total_weight
        self._inv_wd = 1.0 / profile.decode.total_weight

    @property
    def pairwise(self) -> bool:
        """Whether any scorer looks at the pair (the record then explains pair factors)."""
        return bool(self._pp or self._dp)

    def local(self, d: Candidate, ctx: RequestContext, face: Candidate | None = None) -> Option:
        """Prefill on the decode worker itself: SAME_POOL if it serves both stages, else
        RECOMPUTE. Its prefill-side face is scored like any prefill candidate; ``face`` is
        that candidate when the caller already holds it, unmodified, from the prefill
        preselection (the same worker, request and scorers give the same values)."""
        if face is None:
            face = Candidate(d.ws, Role.PREFILL, ctx.request, ctx.fleet.ref_tokens)
            self.preselection.score(face, ctx)
        mode = Mode.SAME_POOL if d.ws.view.stage is Stage.BOTH else Mode.RECOMPUTE
        return Option(face, d, mode, 0.0, face.run_ms, 0.0, face.wait_ms + face.run_ms)

    def pair_score(
        self, o: Option, transfer: float | None, ctx: RequestContext, wp: float, wd: float
    ) -> None:
        """``o.score = w_P (P_static + sum w s(link)) / W_P + w_D (D_static + ...) / W_D``."""
        p_total = o.p.score
        for scorer, weight in self._pp:
            p_total += weight * scorer.score_pair(o.p, transfer, ctx)
        d_total = o.d.score
        for scorer, weight in self._dp:
            d_total += weight * scorer.score_pair(o.d, transfer, ctx)
        o.score = wp * p_total * self._inv_wp + wd * d_total * self._inv_wd

    def pair_factors(self, o: Option, ctx: RequestContext) -> dict[str, float]:
        """The pairwise factor values of an option (recomputed for the record, off the hot
        path; the same pure functions, so the same values)."""
        transfer = handoff_cost(o)
        out: dict[str, float] = {}
        for scorer, _ in self._pp:
            out["prefill." + scorer.name] = scorer.score_pair(o.p, transfer, ctx)
        for scorer, _ in self._dp:
            out["decode." + scorer.name] = scorer.score_pair(o.d, transfer, ctx)
        return out

    def joint(
        self,
        pcands: list[Candidate],
        dcands: list[Candidate],
        ctx: RequestContext,
        wp: float,
        wd: float,
        colocated: bool,
    ) -> list[Option]:
        fleet = ctx.fleet
        handoff_terms = fleet.handoff_terms
        prompt = ctx.request.prompt_tokens
        pair_score = self.pair_score
        slo = self.profile.slo_objective
        local_always = slo is not None and slo.conditional
        # a worker in both top-k lists: its prefill candidate doubles as its local face
        faces = {id(p.ws): p for p in pcands}
        # per prefill candidate, once: (candidate, its worker, KV bytes per token, wait +
        # prefill)
        sources = [(p, p.ws, p.ws.cap.kv_bytes_per_token, p.wait_ms + p.run_ms) for p in pcands]
        options: list[Option] = []
        for d in dcands:
            dws = d.ws
            first = len(options)
            # the decode engine pulls only the blocks its own prefix cache lacks
            missing = prompt - d.cached_tokens
            recompute_ms = d.run_ms  # the decode worker's own prefill time for the prompt
            # a worker serving both stages always offers SAME_POOL; a decode-only worker
            # recomputes when some pair's KV cannot reach it faster (the seed's rule,
            # `handoff_mode`), or always under conditional disaggregation, where the SLO
            # objective decides;
            # an operator may keep a decode-only engine from ever prefilling while a
            # transfer can reach it (label ``local-prefill=never``: its batches are never
            # held up by a prefill, as in a router's fixed P/D mode)
            never = bool(pcands) and dws.view.labels.get(NO_LOCAL_LABEL) == NO_LOCAL_VALUE
            need_local = colocated or dws.view.stage is Stage.BOTH or not pcands or local_always
            if never and dws.view.stage is not Stage.BOTH:
                need_local = False
            if not colocated:
                for p, pws, bpt, ahead in sources:
                    if pws is dws:
                        continue
                    terms = handoff_terms(pws, dws)
                    if terms is None:
                        need_local = True
                        continue
                    kv = missing * bpt
                    conv = kv * terms[2]
                    xfer = kv * terms[0] + terms[1] + conv
                    if not never and handoff_mode(xfer, recompute_ms) is Mode.RECOMPUTE:
                        need_local = True
                        continue
                    o = Option(
                        p, d, Mode.TRANSFER, xfer, recompute_ms, conv, ahead + xfer, terms[3]
                    )
                    pair_score(o, xfer, ctx, wp, wd)
                    options.append(o)
            if need_local:
                local = self.local(d, ctx, faces.get(id(dws)))
                if colocated:
                    local.mode = Mode.SAME_POOL
                pair_score(local, handoff_cost(local), ctx, wp, wd)
                options.append(local)
            if slo is not None and len(options) > first:
                _apply_slo(options, first, d, ctx, slo)
        return options

    def independent(
        self,
        pcands: list[Candidate],
        dcands: list[Candidate],
        ctx: RequestContext,
        rng: random.Random,
    ) -> list[Option]:
        prof = self.profile
        picker = prof.picker
        ps, ds = prof.prefill, prof.decode
        fleet = ctx.fleet
        prompt = ctx.request.prompt_tokens
        for p in pcands:
            for scorer, weight in ps.scorers:
                if scorer.pairwise:
                    v = scorer.score_pair(p, None, ctx)
                    p.factors[scorer.name] = v
                    p.score += weight * v
            p.score /= ps.total_weight
        p_best = picker.rank(pcands, rng)[0] if pcands else None
        plans: list[tuple[Candidate, Option]] = []
        for d in dcands:
            local = self.local(d, ctx)
            option = local
            xfer: float | None = handoff_cost(local)
            if p_best is not None and p_best.ws is not d.ws:
                terms = fleet.handoff_terms(p_best.ws, d.ws)
                if terms is not None:
                    kv = (prompt - d.cached_tokens) * p_best.ws.cap.kv_bytes_per_token
                    conv = kv * terms[2]
                    t = kv * terms[0] + terms[1] + conv
                    ttft = p_best.wait_ms + p_best.run_ms + t
                    if handoff_mode(t, local.recompute_ms) is Mode.TRANSFER:
                        xfer = t
                        option = Option(
                            p_best, d, Mode.TRANSFER, t, local.recompute_ms, conv, ttft, terms[3]
                        )
            total = d.score
            for scorer, weight in ds.scorers:
                if scorer.pairwise:
                    v = scorer.score_pair(d, xfer, ctx)
                    d.factors[scorer.name] = v
                    total += weight * v
            d.score = total / ds.total_weight
            option.score = d.score
            option.factors = dict(d.factors)
            plans.append((d, option))
        ranked_d = picker.rank([d for d, _ in plans], rng)
        by_d = {id(d): o for d, o in plans}
        return [by_d[id(d)] for d in ranked_d]


def _apply_slo(
    options: list[Option],
    first: int,
    d: Candidate,
    ctx: RequestContext,
    slo: SloObjective,
) -> None:
    """The SLO objective (``config.SloObjective``) on the options ``options[first:]``, which
    all decode on ``d``: add the decode admission wait to each TTFT estimate, set each TPOT
    estimate (``Option.tpot_ms``: ``d``'s step as its prefills stretch it,
    ``WorkerState.tpot_ms``, and a local prefill's stall), then
    ``score = ((1 - s) score + s T / (T + ttft) + targets kept) / 3``.

    The admission wait overlaps the prefill for a transfer (the decode worker frees slots
    while the prefill worker works): ``ttft = wait_p + prefill + max(0, admit - wait_p -
    prefill) + hand-off``. A local prefill (RECOMPUTE, SAME_POOL) starts only once admitted:
    ``ttft = admit + wait + prefill``."""
    tier = ctx.tier
    req = ctx.request
    # how fast d's batch frees a slot depends on how long its running sequences live: the
    # traffic's mean output; this request's own stood for theirs, so the short-output
    # requests near the admission limit were the ones whose wait was predicted short
    lives = ctx.fleet.ref_output_tokens or req.expected_output_tokens
    admit = d.ws.admission_wait_ms(d.kv_need, float(max(lives, 16)))
    # past capacity the requests refused first are those that would hold a decode slot
    # longest: one living k > 1 times the mean is admitted only while its wait, k times
    # over, is within the limit (Option.admit_extra_ms); each one refused frees k slots' worth
    hold = max(1.0, req.expected_output_tokens / lives) if lives > 0 else 1.0
    target = tier.ttft_ms
    ttft_limit = target * slo.ttft_fraction
    tpot_limit = tier.tpot_ms * slo.tpot_fraction
    tpot = d.ws.tpot_ms(d.step_ms)
    tpot_ok = 1.0 if tpot <= tpot_limit else 0.0
    steps = float(max(lives, 1))
    s = slo.slack_weight
    for i in range(first, len(options)):
        o = options[i]
        kept_tpot = tpot_ok
        o.tpot_ms = tpot
        pws = o.p.ws
        if slo.conditional and pws.batch and (pws is d.ws or pws.view.stage is Stage.BOTH):
            # a prefill on a worker that is decoding (a local prefill, or a transfer's on a
            # worker serving both stages; a prefill worker's batch is prefills, which this
            # one only queues behind) stalls its running batch: the sequences there wait
            # for the prefill queued on it and this prompt's, spread over a sequence's decode
            # steps (the traffic's mean output); an option that would push
            # their TPOT past the target does not keep it. (The prefill queued on the decode
            # side was tried as a stall on a transfer too: on the suite it cost the
            # slow-link cells up to 27 % of goodput and was left out.)
            step = tpot if pws is d.ws else pws.tpot_ms(pws.step_ms())
            stalled = step + (o.p.wait_ms + o.p.run_ms) / steps
            o.tpot_ms = max(tpot, stalled)
            if stalled > tpot_limit:
                kept_tpot = 0.0
        if admit > 0:
            ahead = o.p.wait_ms + o.p.run_ms if o.mode is Mode.TRANSFER else 0.0
            o.ttft_ms += max(0.0, admit - ahead)
            if hold > 1.0:
                o.admit_extra_ms = max(0.0, admit * hold - ahead) - max(0.0, admit - ahead)
        kept = kept_tpot + (1.0 if o.ttft_ms <= ttft_limit else 0.0)
        slack = target / (target + max(o.ttft_ms, 0.0))
        o.score = ((1.0 - s) * o.score + s * slack + kept) / 3.0


def own_ms(o: Option) -> float:
    """The part of an option's TTFT estimate that is the request's own work, not waiting:
    its prefill and, for a transfer, the hand-off."""
    return o.p.run_ms + (o.transfer_ms if o.mode is Mode.TRANSFER else 0.0)


def handoff_cost(o: Option) -> float:
    """What the hand-off costs, in ms, for the link scorers: the transfer (with conversion)
    for TRANSFER, the decode worker's recompute for RECOMPUTE (it pays that instead of a
    transfer), nothing for SAME_POOL."""
    if o.mode is Mode.TRANSFER:
        return o.transfer_ms
    if o.mode is Mode.RECOMPUTE:
        return o.recompute_ms
    return 0.0
