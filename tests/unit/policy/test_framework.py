"""The framework: plugin registry, profiles from YAML, config errors naming the key path."""

from __future__ import annotations

import ast
import pickle
import random
from dataclasses import replace
from typing import Any, ClassVar

import grpc
import pytest
import yaml

from hpd_common import native
from hpd_common.rpc import status_for
from hpd_scheduler.policy import (
    REGISTRY,
    ConfigError,
    Fleet,
    Planner,
    PluginRegistry,
    ResourceNeed,
    Role,
    Scorer,
    Stage,
    builtin_profile,
    builtin_profile_names,
    load_profile,
    parse_profile,
)
from hpd_scheduler.policy.errors import InvalidInputError, UnknownPluginError
from hpd_scheduler.policy.framework import Candidate, RequestContext
from hpd_scheduler.policy.plugins import DecodeMemoryFilter, MaxScorePicker

from .builders import MODEL, NOW, request, worker

BASE = """
profile: t
plugins:
  - {name: gate, type: execution-gate-filter}
  - {name: mem, type: decode-memory-filter, params: {headroom: 1.5}}
  - {name: load, type: work-load-scorer}
  - {name: itl, type: tier-itl-scorer}
  - {name: best, type: max-score-picker}
picker: best
prefill: {filters: [gate], scorers: [{plugin: load, weight: 1.0}]}
decode: {filters: [gate, mem], scorers: [{plugin: itl, weight: 0.5}, {plugin: load, weight: 0.5}]}
"""


def _doc() -> dict[str, Any]:
    doc = yaml.safe_load(BASE)
    assert isinstance(doc, dict)
    return doc


def test_minimal_profile_loads_with_params() -> None:
    prof = load_profile(BASE)
    assert prof.name == "t"
    assert prof.decode.weights() == {"itl": 0.5, "load": 0.5}
    mem = prof.decode.filters[1]
    assert isinstance(mem, DecodeMemoryFilter)
    assert mem.params.headroom == 1.5
    assert isinstance(prof.picker, MaxScorePicker)


def _mutate(path: list[Any], value: Any) -> dict[str, Any]:
    doc = _doc()
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "key_path"),
    [
        pytest.param(
            ["plugins", 2, "type"], "no-such-scorer", "plugins[2].type", id="unknown-type"
        ),
        pytest.param(["plugins", 1, "name"], "gate", "plugins[1].name", id="duplicate-name"),
        pytest.param(
            ["decode", "filters", 1], "missing", "decode.filters[1]", id="dangling-filter"
        ),
        pytest.param(
            ["decode", "scorers", 1, "plugin"],
            "nope",
            "decode.scorers[1].plugin",
            id="dangling-scorer",
        ),
        pytest.param(
            ["decode", "scorers", 0, "weight"], 0, "decode.scorers[0].weight", id="zero-weight"
        ),
        pytest.param(
            ["decode", "scorers", 0, "weight"],
            -0.5,
            "decode.scorers[0].weight",
            id="negative-weight",
        ),
        pytest.param(["picker"], _DELETE, "picker", id="no-picker"),
        pytest.param(["picker"], "gate", "picker", id="picker-wrong-kind"),
        pytest.param(
            ["plugins", 1, "params", "headroom"],
            0.5,
            "plugins[1].params.headroom",
            id="param-out-of-range",
        ),
        pytest.param(
            ["plugins", 1, "params", "headroom"],
            "big",
            "plugins[1].params.headroom",
            id="param-wrong-type",
        ),
        pytest.param(
            ["plugins", 1, "params", "bogus"], 1, "plugins[1].params.bogus", id="unknown-param"
        ),
        pytest.param(
            ["prefill", "scorers", 0, "plugin"],
            "itl",
            "prefill.scorers[0].plugin",
            id="decode-only-scorer-on-prefill",
        ),
        pytest.param(["pairing"], "sideways", "pairing", id="bad-pairing"),
        pytest.param(["surprise"], 1, "surprise", id="unknown-top-level-key"),
        pytest.param(["prefill", "scorers"], [], "prefill.scorers", id="no-scorers"),
    ],
)
def test_bad_config_names_the_key(path: list[Any], value: Any, key_path: str) -> None:
    doc = _mutate(path, value)
    with pytest.raises(ConfigError) as info:
        parse_profile(doc)
    assert info.value.key_path == key_path
    assert isinstance(info.value, ValueError)


def test_bad_tier_names_the_key() -> None:
    doc = _doc()
    doc["tiers"] = {"classes": {"gold": {"ttft_ms": 0, "tpot_ms": 10, "queue_budget_ms": 10}}}
    with pytest.raises(ConfigError) as info:
        parse_profile(doc)
    assert info.value.key_path == "tiers.classes.gold.ttft_ms"


