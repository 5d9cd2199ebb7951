"""Properties of the policy core (hypothesis): filters never add, pickers return subsets,
scores stay in [0, 1], unschedulable workers are never chosen, KV incompatibility alone never
drops a pool, rejects only when nothing can execute, and determinism."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hpd_common.kvformat import GIB as GIB_BYTES
from hpd_common.kvformat import KvDtype, KvLayout, negotiate
from hpd_scheduler.policy import (
    SCHEDULABLE_HEALTH,
    DecisionKind,
    Fleet,
    Health,
    LinkModel,
    Mode,
    Planner,
    RejectClass,
    ResourceNeed,
    Role,
    Stage,
    builtin_profile,
)
from hpd_scheduler.policy.fleet import kv_can_flow
from hpd_scheduler.policy.framework import Candidate, Option, RequestContext
from hpd_scheduler.policy.plugins import REGISTRY

from .builders import MODEL, NOW, request, worker

PROFILES = {
    name: builtin_profile(name)
    for name in ("default", "seed", "least_loaded", "round_robin", "random", "colocated")
}

worker_st = st.builds(
    lambda i, stage, gpu, tp, dtype, layout, free, queue, batch, age, health, zone, itl: worker(
        f"w{i}",
        stage,
        gpu=gpu,
        tp=tp,
        dtype=dtype,
        layout=layout,
        kv_total_gib=40.0,
        kv_free_gib=free,
        queue=queue,
        batch=batch,
        reported_at=NOW - age,
        health=health,
        zone=zone,
        rack=f"r{i % 3}",
        itl_p50_ms=itl,
        pool=f"{stage.value}-{gpu}-{i % 2}",
    ),
    st.integers(0, 10_000),
    st.sampled_from(list(Stage)),
    st.sampled_from(["H100-SXM", "A100-80G", "L40S", "L4", "H200"]),
    st.sampled_from([1, 2]),
    st.sampled_from([KvDtype.BF16, KvDtype.FP8_E4M3]),
    st.sampled_from([KvLayout.PAGED_NHD, KvLayout.PAGED_HND]),
    st.floats(0.0, 40.0),
    st.integers(0, 80),
    st.integers(0, 300),
    st.floats(0.0, 40.0),
    st.sampled_from(list(Health)),
    st.sampled_from(["z1", "z2"]),
    st.floats(0.0, 150.0),
)


def unique(views: list) -> list:  # type: ignore[type-arg]
    seen: dict[str, object] = {}
    for v in views:
        seen.setdefault(v.worker_id, v)
    return list(seen.values())


fleet_st = st.lists(worker_st, min_size=0, max_size=14).map(unique)
request_st = st.builds(
    lambda prompt, output, tier: request(prompt=prompt, output=output, tier=tier),
    st.integers(1, 40_000),
    st.integers(0, 4_000),
    st.sampled_from(["interactive", "standard", "batch"]),
)


@settings(max_examples=60, deadline=None)
@given(
    views=fleet_st, req=request_st, name=st.sampled_from(sorted(PROFILES)), seed=st.integers(0, 99)
)
def test_decisions_are_safe_and_deterministic(views: list, req, name: str, seed: int) -> None:  # type: ignore[no-untyped-def,type-arg]
    profile = PROFILES[name]
    fleet = Fleet.build(views, NOW)
    a = Planner(profile).plan(req, fleet, NOW, random.Random(seed))
    b = Planner(profile).plan(req, Fleet.build(views, NOW), NOW, random.Random(seed))
    assert a.to_dict() == b.to_dict()

    by_id = {v.worker_id: v for v in views}
    if a.plan is not None:
        for wid in (a.plan.prefill_worker_id, a.plan.decode_worker_id):
            assert by_id[wid].health in SCHEDULABLE_HEALTH
        assert by_id[a.plan.decode_worker_id].stage.serves(Role.DECODE)
        for step in a.fallbacks:
            assert by_id[step.decode_worker_id].health in SCHEDULABLE_HEALTH
    for c in [*a.record.prefill_candidates, *a.record.decode_candidates]:
        assert all(0.0 <= v <= 1.0 for v in c.factors.values()), c.factors
    for o in a.record.options:
        assert -1e-9 <= o.score <= 1.0 + 1e-9

    if a.kind is DecisionKind.REJECT and a.reject_class not in (
        RejectClass.THROTTLED,
        RejectClass.SHED,
    ):
        # nothing could execute: every decode-capable, schedulable worker failed a gate
        executable = (
            [
                ws
                for ws in fleet.index(MODEL, Role.DECODE).workers  # type: ignore[union-attr]
                if ws.available_kv()
                >= 1.2
                * (req.prompt_tokens + req.expected_output_tokens)
                * ws.cap.kv_bytes_per_token
                and (ws.reported_at_s is None or NOW - ws.reported_at_s <= 30.0)
                and (ws.view.load is None or ws.queue_depth() < ws.view.load.queue_max)
                and (name != "colocated" or ws.view.stage is Stage.BOTH)
            ]
            if fleet.index(MODEL, Role.DECODE) is not None
            else []
        )
        # (or the tier's limits refused it: hard TTFT, or admission past capacity by TTFT or
        # TPOT)
        past = {"exceeds_hard_ttft", "ttft_over_admission_limit", "tpot_over_admission_limit"}
        if not past & set(a.reject_reasons):
            assert executable == []


@settings(max_examples=40, deadline=None)
@given(views=fleet_st, req=request_st)
def test_kv_incompatibility_alone_never_drops_a_worker(views: list, req) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Making every decode worker's KV format incompatible with every prefill worker may
    change modes but never turns a plan into a reject."""
    fleet = Fleet.build(views, NOW)
    base = Planner(PROFILES["default"]).plan(req, fleet, NOW, random.Random(0))
    flipped = [
        v
        if v.stage is Stage.PREFILL
        else worker(
            v.worker_id,
            v.stage,
            pool=v.pool_id,
            gpu=v.gpu_type,
            tp=v.tp_size,
            dtype=KvDtype.FP8_E5M2,
            kv_total_gib=v.kv_memory_total_bytes / (1 << 30),
            kv_free_gib=v.kv_available_bytes / (1 << 30),
            queue=v.load.queue_depth if v.load else 0,
            batch=v.load.batch_size if v.load else 0,
            reported_at=v.load.reported_at_s if v.load else None,
            health=v.health,
            zone=v.network.zone,
            rack=v.network.rack,
        )
        for v in views
    ]
    other = Planner(PROFILES["default"]).plan(req, Fleet.build(flipped, NOW), NOW, random.Random(0))
    if base.kind is not DecisionKind.REJECT:
        # same health, memory (fp8 only lowers the need), queues and pressure: only the
        # tier's limits (hard TTFT, admission by TTFT or TPOT) may now refuse, when
        # recomputing is too slow or its stall too long for the running batch
        assert other.kind is not DecisionKind.REJECT or other.reject_reasons in (
            ("exceeds_hard_ttft",),
            ("ttft_over_admission_limit",),
            ("tpot_over_admission_limit",),
        )
    if other.plan is not None and other.plan.mode is Mode.TRANSFER:
        p = {v.worker_id: v for v in flipped}[other.plan.prefill_worker_id]
        assert p.kv_format.dtype is KvDtype.FP8_E5M2


