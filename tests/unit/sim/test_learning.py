"""The simulator learns speeds the way the scheduler service does (hpd_sim.learning): a pool
whose engines run slower than they declare is planned at its measured speed once outcomes
come in, and serves fewer requests' prefills for it."""

from __future__ import annotations

import collections
from dataclasses import replace

from hpd_scheduler.policy import builtin_profile
from hpd_sim import SimConfig, attainment, parse_cluster, simulate
from hpd_sim.goodput import fluid_bound
from hpd_sim.suite import WORKLOADS, load_workload
from hpd_sim.traces import reshape

DEFAULT = builtin_profile("default")

CLUSTER = {
    "name": "one-slow-pool",
    "model": "llama-3-8b",
    "pools": [
        {"id": "fast-prefill", "gpu": "H100-SXM", "count": 2, "stage": "prefill", "zone": "a"},
        # declared alike, computes 4x slower and pays 40 ms per prefill (a throttled GPU)
        {"id": "slow-prefill", "gpu": "H100-SXM", "count": 2, "stage": "prefill", "zone": "a",
         "actual": {"prefill_scale": 4.0, "prefill_fixed_ms": 40.0}},
        {"id": "decode", "gpu": "H100-SXM", "count": 4, "stage": "decode", "zone": "a"},
    ],
}  # fmt: skip


def _run(learn: bool | None) -> tuple[float, collections.Counter[str], float]:
    cluster = parse_cluster(CLUSTER)
    w = next(x for x in WORKLOADS if x.name == "azure_conv")
    trace = load_workload(w, 1200)
    bound = fluid_bound(cluster, trace.requests, w.slo.tpot_ms).rps
    loaded = reshape(trace, rate_scale=0.6 * bound / trace.mean_rate)
    res = simulate(
        cluster, DEFAULT, loaded.requests, SimConfig(seed=0, tiers=((w.tier, 1.0),), learn=learn)
    )
    pools = collections.Counter(
        o.prefill_worker.rsplit("-", 1)[0] for o in res.outcomes if o.prefill_worker
    )
    ttfts = sorted(o.ttft_ms for o in res.outcomes if not o.rejected)
    return attainment(res.outcomes, w.slo), pools, ttfts[int(0.9 * (len(ttfts) - 1))]


def test_a_pool_slower_than_declared_is_learned_and_given_fewer_prefills() -> None:
    blind_att, blind_pools, blind_p90 = _run(learn=False)
    att, pools, p90 = _run(learn=None)  # on by default: a pool runs otherwise than declared
    # declared alike, the planner blind to the speeds gives the slow pool a share of the
    # prefills (its queue is all that tells it apart: measured 146 against 671)
    assert blind_pools["slow-prefill"] > 0.15 * blind_pools["fast-prefill"]
    # learned, the slow pool gets a fraction of that (measured 21) and the requests' TTFT
    # p90 falls (measured 167 -> 95 ms)
    assert pools["slow-prefill"] < 0.3 * blind_pools["slow-prefill"], (pools, blind_pools)
    assert p90 < 0.8 * blind_p90
    assert att >= blind_att


def test_a_cluster_may_describe_a_model_and_gpu_the_tables_do_not_know() -> None:
    """As ``hpd_fleet.fleet_sim`` writes a running fleet: the model by its numbers, the GPU by
    what the agents declare; the planner inside the simulator resolves them as it resolves
    an agent's registration (labels and spec figures), and requests are served."""
    doc = {
        "model": {"name": "tiny", "params_b": 0.003, "num_layers": 2, "num_kv_heads": 2,
                  "head_dim": 32, "hidden_size": 128},
        "pools": [{"id": "cpu", "gpu": {"name": "cpu-core", "peak_tflops": 0.5,
                   "hbm_gbps": 20, "hbm_gib": 1.2}, "stage": "both", "kv_connector": False,
                   "actual": {"prefill_fixed_ms": 15.0, "decode_scale": 20.0}}],
    }  # fmt: skip
    cluster = parse_cluster(doc)
    (view,) = cluster.worker_views()
    assert view.peak_tflops == 0.5 and view.hbm_gbps == 20
    assert view.labels["model-params"] == "3000000"
    w = next(x for x in WORKLOADS if x.name == "azure_conv")
    trace = load_workload(w, 50)
    small = [replace(r, prompt_tokens=min(r.prompt_tokens, 500), output_tokens=8)
             for r in trace.requests]  # fmt: skip
    res = simulate(cluster, DEFAULT, small, SimConfig(seed=0))
    done = [o for o in res.outcomes if not o.rejected]
    assert len(done) == len(small)
    assert min(o.ttft_ms for o in done) >= 15.0  # the fixed cost the pool really pays


