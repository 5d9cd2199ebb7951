"""``hpd plan``: the cheapest fleet of GPU kinds and roles that serves a traffic within its
tiers' SLOs, sized by an integer program and verified in the simulator.

Examples::

    # a trace and a catalogue of GPU kinds (prices, how many may be had)
    hpd plan --trace data/traces/azure_llm_2023_conv.csv --max-requests 1000 \\
        --gpus gpus.yaml --out plan.yaml
    # a rate and a prompt:output mix instead of a trace, two tiers with their own SLOs
    hpd plan --rate 8 --mix 1024:128=0.7,6000:300=0.3 --gpus gpus.yaml \\
        --tier interactive=0.3,standard=0.7 --slo standard:ttft=2000,tpot=80 --json
    # then check what it predicted, in the simulator
    hpd sim --cluster plan.yaml --trace data/traces/azure_llm_2023_conv.csv \\
        --max-requests 1000 --tier interactive --slo ttft=1000,tpot=50

How: the traffic is cut into prompt x output buckets per tier; per bucket and per (kind,
worker size, role: prefill, decode or both) the cost model gives the worker-seconds a
request takes; an integer program (HiGHS) splits each bucket over the roles and kinds and
picks whole workers at the least $/h with every worker loaded to at most the headroom
(``hpd_plan.milp``). The cheapest few distinct fleets are simulated on the traffic,
cheapest first, and the first whose every tier reaches the target attainment is kept; when
none does, the side that missed gets less headroom and the program runs again
(``hpd_plan.planner``).

Exit status: 0 a fleet held; 1 no fleet held or none exists within the catalogue (the
reason and the best reachable are reported); 2 bad input or the solver missing.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hpd_common import perfmodel
from hpd_sim.cli import SYNTHETIC_REQUESTS
from hpd_sim.metrics import Slo
from hpd_sim.runner import resolve_policy
from hpd_sim.traces import Trace, TraceError, load_trace, reshape
from hpd_sim.workloads import synthetic_trace

from . import catalogue as catalogue_module
from .catalogue import CatalogueError, load_catalogue
from .milp import SolverMissing
from .planner import DEFAULT_HEADROOM, PlanInputs, PlanResult, plan
from .report import plan_doc, render
from .traffic import TierSpec, mix_trace, parse_mix, parse_tiers, tier_specs
from .verify import Progress, cluster_doc

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hpd plan``."""
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="hpd plan",
        description=doc.split("\n\n")[0].replace("``", ""),
        epilog=_epilog(doc),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _traffic_args(p)
    _service_args(p)
    _fleet_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--out", help="write the fleet as a cluster file for hpd sim --cluster")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return p


def _epilog(doc: str) -> str:
    """The module docstring after its first paragraph, with the catalogue's schema (the
    ``hpd_plan.catalogue`` docstring) after the catalogue example."""
    parts = doc.split("\n\n")[1:]
    schema = (catalogue_module.__doc__ or "").split("\n\n")[1:]
    at = next((i for i, part in enumerate(parts) if part.startswith("How:")), len(parts))
    text = "\n\n".join([*parts[:at], *schema, *parts[at:]])
    return text.replace("::", ":").replace("``", "")


def _traffic_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("traffic (a trace, or --rate with --mix)")
    t.add_argument(
        "--trace", help="Azure CSV or Mooncake JSONL trace, or synthetic:NAME (as hpd sim --trace)"
    )
    t.add_argument("--max-requests", type=int, help="keep the first N requests of the trace")
    t.add_argument("--duration", type=float, help="keep the first N seconds of the trace")
    t.add_argument("--rate-scale", type=float, help="replay the trace at this x its rate")
    t.add_argument(
        "--rate", type=float, help="requests/s (with --mix; with --trace: its target rate)"
    )
    t.add_argument("--mix", help="PROMPT:OUTPUT[=WEIGHT],... token lengths of the requests")
    t.add_argument(
        "--requests", type=int, default=2000, help="requests made for --mix (%(default)s)"
    )
    t.add_argument("--save-trace", help="write the --mix traffic as a JSONL trace (to re-check it)")


