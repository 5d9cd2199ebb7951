"""Sanity of the simulator: exact service times, TTFT composition, Little's law, determinism."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from hpd_common import perfmodel
from hpd_common.gpus import gpu_profile
from hpd_scheduler.policy import builtin_profile
from hpd_sim import ClusterSpec, SimConfig, load_cluster, parse_cluster, simulate
from hpd_sim.traces import TraceRequest

MODEL = perfmodel.model_spec("llama-3-8b")
BPT = MODEL.kv_format().bytes_per_token()  # 131,072 B per token


def _cluster(links: dict[str, Any] | None = None, prefill_count: int = 1) -> ClusterSpec:
    return parse_cluster(
        {
            "name": "tiny",
            "model": "llama-3-8b",
            "pools": [
                {
                    "id": "p",
                    "gpu": "H100-SXM",
                    "count": prefill_count,
                    "stage": "prefill",
                    "zone": "a",
                    "rack": "r1",
                },
                {
                    "id": "d",
                    "gpu": "A100-80G",
                    "count": 1,
                    "stage": "decode",
                    "zone": "a",
                    "rack": "r2",
                },
            ],
            "links": links or {"classes": {"same_zone": {"gbps": 100, "latency_ms": 0.5}}},
        }
    )


def _xfer_s(tokens: int, gbps: float, latency_ms: float) -> float:
    return tokens * BPT * 8 / (gbps * 1e9) + latency_ms * 1e-3


def _decode_s(prompt: int, output: int, gpu: str = "A100-80G") -> float:
    g = gpu_profile(gpu)
    return (
        sum(perfmodel.decode_step_ms(MODEL, g, 1, 1, prompt + 1 + k) for k in range(output - 1))
        * 1e-3
    )


@pytest.mark.parametrize(
    ("prompt", "output"),
    [
        pytest.param(1000, 5, id="short"),
        pytest.param(3000, 40, id="longer"),
        pytest.param(17, 1, id="one-token"),
    ],
)
def test_one_request_alone_takes_exactly_the_performance_models_time(
    prompt: int, output: int
) -> None:
    reqs = [TraceRequest(2.0, prompt, output)]
    res = simulate(_cluster(), builtin_profile("default"), reqs)
    o = res.outcomes[0]
    prefill_s = perfmodel.prefill_ms(MODEL, gpu_profile("H100-SXM"), 1, prompt) * 1e-3
    ttft_s = prefill_s + _xfer_s(prompt, 100, 0.5)
    assert o.mode == "transfer"
    assert o.ttft_ms == pytest.approx(ttft_s * 1e3, rel=1e-9)
    assert o.finish_s - o.first_s == pytest.approx(_decode_s(prompt, output), rel=1e-9, abs=1e-12)


def test_low_load_ttft_is_prefill_plus_transfer_on_the_pair_chosen() -> None:
    cluster = load_cluster()
    rng = random.Random(7)
    reqs = [TraceRequest(30.0 * i, rng.randint(50, 6000), rng.randint(2, 30)) for i in range(12)]
    res = simulate(cluster, builtin_profile("least_loaded"), reqs)
    views = {v.worker_id: v for v in cluster.worker_views()}
    pools = {p.pool_id: p for p in cluster.pools}
    for o in res.outcomes:
        assert o.mode == "transfer"
        src, dst = views[o.prefill_worker], views[o.decode_worker]
        _, link = cluster.links.between(src, dst)
        gpu = pools[src.pool_id].gpu
        expect = perfmodel.prefill_ms(MODEL, gpu, 1, o.prompt_tokens) * 1e-3 + _xfer_s(
            o.prompt_tokens, link.gbps, link.latency_ms
        )
        assert o.ttft_ms == pytest.approx(expect * 1e3, rel=1e-9)


def test_concurrent_transfers_share_the_link_bandwidth() -> None:
    # two identical prompts prefilled side by side finish together; their KV then shares
    # one pipe, so each transfer takes twice its solo time
    reqs = [TraceRequest(1.0, 2000, 3), TraceRequest(1.0, 2000, 3)]
    res = simulate(_cluster(prefill_count=2), builtin_profile("default"), reqs)
    assert {o.prefill_worker for o in res.outcomes} == {"p-0", "p-1"}
    prefill_s = perfmodel.prefill_ms(MODEL, gpu_profile("H100-SXM"), 1, 2000) * 1e-3
    shared = 2 * 2000 * BPT * 8 / 100e9 + 0.5e-3
    for o in res.outcomes:
        assert o.ttft_ms == pytest.approx((prefill_s + shared) * 1e3, rel=1e-9)


def test_recompute_when_the_link_is_slower_than_the_decode_workers_prefill() -> None:
    links = {"pools": [{"src": "p", "dst": "d", "gbps": 0.01, "latency_ms": 1.0}]}
    res = simulate(_cluster(links), builtin_profile("default"), [TraceRequest(0.5, 1500, 4)])
    o = res.outcomes[0]
    assert o.mode == "recompute"
    assert o.prefill_worker == o.decode_worker == "d-0"
    expect = perfmodel.prefill_ms(MODEL, gpu_profile("A100-80G"), 1, 1500)
    assert o.ttft_ms == pytest.approx(expect, rel=1e-9)


def test_colocated_policy_runs_every_request_on_one_worker() -> None:
    rng = random.Random(3)
    reqs = [TraceRequest(0.2 * i, rng.randint(100, 2000), rng.randint(2, 50)) for i in range(60)]
    res = simulate(load_cluster(), builtin_profile("colocated"), reqs)
    assert res.modes == {"same_pool": 60}
    assert all(o.prefill_worker == o.decode_worker for o in res.outcomes)


def _poisson(rate: float, n: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, rng.randint(100, 3000), rng.randint(5, 300)))
    return out


def test_littles_law_holds_in_steady_state() -> None:
    reqs = _poisson(6.0, 2500, seed=11)
    res = simulate(load_cluster(), builtin_profile("default"), reqs)
    outs = [o for o in res.outcomes if not o.rejected]
    assert len(outs) == len(reqs)
    t1, t2 = reqs[-1].arrival_s * 0.25, reqs[-1].arrival_s * 0.75
    span = t2 - t1
    # L: time-average number in the system over the window
    area = sum(max(0.0, min(o.finish_s, t2) - max(o.arrival_s, t1)) for o in outs)
    mean_n = area / span
    inside = [o for o in outs if t1 <= o.arrival_s < t2]
    lam = len(inside) / span
    w = sum(o.latency_s for o in inside) / len(inside)
    assert mean_n == pytest.approx(lam * w, rel=0.05)


def test_same_seed_same_results_and_another_seed_differs() -> None:
    reqs = _poisson(20.0, 400, seed=5)
    cluster = load_cluster()

    def run(seed: int) -> list[tuple[str, float, float]]:
        res = simulate(cluster, builtin_profile("random"), reqs, SimConfig(seed=seed))
        return [(o.decode_worker, o.first_s, o.finish_s) for o in res.outcomes]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_report_interval_builds_the_fleet_once_per_tick() -> None:
    reqs = _poisson(50.0, 300, seed=2)
    fresh = simulate(load_cluster(), builtin_profile("default"), reqs)
    ticked = simulate(
        load_cluster(), builtin_profile("default"), reqs, SimConfig(report_interval_s=0.5)
    )
    assert fresh.fleet_builds == 300
    assert ticked.fleet_builds <= reqs[-1].arrival_s / 0.5 + 2
    assert all(not o.rejected for o in ticked.outcomes)


def test_kv_memory_fills_and_frees_and_the_policy_sees_it() -> None:
    # one decode worker with room for one long request: a second one arriving while the
    # first holds its KV is refused by the policy's memory gate (the pending reservation is
    # visible); a third arriving after the first finished is served
    doc = {
        "name": "small",
        "model": "llama-3-8b",
        "pools": [
            {"id": "p", "gpu": "H100-SXM", "count": 1, "stage": "prefill", "zone": "a"},
            {
                "id": "d",
                "gpu": "L40S",
                "count": 1,
                "stage": "decode",
                "zone": "a",
                "memory_fraction": 0.37,
            },
        ],
    }
    cluster = parse_cluster(doc)
    cap = cluster.worker_views()[1].kv_memory_total_bytes // BPT
    prompt = int(cap * 0.6)
    reqs = [
        TraceRequest(0.0, prompt, 20),
        TraceRequest(0.01, prompt, 20),
        TraceRequest(30.0, prompt, 20),
    ]
    res = simulate(cluster, builtin_profile("least_loaded"), reqs)
    first, second, third = res.outcomes
    assert not first.rejected and not third.rejected
    assert second.rejected and second.reject_reason == "no_executable_pool"
    assert third.first_s > first.finish_s


def test_the_load_report_carries_the_share_of_time_spent_prefilling() -> None:
    """One request: the prefill worker prefills from its arrival for ``prefill_s``, then
    idles; the decode worker only decodes. Each report's ``prefill_busy`` is that share,
    exponentially weighted over ``util_tau_s`` as ``gpu_util`` is."""
    from hpd_sim import Simulator

    prompt, arrival = 8000, 2.0
    sim = Simulator(_cluster(), builtin_profile("default"), [TraceRequest(arrival, prompt, 5)])
    sim.run()
    prefill, decode = sim.workers
    prefill_s = perfmodel.prefill_ms(MODEL, gpu_profile("H100-SXM"), 1, prompt) * 1e-3
    assert 0.1 < prefill_s < 1.0
    busy_at_end = 1.0 - math.exp(-prefill_s / 1.0)
    end = arrival + prefill_s
    assert sim.view_of(prefill, end).load.prefill_busy == pytest.approx(busy_at_end)  # type: ignore[union-attr]
    later = sim.view_of(prefill, end + 2.0).load
    assert later is not None and later.prefill_busy == pytest.approx(busy_at_end * math.exp(-2.0))
    assert sim.view_of(decode, end + 2.0).load.prefill_busy == 0.0  # type: ignore[union-attr]


def test_a_transfer_on_its_way_counts_on_its_decode_worker_as_the_service_counts_it() -> None:
    """While a request's prefill runs on the prefill worker, the snapshot the next decision
    sees counts it on its decode worker as one inbound transfer at the traffic's mean
    prompt (``Fleet.build(inbound_transfers=..)``), the figure the scheduler service takes
    from its own plans; once the KV is there it no longer does."""
    from hpd_scheduler.policy import Decision, Fleet, Mode, Request
    from hpd_sim import Simulator

    reqs = [TraceRequest(0.0, 8000, 5), TraceRequest(0.05, 500, 5), TraceRequest(5.0, 500, 5)]
    sim = Simulator(_cluster(), builtin_profile("default"), reqs)
    inner = sim.planner
    seen: list[tuple[float, Decision]] = []

    class Watch:
        def plan(self, req: Request, fleet: Fleet, now: float, rng: random.Random) -> Decision:
            d = fleet.worker(sim.workers[1].view.worker_id)
            assert d is not None
            seen.append((d.backlog_tokens / fleet.ref_tokens, inner.plan(req, fleet, now, rng)))
            return seen[-1][1]

    sim.planner = Watch()  # type: ignore[assignment]
    sim.run()
    first = seen[0][1].plan
    assert first is not None and first.mode is Mode.TRANSFER
    assert [round(inbound, 6) for inbound, _ in seen] == [0.0, 1.0, 0.0]


def test_the_prefills_planned_on_a_worker_count_by_their_own_prompt_tokens() -> None:
    """A worker's queued and running prefills that the planner put there count in the next
    snapshot by their true prompt tokens (``pending_prefill_tokens``, ``known_prefills``), as
    the scheduler service counts its own plans, not at the traffic's mean prompt: a 20,000-token
    prompt prefilling ahead of a request weighs 20,000 tokens in that request's decision
    however short the prompts seen so far are; once it is prefilled it weighs nothing."""
    from hpd_scheduler.policy import Decision, Fleet, Request
    from hpd_sim import Simulator

    reqs = [
        TraceRequest(0.0, 100, 5),
        TraceRequest(0.5, 100, 5),
        TraceRequest(1.0, 20000, 5),
        TraceRequest(1.01, 100, 5),
        TraceRequest(9.0, 100, 5),
    ]
    sim = Simulator(_cluster(), builtin_profile("default"), reqs)
    inner = sim.planner
    backlog: list[float] = []
    prefill_id = sim.workers[0].view.worker_id

    class Watch:
        def plan(self, req: Request, fleet: Fleet, now: float, rng: random.Random) -> Decision:
            p = fleet.worker(prefill_id)
            assert p is not None
            backlog.append(p.backlog_tokens + p.live_tokens)
            return inner.plan(req, fleet, now, rng)

    sim.planner = Watch()  # type: ignore[assignment]
    sim.run()
    long, behind = sim.outcomes[2], sim.outcomes[3]
    assert long.prefill_worker == prefill_id and long.mode == "transfer"
    assert backlog == [0.0, 0.0, 0.0, 20000.0, 0.0]
    # so the short prompt behind it prefills on its idle decode worker instead of queueing
    # behind 20,000 tokens (at the mean prompt seen, the prefill worker looked all but idle)
    assert behind.mode == "recompute" and behind.first_s < long.first_s
    assert all(w.planned_n == 0 and w.planned_tokens == 0 for w in sim.workers)
