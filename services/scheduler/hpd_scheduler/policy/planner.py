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

6. run the profile's option filters in order (``admission.py``; by default the tier's hard
   TTFT, then admission past capacity by TTFT and by TPOT, from the SLO objective's admit
   factors): each keeps the options within its limit, and one that keeps none refuses the
   request with its reason; rank the rest with the picker; apply the ladder: throttle
   (refuse tiers that may be throttled, with a retry delay), lower the batch cap
   (recorded; the service turns it into max-batch-size directives with
   ``balance.adapt_batch_size``), fall back to a shared pool (SAME_POOL
   options first, decision REROUTE), shed (refuse the lowest sheddable tier); build the
   fallback chain.

Work per request is O(k^2) scoring plus an O(k) walk of a sorted order: independent of fleet
size up to the scan bound.
"""

from __future__ import annotations

import random

from .admission import default_option_filters
from .config import Profile
from .decision import Decision, DecisionRecord, RejectClass
from .domain import DecisionKind, Mode, Request, ResourceNeed, Role, Tier
from .fleet import Fleet, ModelIndex
from .framework import Candidate, Option, OptionFilter, RequestContext
from .mechanisms import classify_need
from .pairing import Pairing
from .preselect import Preselection
from .results import fallback_chain, plan_of
from .serving import Action, Protects, ServingAction, select_action

__all__ = ["Planner"]

# what a reject's record names: no worker could run it at all, or none could now (the
# refusal protects the latency of what is already admitted)
_REJECT_INCAPABLE = ServingAction(Action.REJECT, Protects.NOTHING)
_REJECT_SATURATED = ServingAction(Action.REJECT, Protects.LATENCY)


class Planner:
    """Runs one :class:`~.config.Profile` through its stages: `preselection` (filter and
    score, `preselect.py`), `pairing` (options and their scores, `pairing.py`), then the
    option filters, the profile's picker and the serving-action ladder here. Holds only the
    round-robin cursors (in `preselection`: state the round-robin baseline needs);
    everything else comes in per call."""

    __slots__ = ("_weights", "option_filters", "pairing", "preselection", "profile")

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        filters = profile.option_filters
        self.option_filters: tuple[OptionFilter, ...] = (
            filters if filters is not None else default_option_filters(profile.slo_objective)
        )
        self.preselection = Preselection(profile)
        self.pairing = Pairing(profile, self.preselection)
        # every record shares these (records only read them)
        self._weights = (profile.prefill.weights(), profile.decode.weights())

    def pair_factors(self, o: Option, ctx: RequestContext) -> dict[str, float]:
        """The pairwise factor values of an option (`Pairing.pair_factors`)."""
        return self.pairing.pair_factors(o, ctx)

    # -- public -------------------------------------------------------------------------------

    def plan(self, request: Request, fleet: Fleet, now_s: float, rng: random.Random) -> Decision:
        """Decide where ``request`` runs. Raises :class:`~.errors.InvalidInputError` for a bad
        request or unknown tier; every other outcome (including reject) is a Decision.

        The stages, in order: filter and score each side's workers
        (`Preselection.candidates`: the profile's `Filter` plugins, then its
        pair-independent `Scorer` plugins); pair them (`Pairing.joint` or
        `Pairing.independent`); keep the options within the tier's TTFT limits
        (`_within_limits`); rank (the profile's `Picker`); apply the serving-action ladder
        (`_ladder_refusal`, `_shared_fallback`); honour a preferred pool (`_preferred`);
        turn the first option into the plan and the rest into its fallback chain."""
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
        record = self._new_record(tier, pressure, (wp, wd), didx)
        if didx is None or not didx.workers:
            return self._reject_no_worker(request, need, pidx is not None, didx, record)

        colocated = prof.pairing == "colocated"
        sides = self._candidates(pidx, didx, ctx, rng, record)
        if isinstance(sides, Decision):
            return sides
        pcands, dcands = sides
        if prof.pairing == "independent":
            options = self.pairing.independent(pcands, dcands, ctx, rng)
        else:
            options = self.pairing.joint(pcands, dcands, ctx, wp, wd, colocated)
        record.options = options
        if self.pairing.pairwise:
            record.explain = lambda o: self.pairing.pair_factors(o, ctx)

        kept = self._within_limits(options, ctx, need, record)
        if isinstance(kept, Decision):
            return kept
        # independent mode returns its options already in picker order
        ranked = kept if prof.pairing == "independent" else prof.picker.rank(kept, rng)

        best = ranked[0]
        action = select_action(pressure, best.p.wait_ms, tier.queue_budget_ms, prof.ladder)
        refused = self._ladder_refusal(action, request, need, tier, record)
        if refused is not None:
            return refused
        kind = DecisionKind.PRIMARY
        if action.took(Action.FALLBACK_TO_SHARED):
            kind, ranked = self._shared_fallback(ranked, didx, ctx, rng, record, (wp, wd))
        if request.preferred_pool:
            kind, ranked = self._preferred(request.preferred_pool, ranked, kind, record)

        chosen = ranked[0]
        plan = plan_of(chosen, request, need)
        chain = fallback_chain(chosen, ranked[1:], tier, self.profile.chain_length)
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

    def _new_record(
        self,
        tier: Tier,
        pressure: float,
        side_weights: tuple[float, float],
        didx: ModelIndex | None,
    ) -> DecisionRecord:
        """The decision's record, with the decode pools and workers the fleet's static
        gates dropped already."""
        record = DecisionRecord(
            profile=self.profile.name,
            tier=tier.name,
            memory_pressure=pressure,
            prefill_weights=self._weights[0],
            decode_weights=self._weights[1],
            side_weights=side_weights,
        )
        if didx is not None:
            record.rejected_pools.update(didx.rejected_pools())
            record.rejected_workers.extend(didx.static_drops[:64])
        return record

    def _candidates(
        self,
        pidx: ModelIndex | None,
        didx: ModelIndex,
        ctx: RequestContext,
        rng: random.Random,
        record: DecisionRecord,
    ) -> tuple[list[Candidate], list[Candidate]] | Decision:
        """Filter and score each side (prefill candidates, decode candidates), or the
        refusal when no decode worker is left."""
        prof = self.profile
        colocated = prof.pairing == "colocated"
        dcands = self.preselection.candidates(didx, Role.DECODE, ctx, rng, record, colocated)
        pcands: list[Candidate] = []
        if prof.pairing != "colocated" and pidx is not None and pidx.workers:
            pcands = self.preselection.candidates(pidx, Role.PREFILL, ctx, rng, record, False)
        record.decode_candidates = dcands
        record.prefill_candidates = pcands
        if not dcands:
            cls = RejectClass.SATURATED
            if colocated and not didx.shared:
                cls = RejectClass.NO_CAPABLE_WORKER
            return self._reject(
                ctx.request,
                ctx.need,
                _REJECT_INCAPABLE if cls == RejectClass.NO_CAPABLE_WORKER else _REJECT_SATURATED,
                ("no_executable_pool",),
                cls,
                self._retry_ms(ctx.tier),
                record,
            )
        return pcands, dcands

    def _reject_no_worker(
        self,
        request: Request,
        need: ResourceNeed,
        has_prefill: bool,
        didx: ModelIndex | None,
        record: DecisionRecord,
    ) -> Decision:
        """No decode worker can run the model: say what is missing (the model has no worker
        at all, or prefill workers only, or none executable)."""
        if didx is not None:
            reason = "no_executable_pool"
        elif has_prefill:
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

    def _within_limits(
        self,
        options: list[Option],
        ctx: RequestContext,
        need: ResourceNeed,
        record: DecisionRecord,
    ) -> list[Option] | Decision:
        """The options every option filter keeps, in the profile's order (``admission.py``:
        the tier's hard TTFT, then admission past capacity by TTFT and by TPOT), or the
        refusal with the first filter's reason that keeps none."""
        for f in self.option_filters:
            bound = f.bound(ctx)
            if bound is None:
                continue
            ok = f.keep(options, ctx, bound)
            if not ok:
                record.notes.append(f"all_options_exceed_{f.note}:{bound:g}")
                retry = f.retry_ms(options, bound, self._retry_ms(ctx.tier))
                return self._reject(
                    ctx.request,
                    need,
                    _REJECT_SATURATED,
                    (f.reject_reason,),
                    RejectClass.SATURATED,
                    retry,
                    record,
                )
            options = ok
        return options

    def _ladder_refusal(
        self,
        action: ServingAction,
        request: Request,
        need: ResourceNeed,
        tier: Tier,
        record: DecisionRecord,
    ) -> Decision | None:
        """The ladder's refusals, in order: shed (the lowest sheddable tier), throttle."""
        prof = self.profile
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
        return None

    def _shared_fallback(
        self,
        ranked: list[Option],
        didx: ModelIndex,
        ctx: RequestContext,
        rng: random.Random,
        record: DecisionRecord,
        side_weights: tuple[float, float],
    ) -> tuple[DecisionKind, list[Option]]:
        """The ladder's last rung: same-pool options first (found within the shared pool
        when none was among the top-k), a reroute when that changes the first choice."""
        prof = self.profile
        colocated = prof.pairing == "colocated"
        hard = ctx.tier.hard_ttft_ms
        kind = DecisionKind.PRIMARY
        shared = [o for o in ranked if o.mode is Mode.SAME_POOL]
        if not shared and didx.shared and not colocated:
            # the shared pool was not among the top-k: preselect within it (bounded)
            scands = self.preselection.candidates(didx, Role.DECODE, ctx, rng, record, True, False)
            extra = self.pairing.joint([], scands, ctx, side_weights[0], side_weights[1], True)
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
        return kind, ranked

    @staticmethod
    def _preferred(
        pool: str, ranked: list[Option], kind: DecisionKind, record: DecisionRecord
    ) -> tuple[DecisionKind, list[Option]]:
        """The request's preferred pool first; a reroute (with the pool's reasons in the
        record) when no option is in it."""
        preferred = [o for o in ranked if o.d.ws.pool_id == pool]
        if preferred:
            return kind, preferred + [o for o in ranked if o.d.ws.pool_id != pool]
        reasons = record.rejected_pools.get(pool)
        if reasons is None:
            drops = {r for w, p, r in record.rejected_workers if p == pool}
            reasons = tuple(sorted(drops)) or ("not_selected",)
            record.rejected_pools[pool] = reasons
        return DecisionKind.REROUTE, ranked

    # -- stages -------------------------------------------------------------------------------

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
