"""The planner: one request in, one decision out. Pure and synchronous; the fleet snapshot,
the time and the random generator come in as arguments.

Stages of :meth:`Planner.plan`:

1. validate the request, resolve its tier, classify its resource need (seed 000);
2. memory pressure of the model's decode workers and the serving ladder (``serving.py``);
3. preselect the top-k decode and prefill workers from the snapshot's indexes, applying the
   profile's per-request filters to the workers scanned (``Fleet.top_k``);
4. score each candidate with the pair-independent scorers, once;
5. build options and score them with the pairwise (link) scorers:

   * hand-off per pair by the seed rule made real: TRANSFER when the KV formats negotiate
     and ``bytes x 8 / link Gb/s + latency + conversion <= recompute_ms``, where
     ``recompute_ms`` is the decode worker's own prefill time for the prompt; otherwise the
     pair degenerates to RECOMPUTE on the decode worker. (Comparing whole-path TTFTs instead
     would send work to idle decode GPUs and stall their running batches: recompute costs
     the decode side compute, a transfer does not.)
   * ``joint``: every prefill x decode pair of the two top-k lists, plus a local option on a
     decode worker when it serves both stages (SAME_POOL) or some pair must recompute; with
     the SLO objective's ``conditional`` (the default profile) on every decode worker, and
     the whole-path estimates below choose between disaggregated and local serving
     (conditional disaggregation; a local prefill's TPOT estimate counts its stall on the
     running batch, and so does a transfer's prefill on a worker that also decodes).
     Pair score = ``w_P x P(p, link) + w_D x D(d, link)``, side weights by resource need
     (prefill-heavy requests weigh the prefill side more);
   * ``independent`` (seed and the baselines): prefill ranked alone (link unknown: the
     seed's 0.5), then decode ranked with the chosen prefill worker's link;
   * ``colocated``: only local options on workers serving both stages;
   * with the profile's ``slo_objective`` (ours; ``config.SloObjective``), joint options
     then get the whole-path TTFT (+ the decode worker's admission wait) and are ranked by
     the SLO targets they are predicted to keep before the weighted factors;

6. drop options above the tier's hard TTFT limit; with the SLO objective's
   ``admit_ttft_factor``, refuse the request when every option is predicted past that
   multiple of the tier's TTFT target (admission past capacity); rank the rest with the
   picker; apply the ladder: throttle (refuse tiers that may be throttled, with a retry
   delay), lower the batch cap (recorded; the service turns it into max-batch-size
   directives with ``balance.adapt_batch_size``), fall back to a shared pool (SAME_POOL
   options first, decision REROUTE), shed (refuse the lowest sheddable tier); build the
   fallback chain.

Work per request is O(k^2) scoring plus an O(k) walk of a sorted order: independent of fleet
size up to the scan bound.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from .config import Profile, SloObjective
from .decision import (
    Decision,
    DecisionRecord,
    Estimates,
    FallbackStep,
    RejectClass,
    RoutePlan,
)
from .domain import DecisionKind, Mode, Request, ResourceNeed, Role, Stage, Tier
from .fleet import Fleet, ModelIndex, WorkerState
from .framework import Candidate, Option, RequestContext
from .mechanisms import classify_need
from .prefix import matched_blocks
from .serving import Action, Protects, ServingAction, select_action

__all__ = ["Planner"]

# what a reject's record names: no worker could run it at all, or none could now (the
# refusal protects the latency of what is already admitted)
_REJECT_INCAPABLE = ServingAction(Action.REJECT, Protects.NOTHING)
_REJECT_SATURATED = ServingAction(Action.REJECT, Protects.LATENCY)


PREFIX_HOLDERS = 2
"""Holders of the longest prefixes that take the last places of a role's top k: the two
longest matches (a shorter one saves less), in place of the preselection's last ones
rather than beside them, since each extra candidate adds a row of pairs to the joint
search (measured: k extra holders nearly doubled a decision's p99 at 256 workers with
8k-token prompts, bench/kv_index.py)."""


def prefix_matches(ctx: RequestContext) -> dict[int, int]:
    """Per worker (snapshot index) holding the request's first block, how many blocks of its
    chain it holds in a row; once per plan. With the index's heads (``Fleet.prefix_heads``)
    only the holders of the first block are looked at, else every worker."""
    got = ctx.matched
    if got is not None:
        return got
    out: dict[int, int] = {}
    req = ctx.request
    chain = req.prefix_blocks
    if chain:
        head = chain[0]
        bt = req.prefix_block_tokens
        fleet = ctx.fleet
        heads = fleet.prefix_heads
        pool: list[WorkerState] = []
        if heads is not None:
            for wid in heads.get(head, ()):
                ws = fleet.by_id.get(wid)
                if ws is not None:
                    pool.append(ws)
        else:
            pool = fleet.states
        for ws in pool:
            held = ws.held
            if held is None or ws.held_block_tokens != bt or head not in held:
                continue
            n = matched_blocks(chain, held)
            if n:
                out[ws.idx] = n
    ctx.matched = out
    return out


def _prefix_holders(
    fleet: Fleet,
    index: ModelIndex,
    matches: dict[int, int],
    k: int,
    kept: list[WorkerState],
    drop: Callable[[WorkerState], str | None],
) -> list[WorkerState]:
    """Up to ``k`` workers of ``index`` that preselection left out, holding the longest
    prefixes of the request's chain (a preselection by capacity or load knows nothing of
    caches; KV-aware routers look at every holder)."""
    if not matches:
        return []
    seen = {ws.idx for ws in kept}
    found: list[tuple[int, int, WorkerState]] = []
    states = fleet.states
    for idx, n in matches.items():
        if idx in seen:
            continue
        ws = states[idx]
        if ws.view.model_id != index.model_id or not ws.view.stage.serves(index.role):
            continue
        found.append((-n, idx, ws))
    found.sort(key=lambda row: (row[0], row[1]))
    out: list[WorkerState] = []
    for _, _, ws in found:
        if len(out) >= k:
            break
        if drop(ws) is None:
            out.append(ws)
    return out


class Planner:
    """Runs one :class:`~.config.Profile`. Holds only the round-robin cursors (state the
    round-robin baseline needs); everything else comes in per call."""

    __slots__ = (
        "_cursor",
        "_dp",
        "_drops",
        "_ds",
        "_inv_wd",
        "_inv_wp",
        "_pp",
        "_ps",
        "_weights",
        "profile",
    )

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._cursor: dict[tuple[str, Role], int] = {}
        self._pp = [(s, w) for s, w in profile.prefill.scorers if s.pairwise]
        self._dp = [(s, w) for s, w in profile.decode.scorers if s.pairwise]
        # the pair-independent scorers of each side, (bound score method, name, weight), in
        # profile order
        self._ps = [(s.score, s.name, w) for s, w in profile.prefill.scorers if not s.pairwise]
        self._ds = [(s.score, s.name, w) for s, w in profile.decode.scorers if not s.pairwise]
        self._inv_wp = 1.0 / profile.prefill.total_weight
        self._inv_wd = 1.0 / profile.decode.total_weight
        # per role: the filters' bound drop_reason methods (looked up once, not per worker)
        self._drops = {
            Role.PREFILL: tuple(f.drop_reason for f in profile.prefill.filters),
            Role.DECODE: tuple(f.drop_reason for f in profile.decode.filters),
        }
        # every record shares these (records only read them)
        self._weights = (profile.prefill.weights(), profile.decode.weights())

    # -- public -------------------------------------------------------------------------------

    def plan(self, request: Request, fleet: Fleet, now_s: float, rng: random.Random) -> Decision:
        """Decide where ``request`` runs. Raises :class:`~.errors.InvalidInputError` for a bad
        request or unknown tier; every other outcome (including reject) is a Decision."""
        prof = self.profile
        request.validate()
        tier = prof.tier(request.tier)
        need = classify_need(
            request.prompt_tokens,
            request.expected_output_tokens,
            prof.long_prompt_tokens,
            prof.long_decode_tokens,
        )
        pidx = fleet.index(request.model_id, Role.PREFILL)
        didx = fleet.index(request.model_id, Role.DECODE)
        ctx = RequestContext(request, tier, need, now_s, fleet, pidx, didx)
        pressure = fleet.memory_pressure(request.model_id)
        wp, wd = prof.side_weights[need]
        record = DecisionRecord(
            profile=prof.name,
            tier=tier.name,
            memory_pressure=pressure,
            prefill_weights=self._weights[0],
            decode_weights=self._weights[1],
            side_weights=(wp, wd),
        )
        if didx is not None:
            record.rejected_pools.update(didx.rejected_pools())
            record.rejected_workers.extend(didx.static_drops[:64])
        if didx is None or not didx.workers:
            # say what is missing: the model has no worker at all, or prefill workers only
            if didx is not None:
                reason = "no_executable_pool"
            elif pidx is not None:
                reason = "no_decode_worker_for_model"
            else:
                reason = "no_worker_for_model"
            return self._reject(
                request,
                need,
                _REJECT_INCAPABLE,
                (reason, "no_executable_pool") if reason != "no_executable_pool" else (reason,),
                RejectClass.NO_CAPABLE_WORKER,
                None,
                record,
            )

        colocated = prof.pairing == "colocated"
        dcands = self._preselect(didx, Role.DECODE, ctx, rng, record, colocated)
        pcands: list[Candidate] = []
        if prof.pairing != "colocated" and pidx is not None and pidx.workers:
            pcands = self._preselect(pidx, Role.PREFILL, ctx, rng, record, False)
        record.decode_candidates = dcands
        record.prefill_candidates = pcands

        if not dcands:
            cls = RejectClass.SATURATED
            if colocated and not didx.shared:
                cls = RejectClass.NO_CAPABLE_WORKER
            return self._reject(
                request,
                need,
                _REJECT_INCAPABLE if cls == RejectClass.NO_CAPABLE_WORKER else _REJECT_SATURATED,
                ("no_executable_pool",),
                cls,
                self._retry_ms(tier),
                record,
            )

        if prof.pairing == "independent":
            options = self._independent(pcands, dcands, ctx, rng)
        else:
            options = self._joint(pcands, dcands, ctx, wp, wd, colocated)
        record.options = options
        if self._pp or self._dp:
            record.explain = lambda o: self.pair_factors(o, ctx)

        # TTFT limits: the tier's hard one, then admission past capacity
        limits: list[tuple[str, str, float, Callable[[Option], bool]]] = []
        hard = tier.hard_ttft_ms
        if hard is not None:
            limits.append(("hard", "exceeds_hard_ttft", hard, lambda o: o.ttft_ms <= hard))
        slo = prof.slo_objective
        if slo is not None and slo.admit_ttft_factor > 0:
            # admission: when every option's predicted TTFT exceeds factor x the tier's
            # target, the fleet is past capacity for this tier and the request would miss
            # anyway; refused now (with a retry delay) it does not queue in front of requests
            # that can still make theirs. A prompt too long to meet the target even on an idle
            # worker is served while its wait is no longer than its own prefill and hand-off.
            limit = tier.ttft_ms * slo.admit_ttft_factor
            limits.append(
                (
                    "admission",
                    "ttft_over_admission_limit",
                    limit,
                    lambda o: o.ttft_ms <= limit or o.ttft_ms <= 2.0 * _own_ms(o),
                )
            )
        for kind_of, reason, bound, keep in limits:
            ok = [o for o in options if keep(o)]
            if not ok:
                record.notes.append(f"all_options_exceed_{kind_of}_ttft_ms:{bound:g}")
                retry = self._retry_ms(tier)
                if kind_of == "admission":
                    retry = _admission_retry_ms(min(o.ttft_ms for o in options), bound, retry)
                return self._reject(
                    request,
                    need,
                    _REJECT_SATURATED,
                    (reason,),
                    RejectClass.SATURATED,
                    retry,
                    record,
                )
            options = ok

        # independent mode returns its options already in picker order
        ranked = options if prof.pairing == "independent" else prof.picker.rank(options, rng)

        best = ranked[0]
        action = select_action(pressure, best.p.wait_ms, tier.queue_budget_ms, prof.ladder)

        # the ladder, in order: shed, throttle (refusals), then the shared-pool fallback
        if (
            action.took(Action.SHED_LOWEST_TIER)
            and tier.may_shed
            and (prof.lowest_sheddable_tier() == tier.name)
        ):
            return self._reject(
                request,
                need,
                action,
                ("shed_lowest_tier",),
                RejectClass.SHED,
                self._retry_ms(tier),
                record,
            )
        if action.took(Action.THROTTLE_ADMISSION) and tier.may_throttle:
            return self._reject(
                request,
                need,
                action,
                ("throttle_admission",),
                RejectClass.THROTTLED,
                self._retry_ms(tier),
                record,
            )

        kind = DecisionKind.PRIMARY
        if action.took(Action.FALLBACK_TO_SHARED):
            shared = [o for o in ranked if o.mode is Mode.SAME_POOL]
            if not shared and didx.shared and not colocated:
                # the shared pool was not among the top-k: preselect within it (bounded)
                scands = self._preselect(didx, Role.DECODE, ctx, rng, record, True, False)
                extra = self._joint([], scands, ctx, wp, wd, True)
                if hard is not None:
                    extra = [o for o in extra if o.ttft_ms <= hard]
                shared = prof.picker.rank(extra, rng)
                record.options.extend(extra)
            if shared:
                if shared[0] is not ranked[0]:
                    kind = DecisionKind.REROUTE
                ranked = shared + [o for o in ranked if o.mode is not Mode.SAME_POOL]
            else:
                record.notes.append("no_shared_pool")

        if request.preferred_pool:
            preferred = [o for o in ranked if o.d.ws.pool_id == request.preferred_pool]
            if preferred:
                ranked = preferred + [o for o in ranked if o.d.ws.pool_id != request.preferred_pool]
            else:
                kind = DecisionKind.REROUTE
                reasons = record.rejected_pools.get(request.preferred_pool)
                if reasons is None:
                    drops = {
                        r for w, p, r in record.rejected_workers if p == request.preferred_pool
                    }
                    reasons = tuple(sorted(drops)) or ("not_selected",)
                    record.rejected_pools[request.preferred_pool] = reasons

        chosen = ranked[0]
        plan = self._plan_of(chosen, request, need)
        chain = self._chain(chosen, ranked[1:], tier)
        return Decision(
            request_id=request.request_id,
            kind=kind,
            resource_need=need,
            action=action,
            plan=plan,
            fallbacks=chain,
            reject_reasons=(),
            reject_class=None,
            retry_after_ms=None,
            record=record,
        )

    # -- stages -------------------------------------------------------------------------------

    def _preselect(
        self,
        index: ModelIndex,
        role: Role,
        ctx: RequestContext,
        rng: random.Random,
        record: DecisionRecord,
        colocated: bool,
        record_drops: bool = True,
    ) -> list[Candidate]:
        prof = self.profile
        filters = self._drops[role]
        k = prof.top_k_prefill if role is Role.PREFILL else prof.top_k_decode

        def drop(ws: WorkerState) -> str | None:
            if colocated and ws.view.stage is not Stage.BOTH:
                return "not_colocated"
            for drop_reason in filters:
                reason = drop_reason(ws, role, ctx)
                if reason is not None:
                    return reason
            return None

        mode = prof.preselect
        dropped: list[tuple[WorkerState, str]]
        if mode in ("capacity", "blind"):
            kept, dropped, truncated = ctx.fleet.top_k(index, mode, k, drop, prof.max_scan)
            if truncated:
                record.notes.append(f"{role.value}_scan_truncated_at_{prof.max_scan}")
        else:
            kept, dropped = self._scan_order(index, role, ctx, rng, k, drop, mode)
        matches: dict[int, int] | None = None
        if ctx.request.prefix_blocks:
            matches = prefix_matches(ctx)
            holders = _prefix_holders(ctx.fleet, index, matches, PREFIX_HOLDERS, kept, drop)
            if holders:  # they take the last places: the pair search stays k x k
                kept = kept[: max(1, len(kept) - len(holders))] + holders
        if record_drops:
            for ws, reason in dropped[:64]:
                record.rejected_workers.append((ws.worker_id, ws.pool_id, reason))

        ref = ctx.fleet.ref_tokens
        request = ctx.request
        static = self._ps if role is Role.PREFILL else self._ds
        out: list[Candidate] = []
        for ws in kept:
            # a worker found by the prefix search has its match; any other checks its own
            # cache (one lookup when it does not hold the first block)
            c = Candidate(
                ws, role, request, ref, -1 if matches is None else matches.get(ws.idx, -1)
            )
            total = 0.0
            factors = c.factors
            for score, name, weight in static:
                v = score(c, ctx)
                factors[name] = v
                total += weight * v
            c.score = total
            out.append(c)
        return out

    def _scan_order(
        self,
        index: ModelIndex,
        role: Role,
        ctx: RequestContext,
        rng: random.Random,
        k: int,
        drop: Any,
        mode: str,
    ) -> tuple[list[WorkerState], list[tuple[WorkerState, str]]]:
        workers = index.workers
        n = len(workers)
        prof = self.profile
        if mode == "all":
            order = range(n)
            limit = n
        elif mode == "rotation":
            key = (index.model_id, role)
            start = self._cursor.get(key, 0)
            self._cursor[key] = (start + 1) % max(n, 1)
            order = range(start, start + n)
            limit = min(prof.max_scan, n)
        else:
            # random: a uniformly random start, then the next workers; the random picker
            # shuffles the window, so every worker is equally likely to come first
            start = rng.randrange(n) if n else 0
            order = range(start, start + n)
            limit = min(prof.max_scan, n)
        kept: list[WorkerState] = []
        dropped: list[tuple[WorkerState, str]] = []
        for scanned, i in enumerate(order):
            if scanned >= limit or (mode != "all" and len(kept) >= k):
                break
            ws = workers[i % n]
            reason = drop(ws)
            if reason is None:
                kept.append(ws)
            else:
                dropped.append((ws, reason))
        return kept, dropped

    def _local(self, d: Candidate, ctx: RequestContext, face: Candidate | None = None) -> Option:
        """Prefill on the decode worker itself: SAME_POOL if it serves both stages, else
        RECOMPUTE. Its prefill-side face is scored like any prefill candidate; ``face`` is
        that candidate when the caller already holds it, unmodified, from the prefill
        preselection (the same worker, request and scorers give the same values)."""
        if face is None:
            face = Candidate(d.ws, Role.PREFILL, ctx.request, ctx.fleet.ref_tokens)
            total = 0.0
            factors = face.factors
            for score, name, weight in self._ps:
                v = score(face, ctx)
                factors[name] = v
                total += weight * v
            face.score = total
        mode = Mode.SAME_POOL if d.ws.view.stage is Stage.BOTH else Mode.RECOMPUTE
        return Option(face, d, mode, 0.0, face.run_ms, 0.0, face.wait_ms + face.run_ms)

    def _pair_score(
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
        transfer = _handoff_cost(o)
        out: dict[str, float] = {}
        for scorer, _ in self._pp:
            out["prefill." + scorer.name] = scorer.score_pair(o.p, transfer, ctx)
        for scorer, _ in self._dp:
            out["decode." + scorer.name] = scorer.score_pair(o.d, transfer, ctx)
        return out

    def _joint(
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
        pair_score = self._pair_score
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
            # recomputes when some pair's KV cannot reach it faster (seed rule), or always
            # under conditional disaggregation, where the SLO objective decides
            need_local = colocated or dws.view.stage is Stage.BOTH or not pcands or local_always
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
                    if xfer > recompute_ms:
                        need_local = True
                        continue
                    o = Option(
                        p, d, Mode.TRANSFER, xfer, recompute_ms, conv, ahead + xfer, terms[3]
                    )
                    pair_score(o, xfer, ctx, wp, wd)
                    options.append(o)
            if need_local:
                local = self._local(d, ctx, faces.get(id(dws)))
                if colocated:
                    local.mode = Mode.SAME_POOL
                pair_score(local, _handoff_cost(local), ctx, wp, wd)
                options.append(local)
            if slo is not None and len(options) > first:
                _apply_slo(options, first, d, ctx, slo)
        return options

    def _independent(
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
            local = self._local(d, ctx)
            option = local
            xfer: float | None = _handoff_cost(local)
            if p_best is not None and p_best.ws is not d.ws:
                terms = fleet.handoff_terms(p_best.ws, d.ws)
                if terms is not None:
                    kv = (prompt - d.cached_tokens) * p_best.ws.cap.kv_bytes_per_token
                    conv = kv * terms[2]
                    t = kv * terms[0] + terms[1] + conv
                    ttft = p_best.wait_ms + p_best.run_ms + t
                    if t <= local.recompute_ms:
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

    # -- results ----------------------------------------------------------------------------

    def _plan_of(self, o: Option, request: Request, need: ResourceNeed) -> RoutePlan:
        p, d = o.p, o.d
        transfer = o.mode is Mode.TRANSFER
        return RoutePlan(
            resource_need=need,
            mode=o.mode,
            prefill_worker_id=p.ws.worker_id,
            prefill_pool_id=p.ws.pool_id,
            prefill_endpoint=p.ws.view.endpoint,
            decode_worker_id=d.ws.worker_id,
            decode_pool_id=d.ws.pool_id,
            decode_endpoint=d.ws.view.endpoint,
            decode_kv_bytes=d.kv_need,
            prefill_tokens=request.prompt_tokens - p.cached_tokens,
            cached_tokens=p.cached_tokens,
            estimates=Estimates(
                kv_bytes=(request.prompt_tokens - d.cached_tokens) * p.ws.cap.kv_bytes_per_token,
                transfer_ms=o.transfer_ms if transfer else None,
                recompute_ms=o.recompute_ms,
                conversion_ms=o.conversion_ms,
                prefill_wait_ms=p.wait_ms,
                prefill_ms=p.run_ms,
                ttft_ms=o.ttft_ms,
                tpot_ms=d.step_ms,
            ),
        )

    def _chain(self, chosen: Option, rest: list[Option], tier: Tier) -> tuple[FallbackStep, ...]:
        limit = self.profile.chain_length
        steps: list[FallbackStep] = []
        if limit <= 0:
            return ()
        used = {chosen.d.ws.worker_id}
        if chosen.mode is Mode.TRANSFER:
            d = chosen.d
            recompute_ttft = d.wait_ms + chosen.recompute_ms
            est = chosen.ttft_ms + recompute_ttft
            steps.append(
                FallbackStep(
                    Mode.RECOMPUTE,
                    d.ws.worker_id,
                    d.ws.worker_id,
                    d.ws.pool_id,
                    "kv_transfer_failed",
                    est,
                    tier.ttft_ms - est,
                )
            )
        have_shared = False
        for o in rest:
            if len(steps) >= limit:
                break
            wid = o.d.ws.worker_id
            if wid in used:
                continue
            used.add(wid)
            if o.mode is Mode.SAME_POOL and not have_shared and chosen.mode is not Mode.SAME_POOL:
                reason = "shared_pool"
                have_shared = True
            elif o.d.ws.pool_id != chosen.d.ws.pool_id:
                reason = "next_pool"
            else:
                reason = "next_best_pair"
            steps.append(
                FallbackStep(
                    o.mode,
                    o.p.ws.worker_id,
                    wid,
                    o.d.ws.pool_id,
                    reason,
                    o.ttft_ms,
                    tier.ttft_ms - o.ttft_ms,
                )
            )
        return tuple(steps[:limit])

    @staticmethod
    def _retry_ms(tier: Tier) -> float:
        """Suggested retry delay for a refusal: the tier's queue budget."""
        return tier.queue_budget_ms

    @staticmethod
    def _reject(
        request: Request,
        need: ResourceNeed,
        action: ServingAction,
        reasons: tuple[str, ...],
        cls: str,
        retry: float | None,
        record: DecisionRecord,
    ) -> Decision:
        return Decision(
            request_id=request.request_id,
            kind=DecisionKind.REJECT,
            resource_need=need,
            action=action,
            plan=None,
            fallbacks=(),
            reject_reasons=reasons,
            reject_class=cls,
            retry_after_ms=retry,
            record=record,
        )