def _service_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("service levels")
    s.add_argument(
        "--tier",
        default="interactive",
        help="tiers with weights, e.g. interactive=0.3,standard=0.7 (default: %(default)s)",
    )
    s.add_argument(
        "--slo",
        action="append",
        default=[],
        help="[TIER:]ttft=MS,tpot=MS (repeat per tier; default: the policy's tier targets)",
    )
    s.add_argument(
        "--target",
        type=float,
        default=0.9,
        help="attainment each tier must reach in the simulator (%(default)s)",
    )
    s.add_argument(
        "--headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        help="share of a worker's capacity the plan may load (%(default)s; the module "
        "hpd_plan.planner says why)",
    )


def _fleet_args(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fleet")
    f.add_argument("--gpus", required=True, help="catalogue of GPU kinds (YAML or JSON)")
    f.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"model served: {', '.join(perfmodel.MODELS)} (%(default)s)",
    )
    f.add_argument(
        "--policy", default="ours", help="scheduling policy the fleet runs under (hpd sim --policy)"
    )
    f.add_argument(
        "--candidates",
        type=int,
        default=3,
        help="fleets solved for and simulated per round (%(default)s)",
    )
    f.add_argument(
        "--rounds", type=int, default=4, help="rounds of tightening the headroom (%(default)s)"
    )
    f.add_argument(
        "--verify-all",
        action="store_true",
        help="simulate every fleet of the round, not only up to the first that holds",
    )
    f.add_argument(
        "--seed", type=int, default=0, help="simulation seed (tier assignment), as hpd sim --seed"
    )


def _slos(items: Sequence[str]) -> dict[str, Slo]:
    """``--slo`` values: ``TIER:ttft=..,tpot=..`` or ``ttft=..,tpot=..`` (every tier)."""
    out: dict[str, Slo] = {}
    for item in items:
        tier, sep, text = item.partition(":")
        if not sep:
            tier, text = "*", item
        out[tier.strip()] = Slo.parse(text)
    return out


def _traffic(args: argparse.Namespace) -> tuple[Trace, list[str], dict[str, Any]]:
    """The traffic, the `hpd sim` arguments that replay it, and its description."""
    if bool(args.trace) == bool(args.mix):
        raise ValueError("give the traffic as --trace FILE, or as --rate R with --mix")
    if args.mix:
        if args.rate is None:
            raise ValueError("--mix needs --rate (requests/s)")
        trace = mix_trace(args.rate, parse_mix(args.mix), args.requests, args.seed)
        sim_args = []
        if args.save_trace:
            _save_trace(trace, Path(args.save_trace))
            sim_args = ["--trace", args.save_trace]
        return trace, sim_args, {"name": trace.name, "source": "mix", "rate_scale": 1.0}
    if args.trace.startswith("synthetic:"):  # hpd sim's synthetic workloads, as it makes them
        n = args.max_requests or SYNTHETIC_REQUESTS
        trace = synthetic_trace(args.trace.partition(":")[2], n=n, seed=args.seed)
    else:
        trace = load_trace(args.trace)
    sim_args = ["--trace", args.trace]
    if args.duration is not None or args.max_requests is not None:
        trace = reshape(trace, duration_s=args.duration, max_requests=args.max_requests)
        if args.duration is not None:
            sim_args += ["--duration", f"{args.duration:g}"]
        if args.max_requests is not None:
            sim_args += ["--max-requests", str(args.max_requests)]
    if len(trace) < 2 or trace.mean_rate <= 0:
        raise ValueError("the trace needs at least two requests over a positive duration")
    scale = args.rate_scale or 1.0
    if args.rate is not None:
        if args.rate_scale is not None:
            raise ValueError("give --rate or --rate-scale, not both")
        scale = args.rate / trace.mean_rate
    if scale != 1.0:
        trace = reshape(trace, rate_scale=scale)
        sim_args += ["--rate-scale", repr(scale)]
    return trace, sim_args, {"name": trace.name, "source": args.trace, "rate_scale": scale}


