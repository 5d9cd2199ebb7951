"""Scheduling quality: goodput of our policy against the baselines on the simulated cluster.

Workload: the full Azure LLM conversation trace (19,366 requests, one hour; Patel et al.,
"Splitwise", ISCA 2024, CC-BY 4.0), every request in the ``interactive`` tier.
Cluster: ``data/clusters/default.yaml`` (2 x H100 prefill + 2 x A100 decode in zone a,
1 x A100 prefill + 3 x L40S decode in zone b, a shared 25 Gb/s cross-zone link; Llama-3-8B).
SLOs: TTFT <= 1,000 ms and TPOT <= 50 ms per request (the interactive tier's targets).
Goodput (DistServe): the highest request rate at which >= 90 % of requests meet both SLOs,
found by bracketing and bisecting the trace's rate scale (``hpd_sim.goodput``).

Figures: goodput of ours (the default profile), least-loaded (capacity-blind), the seed
weights and the colocated baseline; their ratios; ours against the cluster's fluid capacity
bound; and the wall time of one full-trace simulation at the recorded rate (scale 1).

Prefix caching: the same cluster on Mooncake's whole synthetic long-context trace
(``data/traces/mooncake_synthetic.jsonl``: 3,993 requests, 12.9k-token prompts on average,
64 % of prompt blocks repeating an earlier one; Qin et al., FAST 2025, Apache-2.0), every
worker with a prefix cache of its KV memory (the simulator's model), SLOs TTFT <= 5,000 ms
and TPOT <= 100 ms (the targets ``hpd sim``'s help has used for this trace since it
shipped: long prompts take seconds to prefill). Ours against least-loaded and against
``prefix_only`` (the KV-aware routers' rule: longest cached prefix minus load):
``mooncake_goodput_vs_least_loaded`` and ``mooncake_goodput_vs_prefix_only``, with the
largest per-worker prefix index at the end of ours's run. ``--quick``: the first 1,500
requests.

    python bench/goodput.py            # full trace (several minutes)
    python bench/goodput.py --quick    # first 3,000 requests, coarser search (< 1 minute)
    python bench/goodput.py --json     # one JSON object

``--suite``: the scheduling-quality matrix instead (``hpd_sim.suite`` says what is in
it): goodput of ours, least_loaded, seed, colocated, round_robin and random on every cluster
of ``data/clusters/`` and ``data/clusters/suite/`` x every suite workload (Azure
conversation, Mooncake, synthetic long prompts, short prompts and bursts); per cell
``ours_vs_best_baseline``; overall ``min_ours_vs_best_baseline`` and
``geomean_ours_vs_least_loaded_heterogeneous``. Ours runs on the deployment advised
from a held-out sample of each cell's workload (``hpd_sim.roles``; ``colocated`` redeploys
the fleet too; at least 2,000 requests: ``suite.ADVICE_MIN_REQUESTS``); a search's points
stop as soon as they cannot keep 90 % (the same goodput, in less time); with ``--declared``
also ours on the fleet as declared in every cell
(``min_ours_as_declared_vs_best_baseline``; one more search where the advice changed it);
with ``--same-rate`` also least-loaded at ours's point past capacity (1.5x ours's goodput
rate) and ours at least-loaded's, the cliff compared at the same offered load
(``cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate``, at ours's point;
``cells_where_ours_keeps_less_than_least_loaded_at_either_point``; two more points per
cell, so not part of the timed quick suite).
Prints the matrix and, with ``--out DIR``
(default ``bench/results``), writes ``suite.json`` and the heat map ``suite.png``.
``--suite --quick``: the same matrix on shorter traces (40 s of arrivals at each cell's
fluid bound, at most 2,500 requests; the full suite: 120 s, at most 8,000) and a coarser
search (10 % against 4 %).

    python bench/goodput.py --suite --quick --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hpd_sim import SimConfig, Slo, load_cluster, simulate, suite
from hpd_sim.cli import default_trace_path
from hpd_sim.goodput import fluid_bound
from hpd_sim.runner import resolve_policy, run_policy
from hpd_sim.traces import load_trace, reshape

POLICIES = ("ours", "least_loaded", "seed", "colocated")
MOONCAKE_POLICIES = ("ours", "least_loaded", "prefix_only")
MOONCAKE_SLO = Slo(ttft_ms=5000.0, tpot_ms=100.0)
MOONCAKE_TIER = (("standard", 1.0),)
SLO = Slo(ttft_ms=1000.0, tpot_ms=50.0)
TIER = (("interactive", 1.0),)


# size: a benchmark's procedure, read top to bottom (bench/README.md)
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="trace slice, coarse search (< 1 min)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--suite", action="store_true", help="the clusters x workloads matrix")
    ap.add_argument(
        "--processes", type=int, default=None, help="suite: parallel cells (default: cores)"
    )
    ap.add_argument("--out", default="bench/results", help="suite: where JSON and PNG go")
    ap.add_argument(
        "--declared",
        action="store_true",
        help="suite: also search ours on the fleet as declared where the advice changed it",
    )
    ap.add_argument(
        "--same-rate",
        action="store_true",
        help=(
            "suite: also run least-loaded at 1.5x ours's goodput rate and ours at 1.5x "
            "least-loaded's, the cliff compared at the same offered load (two more points "
            "per cell)"
        ),
    )
    args = ap.parse_args(argv)
    if args.suite:
        return run_suite_main(args)

    trace = load_trace(default_trace_path())
    full_n = len(trace)
    if args.quick:
        trace = reshape(trace, max_requests=3000)
    cluster = load_cluster()
    config = SimConfig(seed=0, tiers=TIER)
    tol = 0.10 if args.quick else 0.03

    # wall time of one simulation of the trace at its recorded rate, our policy
    t0 = time.perf_counter()
    simulate(cluster, resolve_policy("ours"), trace.requests, config)
    sim_s = time.perf_counter() - t0
    sim_full_s = sim_s * full_n / len(trace)

    goodput: dict[str, float] = {}
    points: dict[str, list[dict[str, float]]] = {}
    for policy in POLICIES:
        run = run_policy(cluster, policy, trace, SLO, config, search=True, start=4.0, rel_tol=tol)
        goodput[policy] = run.goodput_rps or 0.0
        points[policy] = [
            {"rate_rps": p.rate_rps, "attainment": p.attainment}
            for p in sorted(run.points, key=lambda p: p.rate_scale)
        ]
        if not args.json:
            print(f"{policy:<13} goodput {goodput[policy]:6.2f} req/s", file=sys.stderr)
    bound = fluid_bound(cluster, trace.requests, SLO.tpot_ms)

    mooncake = load_trace(default_trace_path().parent / "mooncake_synthetic.jsonl")
    if args.quick:
        mooncake = reshape(mooncake, max_requests=1500)
    m_config = SimConfig(seed=0, tiers=MOONCAKE_TIER)
    m_goodput: dict[str, float] = {}
    for policy in MOONCAKE_POLICIES:
        run = run_policy(
            cluster, policy, mooncake, MOONCAKE_SLO, m_config, search=True, start=0.5,
            rel_tol=tol,
        )  # fmt: skip
        m_goodput[policy] = run.goodput_rps or 0.0
        if not args.json:
            print(f"mooncake {policy:<13} goodput {m_goodput[policy]:6.2f} req/s", file=sys.stderr)
    at_one = simulate(cluster, resolve_policy("ours"), mooncake.requests, m_config)
    hit = at_one.cached_prompt_tokens / max(1, at_one.prompt_tokens)

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else float("inf")

    ours = goodput["ours"]
    out: dict[str, Any] = {
        "quick": args.quick,
        "requests": len(trace),
        "slo_ttft_ms": SLO.ttft_ms,
        "slo_tpot_ms": SLO.tpot_ms,
        "goodput_rps": goodput,
        "goodput_rps_per_gpu": {k: v / cluster.gpus for k, v in goodput.items()},
        "goodput_requests_per_usd": {
            k: v * 3600.0 / cluster.price_per_hour for k, v in goodput.items()
        },
        "fluid_bound_rps": bound.rps,
        "goodput_vs_least_loaded": ratio(ours, goodput["least_loaded"]),
        "goodput_vs_seed": ratio(ours, goodput["seed"]),
        "goodput_vs_colocated": ratio(ours, goodput["colocated"]),
        "goodput_vs_fluid_bound": ratio(ours, bound.rps),
        "mooncake_requests": len(mooncake),
        "mooncake_goodput_rps": m_goodput,
        "mooncake_goodput_vs_least_loaded": ratio(m_goodput["ours"], m_goodput["least_loaded"]),
        "mooncake_goodput_vs_prefix_only": ratio(m_goodput["ours"], m_goodput["prefix_only"]),
        "mooncake_prefix_hit_rate_at_scale_1": hit,
        "mooncake_prefix_index_blocks_per_worker_max": at_one.prefix_blocks_max,
        "sim_seconds_full_trace": sim_full_s,
        "sim_seconds_full_trace_measured": not args.quick,
        "attainment_points": points,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"fluid bound   {bound.rps:6.2f} req/s")
        for key in (
            "goodput_vs_least_loaded",
            "goodput_vs_seed",
            "goodput_vs_colocated",
            "goodput_vs_fluid_bound",
            "mooncake_goodput_vs_least_loaded",
            "mooncake_goodput_vs_prefix_only",
        ):
            print(f"{key:<26} {out[key]:.2f}")
        note = "" if not args.quick else " (extrapolated from the slice)"
        print(f"sim_seconds_full_trace     {sim_full_s:.1f}{note}")
    return 0


def run_suite_main(args: argparse.Namespace) -> int:
    seconds, cap, tol = (40.0, 2500, 0.10) if args.quick else (120.0, 8000, 0.04)
    total = len(suite.CLUSTERS) * len(suite.WORKLOADS)
    t0 = time.perf_counter()

    def progress(done: int, n: int, cell: suite.Cell) -> None:
        el = time.perf_counter() - t0
        eta = el / done * (n - done)
        print(
            f"[{done:>2}/{n}] {cell.cluster}/{cell.workload}: ours/best "
            f"{cell.ratio(cell.best_baseline):.2f} ({cell.best_baseline}) "
            f"{cell.wall_s:.0f} s; elapsed {el:.0f} s, eta {eta:.0f} s",
            file=sys.stderr,
            flush=True,
        )

    print(f"suite: {total} cells x {len(suite.POLICIES)} policies", file=sys.stderr)
    cells = suite.run_suite(
        seconds=seconds, max_requests=cap, rel_tol=tol, processes=args.processes,
        progress=progress, declared=args.declared, same_rate=args.same_rate,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {
        "suite": True,
        "quick": args.quick,
        "trace_seconds_at_bound": seconds,
        "max_requests": cap,
        "rel_tol": tol,
        **suite.summarise(cells),
        "sim_seconds_suite" + ("_quick" if args.quick else ""): wall,
        "cells": [c.to_dict() for c in cells],
    }
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    name = "suite_quick" if args.quick else "suite"
    (outdir / f"{name}.json").write_text(json.dumps(out, indent=1))
    plotted = suite.plot_heatmap(cells, outdir / f"{name}.png")
    if args.json:
        print(json.dumps(out))
    else:
        print(suite.render_matrix(cells))
        for key in (
            "min_ours_vs_best_baseline",
            "min_ours_as_declared_vs_best_baseline",
            "geomean_ours_vs_least_loaded_heterogeneous",
            "geomean_ours_vs_best_baseline",
        ):
            print(f"{key:<44} " + ("-" if out[key] is None else f"{out[key]:.2f}"))
        print(f"ours ran on (advised per cell): {out['ours_deployments_chosen']}")
        print(
            f"cells where ours falls further than least-loaded at {suite.OVERLOAD}x goodput: "
            f"{out['cells_with_a_steeper_cliff_than_least_loaded']} of "
            f"{out['cells_with_cliff_measured']}"
        )
        print(
            "median attainment of ours's admitted requests there: "
            f"{out['median_ours_admitted_attainment_past_capacity']}"
        )
        if out["cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate"] is not None:
            print(
                "cells where ours keeps less than least-loaded at the same rate (1.5x ours's "
                f"goodput): {out['cells_where_ours_keeps_less_than_least_loaded_at_the_same_rate']}"
            )
        if out["cells_where_ours_keeps_less_than_least_loaded_at_either_point"] is not None:
            print(
                "cells where ours keeps less than least-loaded at either one's 1.5x point "
                "(both at that rate): "
                f"{out['cells_where_ours_keeps_less_than_least_loaded_at_either_point']}"
            )
        print(f"worst cell: {out['min_cell']}; wall {wall:.0f} s")
        print(f"wrote {outdir / (name + '.json')}" + (" and the heat map" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