@pytest.mark.parametrize(
    "err",
    [
        ConfigError("slo_objective.admit_ttft_factor", "must be 0 (off) or in (0, 4]"),
        UnknownPluginError("plugins[0].type", "no plugin 'gat'"),
        InvalidInputError("prompt_tokens", "must be > 0"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_policy_errors_survive_a_pickle_round_trip(err: ConfigError | InvalidInputError) -> None:
    """The suite runs cells in worker processes, which send their errors back pickled: a bad
    profile must arrive as itself, naming its key, not as a TypeError from the unpickler."""
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert vars(back) == vars(err)


@pytest.mark.parametrize(
    "err",
    [
        ConfigError("slo_objective.admit_ttft_factor", "must be 0 (off) or in (0, 4]"),
        InvalidInputError("prompt_tokens", "must be > 0"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_policy_errors_reach_the_edge_as_invalid_argument_naming_the_field(
    err: ConfigError | InvalidInputError,
) -> None:
    """The one translator (``rpc.status_for``) answers a policy error INVALID_ARGUMENT with
    its field in the trailers, with no translation by hand on the way."""
    code, message, trailers = status_for(err)
    field = err.key_path if isinstance(err, ConfigError) else err.field
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert message == str(err) and dict(trailers)["hpd-field"] == field


def test_invalid_yaml_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        load_profile("profile: [unclosed\n")


def test_registry_refuses_duplicates_and_bad_names() -> None:
    reg = PluginRegistry()

    class A(Scorer):
        type_name: ClassVar[str] = "a-scorer"

    class B(Scorer):
        type_name: ClassVar[str] = "a-scorer"

    class C(Scorer):
        type_name: ClassVar[str] = "NotKebab"

    reg.register(A)
    with pytest.raises(ConfigError, match="duplicate"):
        reg.register(B)
    with pytest.raises(ConfigError, match="kebab"):
        reg.register(C)
    assert reg.names() == ["a-scorer"]


def test_every_builtin_type_is_kebab_case_and_documented() -> None:
    # docstrings read from the source: a compiled class (hpd_common.native) keeps none
    documented: set[tuple[str, str]] = set()
    for module in {REGISTRY.get(n, "t").__module__ for n in REGISTRY.names()}:
        tree = ast.parse(native.source_of(module).read_text())
        documented |= {
            (module, node.name)
            for node in tree.body
            if isinstance(node, ast.ClassDef) and ast.get_docstring(node)
        }
    for name in REGISTRY.names():
        cls = REGISTRY.get(name, "t")
        assert (cls.__module__, cls.__name__) in documented, name
        assert name.endswith(("-filter", "-scorer", "-picker")), name


@pytest.mark.parametrize("name", builtin_profile_names())
def test_builtin_profiles_load_and_plan(name: str) -> None:
    prof = builtin_profile(name)
    assert prof.name == name
    fleet = Fleet.build(
        [
            worker("p", Stage.PREFILL),
            worker("d", Stage.DECODE),
            worker("b", Stage.BOTH),
        ],
        NOW,
    )
    decision = Planner(prof).plan(request(), fleet, NOW, random.Random(0))
    assert decision.plan is not None


def test_unknown_builtin_profile() -> None:
    with pytest.raises(ConfigError):
        builtin_profile("nope")


def test_filter_reports_a_reason_per_dropped_worker() -> None:
    prof = builtin_profile("default")
    fleet = Fleet.build([worker("full", kv_free_gib=0.01), worker("roomy")], NOW)
    index = fleet.index("llama-3-8b", Role.DECODE)
    assert index is not None
    ctx = RequestContext(
        request(), prof.tier("standard"), ResourceNeed.PREFILL, NOW, fleet, None, index
    )
    mem = next(f for f in prof.decode.filters if isinstance(f, DecodeMemoryFilter))
    result = mem.filter(index.workers, Role.DECODE, ctx)
    assert [w.worker_id for w in result.kept] == ["roomy"]
    assert result.dropped == {"full": "insufficient_memory"}
    assert isinstance(Candidate(index.workers[0], Role.DECODE, request(), 1024).score, float)


def test_the_planner_filters_with_the_profiles_own_filter_objects() -> None:
    """Production's filter stage holds the very `Filter` instances the profile built (the
    ones tests call), and drops exactly what their chain drops, with the same reasons."""
    prof = builtin_profile("default")
    planner = Planner(prof)
    for role, side in ((Role.PREFILL, prof.prefill), (Role.DECODE, prof.decode)):
        assert planner.preselection.filters[role] == side.filters
        pairs = zip(planner.preselection.filters[role], side.filters, strict=True)
        assert all(a is b for a, b in pairs)
    fleet = Fleet.build(
        [
            worker("p", Stage.PREFILL),
            worker("full", kv_free_gib=0.01),
            worker("roomy"),
            worker("stale", reported_at=1.0),
        ],
        NOW,
    )
    index = fleet.index("llama-3-8b", Role.DECODE)
    assert index is not None
    ctx = RequestContext(
        request(), prof.tier("standard"), ResourceNeed.PREFILL, NOW, fleet, None, index
    )
    chain = planner.preselection.filter(index.workers, Role.DECODE, ctx)
    # the chain, filter by filter, as a test applies each one
    expected_kept = list(index.workers)
    expected_dropped: dict[str, str] = {}
    for f in prof.decode.filters:
        step = f.filter(expected_kept, Role.DECODE, ctx)
        expected_kept = step.kept
        expected_dropped.update(step.dropped)
    assert [w.worker_id for w in chain.kept] == [w.worker_id for w in expected_kept]
    assert chain.dropped == expected_dropped and "full" in chain.dropped
    # and a plan over the same fleet records those drops and picks among the kept
    decision = planner.plan(request(), fleet, NOW, random.Random(0))
    recorded = {w: r for w, _pool, r in decision.record.rejected_workers}
    assert {w: r for w, r in recorded.items() if w in chain.dropped} == chain.dropped
    assert decision.plan is not None and decision.plan.decode_worker_id in {
        w.worker_id for w in chain.kept
    }


def _baseline_fleet() -> Fleet:
    return Fleet.build(
        [worker("p", Stage.PREFILL, rack="r1")]
        + [worker(f"d{i}", rack="r1", queue=i) for i in range(4)]
        + [worker("l4-idle", rack="r1", gpu="L4", queue=0, kv_free_gib=39.0)],
        NOW,
    )


def test_round_robin_rotates_over_decode_workers() -> None:
    fleet = _baseline_fleet()
    planner = Planner(builtin_profile("round_robin"))
    chosen = []
    for i in range(5):
        d = planner.plan(request(rid=f"r{i}"), fleet, NOW, random.Random(i))
        assert d.plan is not None
        chosen.append(d.plan.decode_worker_id)
    assert sorted(chosen) == ["d0", "d1", "d2", "d3", "l4-idle"]


def test_random_profile_is_reproducible_per_seed() -> None:
    fleet = _baseline_fleet()
    planner = Planner(builtin_profile("random"))

    def run(seed: int) -> list[str]:
        rng = random.Random(seed)
        out = []
        for i in range(20):
            d = planner.plan(request(rid=f"r{i}"), fleet, NOW, rng)
            assert d.plan is not None
            out.append(d.plan.decode_worker_id)
        return out

    assert run(1) == run(1)
    assert len(set(run(1))) > 1


def test_least_loaded_is_capacity_blind() -> None:
    fleet = Fleet.build(
        [
            worker("p", Stage.PREFILL, rack="r1"),
            worker("h200", gpu="H200", queue=2, kv_free_gib=30.0, rack="r1"),
            worker("l4", gpu="L4", queue=0, kv_free_gib=30.0, rack="r1"),
        ],
        NOW,
    )
    blind = Planner(builtin_profile("least_loaded")).plan(request(), fleet, NOW, random.Random(0))
    ours = Planner(builtin_profile("default")).plan(request(), fleet, NOW, random.Random(0))
    assert blind.plan is not None and blind.plan.decode_worker_id == "l4"
    assert ours.plan is not None and ours.plan.decode_worker_id == "h200"


def test_colocated_profile_keeps_both_stages_on_one_worker() -> None:
    fleet = Fleet.build(
        [worker("p", Stage.PREFILL), worker("d", Stage.DECODE), worker("b", Stage.BOTH)], NOW
    )
    d = Planner(builtin_profile("colocated")).plan(request(), fleet, NOW, random.Random(0))
    assert d.plan is not None
    assert d.plan.mode.value == "same_pool"
    assert d.plan.prefill_worker_id == d.plan.decode_worker_id == "b"


def test_a_rebuild_reuses_capacity_only_for_unchanged_specs() -> None:
    """``Fleet.build(previous=...)``: a worker whose spec object is unchanged keeps its
    capacity, whatever its load now says; a changed spec (here another GPU) gets its own;
    the indexes match a build from scratch."""
    same = worker("same")
    assert same.load is not None
    loaded = replace(same, load=replace(same.load, batch_size=40), kv_available_bytes=1 << 30)
    assert loaded.spec is same.spec and loaded is not same
    old_view = worker("moved", gpu="H100-SXM")
    first = Fleet.build([same, old_view], NOW)
    new_view = worker("moved", gpu="L4")
    second = Fleet.build([loaded, new_view], NOW + 1, previous=first)
    scratch = Fleet.build([loaded, new_view], NOW + 1)
    assert second.by_id["same"].cap is first.by_id["same"].cap
    assert second.by_id["same"].cap == scratch.by_id["same"].cap
    assert second.by_id["same"].view is loaded  # the load is the new view's
    assert second.by_id["moved"].cap is not first.by_id["moved"].cap
    assert second.by_id["moved"].cap == scratch.by_id["moved"].cap
    assert second.by_id["moved"].cap != first.by_id["moved"].cap
    idx, ref = second.index(MODEL, Role.DECODE), scratch.index(MODEL, Role.DECODE)
    assert idx is not None and ref is not None
    assert [w.worker_id for w in idx.workers] == [w.worker_id for w in ref.workers]
    assert idx.max_hbm_gbps == ref.max_hbm_gbps


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_candidate_estimates_equal_the_worker_state_formulas(role: Role) -> None:
    """``Candidate`` writes the worker's formulas out for speed: they must stay the same
    numbers as ``WorkerState.prefill_wait_ms / prefill_ms / step_ms``, reservations
    included."""
    fleet = Fleet.build(
        [worker("w", Stage.BOTH, queue=3, batch=5, itl_p50_ms=30.0, prefill_tps=9000.0)], NOW
    )
    fleet.reserve("w", kv_bytes=1 << 20, prefill_tokens=700, requests=2)
    ws = fleet.by_id["w"]
    req = request(1500, 300)
    c = Candidate(ws, role, req, fleet.ref_tokens)
    assert c.wait_ms == pytest.approx(ws.prefill_wait_ms(), rel=1e-12)
    assert c.run_ms == pytest.approx(ws.prefill_ms(1500), rel=1e-12)
    assert c.kv_need == 1800 * ws.cap.kv_bytes_per_token
    if role is Role.DECODE:
        extra = ws.queue_depth() * fleet.ref_tokens + 1500 + 300 * 0.5
        assert c.step_ms == pytest.approx(ws.step_ms(extra), rel=1e-12)
    else:
        assert c.step_ms == 0.0
    short = Candidate(ws, role, request(1), fleet.ref_tokens)
    assert short.run_ms == pytest.approx(ws.prefill_ms(1), rel=1e-12)  # the floor


def test_joint_options_share_one_empty_factor_dict_that_stays_empty() -> None:
    """Options of the joint pairing share one empty ``factors`` dict (their factors live on
    their candidates); nothing may write into it."""
    from hpd_scheduler.policy import framework
    from hpd_scheduler.policy.synthetic import synthetic_fleet

    rng = random.Random(3)
    fleet = Fleet.build(synthetic_fleet(64, rng, NOW), NOW)
    planner = Planner(builtin_profile("default"))
    for i in range(50):
        d = planner.plan(request(200 + 97 * i, 20 + 31 * i, rid=f"r{i}"), fleet, NOW, rng)
        d.record.encode()
    assert framework._NO_FACTORS == {}


def test_sorted_orders_follow_reservations_and_top_k_matches_a_full_sort() -> None:
    """Reservations and releases move a worker within every preselection order already
    built, so the orders hold live keys and ``top_k`` (which stops after the first k kept)
    returns what sorting every eligible worker by its live key returns."""
    from hpd_scheduler.policy.fleet import PRESELECT_KEYS, WorkerState
    from hpd_scheduler.policy.synthetic import synthetic_fleet

    rng = random.Random(11)
    fleet = Fleet.build(synthetic_fleet(96, rng, NOW), NOW)
    indexes = [i for i in fleet.indexes.values() if i.workers]
    for index in indexes:
        for key in PRESELECT_KEYS:
            fleet.sorted_workers(index, key)
    ids = [ws.worker_id for ws in fleet.states]
    for step in range(400):
        wid = rng.choice(ids)
        if step % 3 == 2:
            fleet.release(wid, kv_bytes=rng.randrange(1 << 30), prefill_tokens=500)
        else:
            fleet.reserve(wid, kv_bytes=rng.randrange(1 << 30), prefill_tokens=rng.randrange(4000))
    odd = {ws.worker_id for ws in fleet.states if ws.idx % 2}

    def drop(ws: WorkerState) -> str | None:
        return "odd" if ws.worker_id in odd else None

    for index in indexes:
        for key, (fn_p, fn_d) in PRESELECT_KEYS.items():
            fn = fn_p if index.role is Role.PREFILL else fn_d
            rows = index.sorted_by[key]
            assert [r[0] for r in rows] == [fn(r[2], fleet.ref_tokens) for r in rows]
            assert rows == sorted(rows, key=lambda r: (r[0], r[1]))
            want = sorted(
                (w for w in index.workers if drop(w) is None),
                key=lambda w: (fn(w, fleet.ref_tokens), w.idx),
            )[:4]
            kept, _, truncated = fleet.top_k(index, key, 4, drop, 1000)
            assert kept == want and not truncated