def _save_trace(trace: Trace, path: Path) -> None:
    """Mooncake JSONL (ms timestamps), which ``hpd sim --trace`` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in trace.requests:
            row = {
                "timestamp": r.arrival_s * 1000.0,
                "input_length": r.prompt_tokens,
                "output_length": r.output_tokens,
            }
            fh.write(json.dumps(row) + "\n")


def _recheck(
    args: argparse.Namespace, sim_args: list[str], tiers: Sequence[TierSpec], out: str
) -> list[str]:
    """One `hpd sim` command per tier whose JSON ``slo_attainment_per_tier[tier]`` is the
    attainment predicted for it."""
    if not sim_args:
        return ["(the --mix traffic was not saved: add --save-trace FILE to re-check it)"]
    tier_arg = (
        ",".join(f"{t.name}={t.weight:g}" for t in tiers) if len(tiers) > 1 else tiers[0].name
    )
    base = [
        "hpd",
        "sim",
        "--cluster",
        out,
        *sim_args,
        "--policy",
        args.policy,
        "--seed",
        str(args.seed),
        "--tier",
        tier_arg,
    ]
    cmds = []
    for t in tiers:
        slo = f"ttft={t.slo.ttft_ms:g},tpot={t.slo.tpot_ms:g}"
        cmds.append(
            shlex.join([*base, "--slo", slo, "--json"])
            + f"   # .policies[0].points[0].slo_attainment_per_tier.{t.name}"
        )
    return cmds


def _inputs(args: argparse.Namespace) -> tuple[PlanInputs, list[str], dict[str, Any]]:
    for name, lo, hi in (("target", 0.0, 1.0), ("headroom", 0.05, 1.0)):
        value = getattr(args, name)
        if not lo < value <= hi:
            raise ValueError(f"--{name} must be in ({lo:g}, {hi:g}], got {value}")
    if args.candidates < 1 or args.rounds < 1:
        raise ValueError("--candidates and --rounds must be >= 1")
    model = perfmodel.model_spec(args.model)
    profile = resolve_policy(args.policy)
    tiers = tier_specs(parse_tiers(args.tier), profile, _slos(args.slo))
    trace, sim_args, meta = _traffic(args)
    catalogue = load_catalogue(args.gpus, model)
    inputs = PlanInputs(
        trace, tiers, catalogue, model, profile, args.headroom, args.target,
        args.candidates, args.rounds, args.seed, args.verify_all,
    )  # fmt: skip
    traffic = {**meta, "requests": len(trace), "mean_rate_rps": trace.mean_rate}
    return inputs, sim_args, {"traffic": traffic, "model": model.name}


def _write_cluster(
    res: PlanResult, inputs: PlanInputs, out: str, recheck: list[str]
) -> dict[str, Any]:
    assert res.chosen is not None
    chosen = res.chosen
    attain = ", ".join(f"{k} {v.attainment * 100:.1f}%" for k, v in chosen.verdict.per_tier.items())
    description = (
        f"hpd plan: {inputs.trace.name}, ${chosen.candidate.price_per_hour:.2f}/h, "
        f"predicted attainment {attain}"
    )
    doc = cluster_doc(
        chosen.candidate.pools, inputs.catalogue, inputs.model, Path(out).stem, description
    )
    header = [f"# {description}", "# re-check in the simulator:"] + [f"#   {c}" for c in recheck]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False), encoding="utf-8"
    )
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hpd plan``; returns the exit status (module docstring)."""
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        inputs, sim_args, meta = _inputs(args)
        progress = Progress(sys.stderr, enabled=not args.no_progress)
        res = plan(inputs, progress)
    except (ValueError, OSError, KeyError, TraceError, CatalogueError) as exc:
        print(f"hpd plan: {exc}", file=sys.stderr)
        return 2
    except SolverMissing as exc:
        print(f"hpd plan: {exc}", file=sys.stderr)
        return 2
    out = args.out or "plan.yaml"
    recheck = _recheck(args, sim_args, inputs.tiers, out) if res.chosen else []
    cluster = _write_cluster(res, inputs, args.out, recheck) if res.chosen and args.out else None
    if res.chosen and not args.out:
        recheck.insert(0, "(write the fleet with --out plan.yaml first)")
    if args.out and not cluster:
        print(f"hpd plan: no fleet held: {args.out} not written", file=sys.stderr)
    meta |= {"headroom": inputs.headroom, "target": inputs.target, "policy": args.policy}
    meta["cluster_file"] = args.out if cluster else None
    doc = plan_doc(res, inputs.tiers, meta, cluster, recheck)
    doc["seconds"]["total"] = time.perf_counter() - t0
    print(json.dumps(doc) if args.json else render(doc, inputs.target))
    return 0 if res.chosen else 1


if __name__ == "__main__":
    raise SystemExit(main())