@settings(max_examples=50, deadline=None)
@given(views=fleet_st, req=request_st, seed=st.integers(0, 9))
def test_filters_never_add_and_pickers_return_subsets(views: list, req, seed: int) -> None:  # type: ignore[no-untyped-def,type-arg]
    fleet = Fleet.build(views, NOW)
    profile = PROFILES["default"]
    for role in (Role.PREFILL, Role.DECODE):
        index = fleet.index(MODEL, role)
        if index is None:
            continue
        ctx = RequestContext(
            req,
            profile.tier(req.tier),
            ResourceNeed.SHARED,
            NOW,
            fleet,
            fleet.index(MODEL, Role.PREFILL),
            fleet.index(MODEL, Role.DECODE),
        )
        for name in REGISTRY.names():
            cls = REGISTRY.get(name, "t")
            if cls.kind != "filter":
                continue
            f = cls(name)
            result = f.filter(index.workers, role, ctx)  # type: ignore[attr-defined]
            ids = [w.worker_id for w in index.workers]
            kept = [w.worker_id for w in result.kept]
            assert set(kept) <= set(ids)
            assert kept == [i for i in ids if i in set(kept)]
            assert set(kept) | set(result.dropped) == set(ids)
            assert not set(kept) & set(result.dropped)
        cands = [Candidate(ws, role, req, 1024) for ws in index.workers]
        rng = random.Random(seed)
        for c in cands:
            c.score = rng.random()
        for name in REGISTRY.names():
            cls = REGISTRY.get(name, "t")
            if cls.kind != "picker":
                continue
            ranked = cls(name).rank(cands, random.Random(seed))  # type: ignore[attr-defined]
            assert len({id(c) for c in ranked}) == len(ranked)
            assert {id(c) for c in ranked} <= {id(c) for c in cands}
        if cands:
            opts = [Option(c, c, Mode.SAME_POOL, 0.0, 1.0, 0.0, 1.0) for c in cands]
            for o, c in zip(opts, cands, strict=True):
                o.score = c.score
            best = PROFILES["default"].picker.rank(opts, random.Random(0))
            assert best[0].score == max(o.score for o in opts)