def _apply_slo(
    options: list[Option],
    first: int,
    d: Candidate,
    ctx: RequestContext,
    slo: SloObjective,
) -> None:
    """The SLO objective (``config.SloObjective``) on the options ``options[first:]``, which
    all decode on ``d``: add the decode admission wait to each TTFT estimate, then
    ``score = ((1 - s) score + s T / (T + ttft) + targets kept) / 3``.

    The admission wait overlaps the prefill for a transfer (the decode worker frees slots
    while the prefill worker works): ``ttft = wait_p + prefill + max(0, admit - wait_p -
    prefill) + hand-off``. A local prefill (RECOMPUTE, SAME_POOL) starts only once admitted:
    ``ttft = admit + wait + prefill``."""
    tier = ctx.tier
    req = ctx.request
    admit = d.ws.admission_wait_ms(d.kv_need, float(max(req.expected_output_tokens, 16)))
    target = tier.ttft_ms
    ttft_limit = target * slo.ttft_fraction
    tpot_limit = tier.tpot_ms * slo.tpot_fraction
    tpot_ok = 1.0 if d.step_ms <= tpot_limit else 0.0
    steps = float(max(req.expected_output_tokens, 1))
    s = slo.slack_weight
    for i in range(first, len(options)):
        o = options[i]
        kept_tpot = tpot_ok
        pws = o.p.ws
        if slo.conditional and pws.batch and (pws is d.ws or pws.view.stage is Stage.BOTH):
            # a prefill on a worker that is decoding (a local prefill, or a transfer's on a
            # worker serving both stages; a prefill worker's batch is prefills, which this
            # one only queues behind) stalls its running batch: the sequences there wait
            # for the prefill queued on it and this prompt's, spread over a sequence's decode
            # steps (this request's output stands for theirs); an option that would push
            # their TPOT past the target does not keep it. (The prefill queued on the decode
            # side was tried as a stall on a transfer too: on the suite it cost the
            # slow-link cells up to 27 % of goodput and was left out.)
            step = d.step_ms if pws is d.ws else pws.step_ms()
            if step + (o.p.wait_ms + o.p.run_ms) / steps > tpot_limit:
                kept_tpot = 0.0
        if admit > 0:
            if o.mode is Mode.TRANSFER:
                ahead = o.p.wait_ms + o.p.run_ms
                o.ttft_ms += max(0.0, admit - ahead)
            else:
                o.ttft_ms += admit
        kept = kept_tpot + (1.0 if o.ttft_ms <= ttft_limit else 0.0)
        slack = target / (target + max(o.ttft_ms, 0.0))
        o.score = ((1.0 - s) * o.score + s * slack + kept) / 3.0


