"""hetero-pd against the peer router on a real *unequal* fleet: the product's main claim,
measured on real engines rather than in its own simulator.

Setup (``hpd_fleet.real_fleet.FleetStack``, ``--fleet FILE``, default
``bench/fleets/unequal.yaml``): the fleet file's vLLM engines (CPU build, the tiny model),
each with its own CPU quota, cores, KV cache and connector; ``hpd up``; an agent per engine,
**every agent declaring the same GPU figures** (only the scheduler's learner can tell the
engines apart); ``hpd gateway``; and ``vllm-router`` over the same engines, restarted once
per policy (regular mode for engines serving both stages, its P/D mode otherwise).

Steps:

1. **Unloaded latency and capacity, per engine, directly** (no proxy): each engine alone,
   one request at a time (``UNLOADED`` requests: TTFT and TPOT), then its saturation
   throughput (requests/s at ``CAPACITY_LEVELS`` requests in flight in turn, the best).
   The fleet's capacity is the sum.
2. **SLOs from the fleet's own latency**: TTFT target ``TTFT_SLO_X`` x and TPOT target
   ``TPOT_SLO_X`` x the median over every engine's unloaded requests, so the targets say
   "about as fast as an average engine of this fleet serves a request alone, with room to
   queue", whatever the fleet (DistServe sets SLOs as such multiples of the unloaded
   latency). They become the gateway's ``standard`` tier (``ReloadPolicy``); the gateway's
   requests are sent as that tier.
3. **Traffic** drawn from public traces (``--mix``): the Azure LLM conversation trace
   (prompt and output lengths; arrivals are Poisson at the offered rate), or a multi-turn
   chat mix with shared prefixes (sessions whose every turn repeats the conversation so
   far, under one of a few shared system prompts). Lengths are scaled to the tiny model's
   context: prompts by ``budget / p99`` of the drawn prompts, with ``budget`` the model's
   length less the largest output (so the trace's shape is kept and its longest requests
   still fit), outputs likewise to at most ``MAX_OUTPUT`` tokens (CPU decode is slow; the
   trace's outputs would make a point last minutes). Prompts are token ids, fresh per
   request (no arm profits from another's prefix cache), except the chat mix's shared
   parts, which are the same for every arm.
4. **Warm-up** (``WARMUP_PER_ENGINE`` x engines requests through the gateway at a third of
   the capacity): the scheduler's learner needs a few outcomes per engine before it plans
   by measured speeds; these requests count in no figure.
5. **Offered rates past the peak**: a geometric ladder from the measured capacity
   (``RATES``; ``--quick``: ``QUICK_RATES``), climbed until the better arm's goodput falls
   (the peak is passed) or the ladder ends: a closed loop understates what an open one is
   served (the default fleet served 3.5x its closed-loop figure with every one of our
   requests in SLO; its engines batch the decodes of requests that arrive independently).
   At each rate every arm serves the same requests (same lengths and arrival times); the
   arms' order alternates per rate, and the engines drain between points.
   Open loop: a refusal (the gateway's 429) is not retried and counts as a miss.

Figures (``--json``, one object):

* ``goodput_vs_vllm_router_best`` (target >= 1.3): our goodput (requests/s meeting both
  targets) over the best router policy's (the policy whose best goodput over the rates is
  highest), at the rate where the better of the two peaks;
* ``ttft_estimate_error_p50`` (target <= 0.15) / ``_p90`` (target <= 0.5):
  ``|actual / predicted - 1|`` of the route records' outcome TTFT over the plan's estimate,
  over every gateway request after the warm-up that completed;
* ``sim_vs_real_goodput`` (target 0.8-1.25): ``hpd sim``'s goodput on the same fleet
  (a cluster written from the learned figures, ``hpd_fleet.fleet_sim``) and the same
  requests, over the goodput measured, at the rate where ours peaked (``sim``: both sides);
* ``points``: per arm and rate, goodput, attainment, refused, TTFT and TPOT percentiles,
  and the engines used; ``slo``, ``capacity_rps``, ``unloaded``.

    .venv/bin/python bench/real_fleet.py --quick --json
    .venv/bin/python bench/real_fleet.py --fleet bench/fleets/pd_pair.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import grpc
import yaml
from google.protobuf.json_format import MessageToDict

from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_fleet.cgroups import remove_stale
from hpd_fleet.fleet_figures import error_figures, headline, ms
from hpd_fleet.fleet_sim import cluster_of, sim_goodput
from hpd_fleet.loadgen import (
    Job,
    Mix,
    Result,
    drained,
    engine_counts,
    for_arm,
    jobs_at,
    run_point,
    saturated,
    shapes,
    stream_one,
)
from hpd_fleet.real_fleet import FleetStack, load_fleet

HERE = Path(__file__).resolve().parent
DEFAULT_FLEET = HERE / "fleets" / "unequal.yaml"
AZURE = HERE.parent / "data" / "traces" / "azure_llm_2023_conv.csv"

UNLOADED = 6
CAPACITY_LEVELS = (2, 4, 8, 16, 32)
TTFT_SLO_X = 4.0
TPOT_SLO_X = 3.0
MAX_OUTPUT = 48
WARMUP_PER_ENGINE = 8
RATES = (0.75, 1.5, 8)
QUICK_RATES = (1.5, 1.8, 4)
"""(first, growth, most): offered rates ``first x growth^k`` x the measured capacity, rising
until the better arm's goodput at a rate falls below what it reached at the rate before (the
peak is passed: the headline is taken at the peak) or ``most`` rates have run. No rate is
fixed in advance because no capacity figure measured beforehand says where an open loop's
peak is: the default fleet kept every request of ours in SLO at 3.5x its closed-loop
capacity (its engines batch independent arrivals' decodes)."""
POLICIES = ("round_robin", "power_of_two", "cache_aware", "random", "consistent_hash",
            "sticky_least_loaded")  # fmt: skip
QUICK_POLICIES = ("round_robin", "power_of_two", "cache_aware")
"""Every policy of the pinned router that applies without KV events (``kv_aware`` needs the
engines' KV event feed wired into the router: not run, see bench/README.md)."""


@dataclass
class Point:
    arm: str
    rate_rps: float
    results: list[Result] = field(default_factory=list)
    window_s: float = 0.0
    engines: dict[str, float] = field(default_factory=dict)


async def unloaded_and_capacity(
    stack: FleetStack, mix: Mix, rng: random.Random, seconds: float
) -> tuple[dict[str, Any], float]:
    """Per engine: unloaded TTFT and TPOT (median of ``UNLOADED`` requests one at a time)
    and its saturation throughput (``CAPACITY_LEVELS``); the fleet's capacity is the sum."""
    per: dict[str, dict[str, float]] = {}
    ttfts: list[float] = []
    tpots: list[float] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for name, e in stack.engines.items():
            if stack.fleet.disaggregated:
                continue  # a lone prefill or decode engine cannot serve a request
            got = []
            for i, (prompt, out) in enumerate(shapes(mix, UNLOADED, rng)):
                r = await stream_one(http, e.url, Job(0, prompt, out), f"u-{name}-{i}", {})
                if r.status == 200:
                    got.append(r)
            ttfts += [r.ttft_s for r in got]
            tpots += [r.tpot_s for r in got if r.tokens > 1]
            work = shapes(mix, 400, rng)
            rps, clients = await saturated(http, e.url, work, seconds, CAPACITY_LEVELS)
            per[name] = {
                "ttft_ms_p50": statistics.median(r.ttft_s for r in got) * 1000 if got else 0.0,
                "tpot_ms_p50": statistics.median(r.tpot_s for r in got) * 1000 if got else 0.0,
                "capacity_rps": rps,
                "capacity_in_flight": clients,
            }
            print(f"  {name}: unloaded TTFT {per[name]['ttft_ms_p50']:.0f} ms, TPOT "
                  f"{per[name]['tpot_ms_p50']:.1f} ms, {rps:.2f} req/s at "
                  f"{clients} in flight", file=sys.stderr)  # fmt: skip
            await drained(stack)
    if stack.fleet.disaggregated:
        per, ttfts, tpots = await _through_router(stack, mix, rng, seconds)
    capacity = sum(v["capacity_rps"] for v in per.values())
    unloaded = {
        "ttft_ms_p50": statistics.median(ttfts) * 1000,
        "tpot_ms_p50": statistics.median(tpots) * 1000,
    }
    figures: dict[str, Any] = {"engines": per, "fleet": unloaded}
    return figures, capacity


async def _through_router(
    stack: FleetStack, mix: Mix, rng: random.Random, seconds: float
) -> tuple[dict[str, dict[str, float]], list[float], list[float]]:
    """For a disaggregated fleet: the unloaded figures and capacity through the router
    (round robin), which runs vLLM's P/D hand-off (a lone prefill engine serves nothing)."""
    url = stack.start_router("round_robin")
    timeout = aiohttp.ClientTimeout(total=300)
    got: list[Result] = []
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for i, (prompt, out) in enumerate(shapes(mix, UNLOADED * 2, rng)):
            r = await stream_one(http, url, Job(0, prompt, out), f"u-pd-{i}", {})
            if r.status == 200:
                got.append(r)
        work = shapes(mix, 400, rng)
        rps, _ = await saturated(http, url, work, seconds, CAPACITY_LEVELS)
    stack.stop_router()
    await drained(stack)
    per = {"fleet(pd)": {"capacity_rps": rps}}
    return per, [r.ttft_s for r in got], [r.tpot_s for r in got if r.tokens > 1]


# -- the gateway's side -------------------------------------------------------------------


def set_tiers(stack: FleetStack, ttft_ms: float, tpot_ms: float) -> str:
    """The default profile with its ``standard`` tier at the benchmark's targets (its YAML
    is returned: the simulator plans with the same)."""
    from importlib import resources

    text = (
        resources.files("hpd_scheduler.policy")
        .joinpath("profiles/default.yaml")
        .read_text(encoding="utf-8")
    )
    doc = yaml.safe_load(text)
    std = doc["tiers"]["classes"]["standard"]
    std["ttft_ms"], std["tpot_ms"] = round(ttft_ms, 1), round(tpot_ms, 2)
    text = yaml.safe_dump(doc, sort_keys=False)
    with grpc.insecure_channel(stack.addrs["scheduler"]) as ch:
        s_grpc.SchedulerServiceStub(ch).ReloadPolicy(
            s.ReloadPolicyRequest(profile_yaml=text), timeout=10
        )
    return text


def estimate_ratios(
    stack: FleetStack, rids: list[str], dump: IO[str] | None = None
) -> list[tuple[str, float, bool]]:
    """(request id, actual / predicted TTFT, whether its plan predicted a queue ahead) of
    every completed request among ``rids``, from its route record."""
    out = []
    with grpc.insecure_channel(stack.addrs["scheduler"]) as ch:
        stub = s_grpc.SchedulerServiceStub(ch)
        for rid in rids:
            try:
                got = stub.GetRouteRecord(s.GetRouteRecordRequest(request_id=rid), timeout=10)
            except grpc.RpcError:
                continue
            rec = got.record
            est = rec.plan.estimates
            if dump is not None and not rec.HasField("outcome"):
                dump.write(json.dumps(refusal_row(rid, rec)) + "\n")
            if rec.HasField("outcome") and rec.outcome.success and est.ttft_ms > 0:
                out.append((rid, rec.outcome.ttft_ms / est.ttft_ms, est.prefill_wait_ms > 0))
                if dump is not None:
                    row = {
                        "rid": rid, "worker": rec.plan.prefill_worker_id,
                        "mode": s.ExecutionMode.Name(rec.plan.mode),
                        "est_ttft_ms": est.ttft_ms, "est_wait_ms": est.prefill_wait_ms,
                        "est_prefill_ms": est.prefill_ms, "ttft_ms": rec.outcome.ttft_ms,
                        "prefill_ms": rec.outcome.prefill_ms,
                    }  # fmt: skip
                    dump.write(json.dumps(row) + "\n")
    return out


def refusal_row(rid: str, rec: s.RouteRecord) -> dict[str, Any]:
    """A request the scheduler refused (or whose outcome never came), for the dump: its
    decision, reasons and each worker the planner dropped with why."""
    expl = MessageToDict(rec.explanation)
    return {
        "rid": rid, "decision": s.RouteDecision.Name(rec.decision),
        "reasons": list(rec.reject_reasons), "class": rec.reject_class,
        "dropped": [f"{w.get('worker_id')}:{w.get('reason')}"
                    for w in expl.get("rejected_workers", [])],
        "notes": expl.get("notes", []),
        "decode_steps": {c.get("worker_id"): c.get("step_ms")
                         for c in expl.get("candidates", {}).get("decode", [])},
        "options": [(o.get("prefill_worker_id"), o.get("decode_worker_id"), o.get("ttft_ms"))
                    for o in expl.get("options", [])],
    }  # fmt: skip


# -- figures ------------------------------------------------------------------------------


def summary(p: Point, slo: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in p.results if r.status == 200]
    met = [r for r in ok if r.ttft_s * 1000 <= slo["ttft_ms"]
           and (r.tokens <= 1 or r.tpot_s * 1000 <= slo["tpot_ms"])]  # fmt: skip
    n = len(p.results)
    return {
        "arm": p.arm,
        "rate_rps": round(p.rate_rps, 3),
        "requests": n,
        "completed": len(ok),
        "refused": sum(r.status == 429 for r in p.results),
        "failed": sum(r.status not in (200, 429) for r in p.results),
        "goodput_rps": round(len(met) / p.window_s, 3) if p.window_s else 0.0,
        "attainment": round(len(met) / n, 4) if n else 0.0,
        "ttft_ms": {f"p{q}": ms([r.ttft_s for r in ok], q / 100) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": ms([r.tpot_s for r in ok if r.tokens > 1], q / 100) for q in (50, 90)},
        "engines": {k: int(v) for k, v in p.engines.items()},
    }


# -- the run ------------------------------------------------------------------------------


async def run_rate(
    stack: FleetStack,
    at: tuple[int, float, float],
    jobs: list[Job],
    arms: list[str],
    how: tuple[str, dict[str, str], float, dict[str, float]],
) -> list[dict[str, Any]]:
    """Every arm at rate number ``k`` (``x`` times ``capacity``), the same requests each, in
    an order that alternates per rate; the engines drain between arms. A row per arm (with
    its request ids under ``rids``)."""
    k, x, capacity = at
    tag, tier, window, slo = how
    rate = x * capacity
    rows = []
    for arm in arms if k % 2 == 0 else list(reversed(arms)):
        url = stack.gateway_url
        if arm != "hetero-pd":
            url = stack.start_router(arm.split(":", 1)[1])
        before = await engine_counts(stack)
        pt = Point(arm, rate, window_s=window)
        mine = for_arm(jobs, arms.index(arm))
        pt.results = await run_point(url, mine, arm.replace(":", "-"), f"{tag}-{k}",
                                     tier if arm == "hetero-pd" else {})  # fmt: skip
        stack.stop_router()
        await drained(stack)
        after = await engine_counts(stack)
        pt.engines = {e: after[e] - before.get(e, 0.0) for e in after}
        row = summary(pt, slo)
        rows.append({**row, "rids": [r.rid for r in pt.results]})
        print(f"  {x:.2f}x = {rate:.2f} req/s  {arm:<32} goodput {row['goodput_rps']:.2f}/s "
              f"att {row['attainment']:.2f} refused {row['refused']} "
              f"TTFT p90 {row['ttft_ms']['p90']} ms  engines {row['engines']}",
              file=sys.stderr)  # fmt: skip
    return rows


async def measure(stack: FleetStack, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    quick = args.quick
    print("unloaded latency and capacity per engine ...", file=sys.stderr)
    mix = Mix(args.mix, AZURE, stack.fleet.max_model_len, MAX_OUTPUT)
    unloaded, capacity = await unloaded_and_capacity(stack, mix, rng, 12 if quick else 25)
    slo = {"ttft_ms": TTFT_SLO_X * unloaded["fleet"]["ttft_ms_p50"],
           "tpot_ms": TPOT_SLO_X * unloaded["fleet"]["tpot_ms_p50"]}  # fmt: skip
    print(f"capacity {capacity:.2f} req/s; SLO TTFT {slo['ttft_ms']:.0f} ms, TPOT "
          f"{slo['tpot_ms']:.1f} ms", file=sys.stderr)  # fmt: skip
    profile_yaml = set_tiers(stack, slo["ttft_ms"], slo["tpot_ms"])
    tier = {"x-hpd-tier": "standard"}
    tag = f"rf{int(time.time())}"
    n_warm = WARMUP_PER_ENGINE * len(stack.engines)
    warm_rate = capacity / 3
    warm = jobs_at(warm_rate, n_warm / warm_rate, mix, args.seed + 1)
    print(f"warm-up: {len(warm)} requests through the gateway ...", file=sys.stderr)
    await run_point(stack.gateway_url, warm, "warmup", tag, tier)
    await drained(stack)
    window = 20.0 if quick else 40.0
    first, growth, most = QUICK_RATES if quick else RATES
    policies = QUICK_POLICIES if quick else POLICIES
    arms = ["hetero-pd", *(f"vllm-router:{p}" for p in policies)]
    points: list[dict[str, Any]] = []
    ours_rids: list[str] = []
    jobs_by_rate: list[list[Job]] = []
    rates: list[float] = []
    best_before = 0.0
    for k in range(int(most)):
        x = first * growth**k
        rates.append(x)
        jobs = jobs_at(x * capacity, window, mix, args.seed + 100 + k)
        jobs_by_rate.append(jobs)
        rows = await run_rate(stack, (k, x, capacity), jobs, arms, (tag, tier, window, slo))
        points += rows
        ours_rids += [rid for row in rows if row["arm"] == "hetero-pd" for rid in row["rids"]]
        best = max(row["goodput_rps"] for row in rows)
        if best < best_before:
            break  # the peak is passed
        best_before = best
    for row in points:
        row.pop("rids", None)
    if args.dump is not None:
        with args.dump.open("w") as f:
            ratios = estimate_ratios(stack, ours_rids, f)
    else:
        ratios = estimate_ratios(stack, ours_rids)
    overall = error_figures(ratios)
    by_rate = {
        f"{x:.3g}x": error_figures([r for r in ratios if r[0].startswith(f"{tag}-{k}-")])
        for k, x in enumerate(rates)
    }
    sim = sim_versus_real(stack, unloaded, points, jobs_by_rate, window, slo, profile_yaml)
    return {
        **headline(points),
        "sim_vs_real_goodput": sim.get("sim_vs_real_goodput"),
        "sim": sim,
        "ttft_estimate_error_p50": overall["all"]["p50"],
        "ttft_estimate_error_p90": overall["all"]["p90"],
        "ttft_estimate_error": {"overall": overall, "by_rate": by_rate},
        "slo": {k: round(v, 2) for k, v in slo.items()},
        "capacity_rps": round(capacity, 3),
        "unloaded": unloaded,
        "points": points,
        "mix": args.mix,
        "fleet": str(args.fleet),
        "warmup_requests": len(warm),
        "window_s": window,
        "quick": quick,
    }


def sim_versus_real(
    stack: FleetStack,
    unloaded: dict[str, Any],
    points: list[dict[str, Any]],
    jobs_by_rate: list[list[Job]],
    window: float,
    slo: dict[str, float],
    profile_yaml: str,
) -> dict[str, Any]:
    """``sim_vs_real_goodput`` (``real_fleet_sim``) at the rate where our goodput peaked."""
    ours = [p for p in points if p["arm"] == "hetero-pd"]
    if not ours:
        return {"sim_vs_real_goodput": None, "why": "no point of ours"}
    k = max(range(len(ours)), key=lambda i: ours[i]["goodput_rps"])
    jobs = jobs_by_rate[k]
    mean_ctx = statistics.fmean(len(j.prompt) + j.max_tokens / 2 for j in jobs)
    doc = cluster_of(stack, unloaded, mean_ctx)
    if doc is None:
        return {"sim_vs_real_goodput": None, "why": "a disaggregated fleet is not written"}
    got = sim_goodput(
        doc, [(j.at_s, len(j.prompt), j.max_tokens) for j in jobs], window, slo, profile_yaml
    )
    real = ours[k]["goodput_rps"]
    ratio = got["goodput_rps"] / real if real else None
    return {
        "sim_vs_real_goodput": None if ratio is None else round(ratio, 3),
        "at_rate_rps": ours[k]["rate_rps"],
        "real_goodput_rps": real,
        "sim": got,
        "cluster": doc,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="hetero-pd against vllm-router on a real unequal fleet (real engines)",
        epilog="Needs the engines' virtualenv (scripts/engines-venv.sh) and root for CPU quotas.",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="three policies, 20 s per point, at most three rates (QUICK_RATES)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--fleet", type=Path, default=DEFAULT_FLEET, help="fleet file (YAML)")
    ap.add_argument(
        "--mix",
        choices=("azure", "chat"),
        default="azure",
        help="Azure conversation lengths, or multi-turn chat with shared prefixes",
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy the fleet's logs here")
    ap.add_argument(
        "--dump", type=Path, default=None, help="write our requests' plans and outcomes (JSONL)"
    )
    ap.add_argument(
        "--gateway-mode", choices=("embedded", "remote"), default="embedded",
        help="our gateway plans in its own process (the default) or at the scheduler service",
    )  # fmt: skip
    args = ap.parse_args(argv)
    fleet = load_fleet(args.fleet)
    remove_stale()  # a run killed before it could clean up leaves its cgroups
    # SIGTERM ends the run like Ctrl-C: the fleet (engines, their cgroups) is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpd-bench-fleet-") as tmp:
        print(f"starting {len(fleet.engines)} engines, the control plane and the gateway ...",
              file=sys.stderr)  # fmt: skip
        try:
            with FleetStack(fleet, Path(tmp), gateway_mode=args.gateway_mode) as stack:
                setup_s = time.perf_counter() - t0
                figures = asyncio.run(measure(stack, args))
        finally:
            if args.keep_logs is not None:
                import shutil

                shutil.copytree(Path(tmp) / "logs", args.keep_logs, dirs_exist_ok=True)
    figures["gateway_mode"] = args.gateway_mode
    figures["setup_s"] = round(setup_s, 1)
    figures["total_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(figures))
    else:
        print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