def _cpu_pool(**extra: object) -> dict[str, object]:
    actual = {"prefill_fixed_ms": 100.0, "decode_scale": 20.0}
    actual.update(extra.pop("actual", {}))  # type: ignore[call-overload]
    return {"id": "cpu", "gpu": {"name": "cpu-core", "peak_tflops": 0.5, "hbm_gbps": 20,
            "hbm_gib": 1.2}, "stage": "both", "kv_connector": False, "actual": actual,
            **extra}  # fmt: skip


def _together(doc: dict[str, object], n: int) -> list[float]:
    from hpd_sim.traces import TraceRequest

    model = {"name": "tiny", "params_b": 0.003, "num_layers": 2, "num_kv_heads": 2,
             "head_dim": 32, "hidden_size": 128}  # fmt: skip
    cluster = parse_cluster({"model": model, **doc})
    reqs = [TraceRequest(0.0, 400, 4) for _ in range(n)]
    res = simulate(cluster, DEFAULT, reqs, SimConfig(seed=0, learn=False))
    assert not any(o.rejected for o in res.outcomes)
    return sorted(o.ttft_ms for o in res.outcomes)


def test_an_engine_that_batches_prefills_serves_queued_prompts_in_one_iteration() -> None:
    """``prefill_batch_tokens`` (vLLM's token budget a step): prompts that arrive together
    and fit share one prefill iteration, paying ``prefill_queue_share`` of the fixed cost
    each after the first; without it they go one an iteration."""
    serial = _together({"pools": [_cpu_pool()]}, 4)
    batched = _together(
        {"pools": [_cpu_pool(prefill_batch_tokens=2048, actual={"prefill_queue_share": 0.25})]},
        4,
    )
    # one at a time: the last waits for three fixed costs before its own
    assert serial[-1] >= 4 * 100.0
    # the first finds the engine idle and starts alone; the three queued behind it share
    # the next iteration: 100 ms + 2 x 25 ms of fixed cost, the same first token for all
    assert batched[0] == serial[0]
    assert batched[-1] - batched[1] < 1.0
    assert batched[1] >= batched[0] + 150.0
    assert batched[-1] < 0.7 * serial[-1]
    # a budget smaller than two prompts is one prompt an iteration again
    tight = _together({"pools": [_cpu_pool(prefill_batch_tokens=500)]}, 4)
    assert tight[-1] == serial[-1]


def test_a_decode_step_can_grow_with_each_sequence() -> None:
    """``decode_seq_ms``: every sequence in the batch adds to the step, as on an engine
    that computes its decode (a CPU engine) rather than reads it."""
    from hpd_sim.traces import TraceRequest

    model = {"name": "tiny", "params_b": 0.003, "num_layers": 2, "num_kv_heads": 2,
             "head_dim": 32, "hidden_size": 128}  # fmt: skip
    reqs = [TraceRequest(0.0, 100, 32) for _ in range(8)]
    tpots = []
    for seq in (0.0, 5.0):
        cluster = parse_cluster({"model": model, "pools": [
            _cpu_pool(actual={"prefill_fixed_ms": 1.0, "decode_seq_ms": seq})]})  # fmt: skip
        res = simulate(cluster, DEFAULT, reqs, SimConfig(seed=0, learn=False))
        tpots.append(max(o.tpot_ms for o in res.outcomes if not o.rejected))
    assert tpots[1] > tpots[0] + 5.0 * 4  # at least half the batch's sequences, 5 ms each