ADMISSION_RETRY_FLOOR_MS = 100.0
"""The shortest retry delay an admission refusal suggests (gRPC carries milliseconds; the
gateway's HTTP Retry-After rounds up to whole seconds)."""


def _admission_retry_ms(best_ttft_ms: float, limit_ms: float, most_ms: float) -> float:
    """The retry delay of an admission refusal: how far the best option's predicted TTFT is
    past the limit, i.e. how long the work queued ahead of this request must drain before a
    request like it fits (with no new arrivals), at least ``ADMISSION_RETRY_FLOOR_MS`` and at
    most ``most_ms`` (the tier's queue budget, the delay every other refusal suggests). The
    fixed queue budget told every refused client of the batch tier to stay away 20 s, however
    close to the limit its request was: three such refusals cut a real-engine benchmark's
    throughput at 8 in flight to 0.36 of the peer's (bench/README.md, gateway.py)."""
    return min(most_ms, max(ADMISSION_RETRY_FLOOR_MS, best_ttft_ms - limit_ms))


def _own_ms(o: Option) -> float:
    """The part of an option's TTFT estimate that is the request's own work, not waiting:
    its prefill and, for a transfer, the hand-off."""
    return o.p.run_ms + (o.transfer_ms if o.mode is Mode.TRANSFER else 0.0)