@settings(max_examples=50, deadline=None)
@given(views=fleet_st, req=request_st)
def test_every_scorer_stays_in_unit_interval(views: list, req) -> None:  # type: ignore[no-untyped-def,type-arg]
    fleet = Fleet.build(views, NOW)
    profile = PROFILES["default"]
    ctx = RequestContext(
        req,
        profile.tier(req.tier),
        ResourceNeed.SHARED,
        NOW + 3.0,
        fleet,
        fleet.index(MODEL, Role.PREFILL),
        fleet.index(MODEL, Role.DECODE),
    )
    for ws in fleet.states:
        for role in (Role.PREFILL, Role.DECODE):
            c = Candidate(ws, role, req, 1024)
            for name in REGISTRY.names():
                cls = REGISTRY.get(name, "t")
                if cls.kind != "scorer" or role not in cls.roles:  # type: ignore[attr-defined]
                    continue
                scorer = cls(name)
                if scorer.pairwise:  # type: ignore[attr-defined]
                    for t in (None, 0.0, 3.5, 1e6):
                        v = scorer.score_pair(c, t, ctx)  # type: ignore[attr-defined]
                        assert 0.0 <= v <= 1.0, (name, v)
                else:
                    v = scorer.score(c, ctx)  # type: ignore[attr-defined]
                    assert 0.0 <= v <= 1.0, (name, v)


_place = st.tuples(
    st.sampled_from(["z1", "z2"]),
    st.sampled_from(["r1", "r2", ""]),
    st.sampled_from(["h1", "h2", ""]),
    st.sampled_from([25.0, 100.0, 400.0]),
    st.sampled_from([None, "producer", "consumer", "both", "none"]),
    st.sampled_from([KvDtype.BF16, KvDtype.FP8_E4M3]),
    st.sampled_from(["pa", "pb"]),
)


@given(places=st.lists(_place, min_size=2, max_size=8))
@settings(max_examples=60, deadline=None)
def test_handoff_terms_shared_by_link_class_equal_each_pairs_own(places: list) -> None:  # type: ignore[type-arg]
    """Hand-off terms are cached per pair of link classes (and carried to the next snapshot):
    for every pair they equal what the pair's own negotiation and link give, whatever the
    zones, racks, hosts, NICs, connector directions, KV formats and pool overrides."""
    links = LinkModel.from_dict({"pools": [{"src": "pa", "dst": "pb", "gbps": 7, "latency_ms": 3}]})
    views = [
        worker(
            f"w{i}", Stage.BOTH, pool=pool, zone=zone, rack=rack, host=host or "", nic_gbps=nic,
            dtype=dtype, labels={"kv-role": role} if role else {},
        )
        for i, (zone, rack, host, nic, role, dtype, pool) in enumerate(places)
    ]  # fmt: skip
    first = Fleet.build(views, NOW, links=links)
    second = Fleet.build(views, NOW + 1, links=links, previous=first)
    for fleet in (first, second, first):
        for a in fleet.states:
            for b in fleet.states:
                neg = negotiate(a.view.kv_format, b.view.kv_format, fleet.kv_policy)
                want = None
                if neg.transferable and kv_can_flow(a.view, b.view):
                    link = links.between(a.view, b.view)[1]
                    want = (
                        8.0 / (link.gbps * 1e6),
                        link.latency_ms,
                        neg.cost_ms_per_gib / GIB_BYTES,
                        tuple(str(r) for r in neg.reasons),
                    )
                assert fleet.handoff_terms(a, b) == want, (a.view.network, b.view.network)