def _handoff_cost(o: Option) -> float:
    """What the hand-off costs, in ms, for the link scorers: the transfer (with conversion)
    for TRANSFER, the decode worker's recompute for RECOMPUTE (it pays that instead of a
    transfer), nothing for SAME_POOL."""
    if o.mode is Mode.TRANSFER:
        return o.transfer_ms
    if o.mode is Mode.RECOMPUTE:
        return o.recompute_ms
    return 0.0


def apply_reservations(fleet: Fleet, decision: Decision) -> None:
    """Count a decision's reservations in the snapshot (decode KV + a slot, prefill tokens)
    until released with :func:`release_reservations`. No-op for a reject."""
    plan = decision.plan
    if plan is None:
        return
    fleet.reserve(plan.decode_worker_id, kv_bytes=plan.decode_kv_bytes)
    if plan.mode is Mode.TRANSFER:
        fleet.reserve(plan.prefill_worker_id, prefill_tokens=plan.prefill_tokens)
    else:
        fleet.reserve(plan.decode_worker_id, prefill_tokens=plan.prefill_tokens, requests=0)


def release_reservations(fleet: Fleet, decision: Decision) -> None:
    """Undo :func:`apply_reservations`."""
    plan = decision.plan
    if plan is None:
        return
    fleet.release(plan.decode_worker_id, kv_bytes=plan.decode_kv_bytes)
    if plan.mode is Mode.TRANSFER:
        fleet.release(plan.prefill_worker_id, prefill_tokens=plan.prefill_tokens)
    else:
        fleet.release(plan.decode_worker_id, prefill_tokens=plan.prefill_tokens, requests=0)
