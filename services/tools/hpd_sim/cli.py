"""``hpd sim``: replay a trace on a simulated heterogeneous cluster under one or more policies.

Examples::

    hpd sim                                              # default cluster, Azure trace, ours
    hpd sim --policy ours,least_loaded,seed,colocated --rate-scale 4,8
    hpd sim --policy ours --policy least_loaded --search-goodput --out results/
    hpd sim --trace data/traces/mooncake_synthetic_slice.jsonl --slo ttft=5000,tpot=100 --json
    hpd sim --trace synthetic:bursts --cluster data/clusters/suite/slow_link.yaml --search-goodput
    hpd sim --advise --trace my_traffic.csv --cluster my_fleet.yaml   # which stages per pool

The table shows, per policy and rate, the SLO attainment (both TTFT and TPOT met, rejected
requests counted as misses), TTFT/TPOT/TBT percentiles and hand-off modes; with
``--search-goodput`` also each policy's goodput (requests/s at >= 90 % attainment), per GPU
and per dollar, and the cluster's fluid capacity bound. ``--out DIR`` writes ``sim.json`` and,
when matplotlib is installed, ``attainment.png`` (SLO attainment against rate per policy, as
DistServe plots it).

``--advise``: which deployment to run the fleet in for this traffic (``hpd_sim.roles``): the
pools as declared, every pool serving both stages with the planner choosing per request,
every request on one worker, or every request on one worker ranked by the weighted load
factors alone (the built-in ``colocated`` profile); each is simulated with the (first)
policy, the last with its own profile, and the one with the most goodput is advised. Give
it a sample of your own traffic: the advice is as good as the sample is like the traffic the
fleet will serve.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from hpd_sim.traces import Trace, load_trace, reshape

from .cluster import ClusterError, ClusterSpec, default_cluster_path, load_cluster
from .engine import SimConfig
from .goodput import fluid_bound
from .metrics import Slo
from .roles import DEPLOYMENTS, advise
from .runner import PolicyRun, resolve_policy, run_policy
from .workloads import synthetic_trace

__all__ = ["build_parser", "default_trace_path", "main", "render_table"]


def default_trace_path() -> Path:
    """The Azure conversation trace shipped in ``data/traces/``."""
    return default_cluster_path().parent.parent / "traces" / "azure_llm_2023_conv.csv"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _tiers(text: str) -> tuple[tuple[str, float], ...]:
    out: list[tuple[str, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        out.append((name.strip(), float(weight) if weight else 1.0))
    if not out:
        raise argparse.ArgumentTypeError("--tier needs at least one tier name")
    return tuple(out)


SYNTHETIC_REQUESTS = 3000
"""Requests generated for ``--trace synthetic:NAME`` when ``--max-requests`` is not given."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hpd sim``."""
    p = argparse.ArgumentParser(
        prog="hpd sim",
        description="Discrete-event simulation of a heterogeneous P/D cluster under a policy.",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="Azure CSV or Mooncake JSONL trace, or synthetic:NAME (long_prompts, "
        "short_prompts, bursts, decode_heavy; 1 req/s before --rate-scale, "
        f"{SYNTHETIC_REQUESTS} requests unless --max-requests)",
    )
    p.add_argument("--cluster", default=None, help="cluster YAML (default: data/clusters)")
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="built-in profile (ours/default, least_loaded, seed, round_robin, random, "
        "colocated) or a profile YAML; repeat or comma-separate for several",
    )
    p.add_argument(
        "--slo",
        default="ttft=1000,tpot=50",
        help="SLO targets in ms: ttft=MS,tpot=MS[,tbt=MS] (default: %(default)s)",
    )
    p.add_argument(
        "--tier",
        type=_tiers,
        default=(("interactive", 1.0),),
        help="tier(s) of the requests with weights, e.g. interactive=0.3,standard=0.7",
    )
    p.add_argument("--rate-scale", type=_floats, default=None, help="rate scale(s), e.g. 1,2,4")
    p.add_argument("--duration", type=float, default=None, help="keep the first N trace seconds")
    p.add_argument("--max-requests", type=int, default=None, help="keep the first N requests")
    p.add_argument("--search-goodput", action="store_true", help="binary-search the goodput")
    p.add_argument("--target", type=float, default=0.9, help="attainment target for goodput")
    p.add_argument("--tolerance", type=float, default=0.02, help="relative search tolerance")
    p.add_argument("--start-scale", type=float, default=1.0, help="first scale of the search")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (random policy, tier mix)")
    p.add_argument(
        "--report-interval", type=float, default=0.0, help="load report period s (0: fresh)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--out", default=None, help="directory for sim.json and attainment.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--advise",
        action="store_true",
        help="advise a deployment for this traffic: pools as declared, every pool serving "
        "both stages, colocated, or colocated by the `colocated` profile's weights (each "
        "simulated with the first --policy, the last with its own; goodput search)",
    )
    return p


class _Bar:
    """A one-line progress bar on a terminal stream (redrawn in place)."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        width = 30
        frac = done / total if total else 1.0
        fill = int(frac * width)
        bar = "#" * fill + "-" * (width - fill)
        el = time.perf_counter() - self.t0
        self.stream.write(f"\r{label:<24} [{bar}] {done:>6}/{total:<6} {el:6.1f}s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def render_table(runs: Sequence[PolicyRun], cluster: ClusterSpec, bound_rps: float | None) -> str:
    """The terminal table: one row per (policy, rate), then a goodput block if searched."""
    head = (
        f"{'policy':<14}{'scale':>7}{'req/s':>8}{'attain':>8}{'ttft ok':>8}{'tpot ok':>8}"
        f"{'ttft p50':>9}{'ttft p90':>9}{'tpot p90':>9}{'tbt p90':>8}{'rej':>6}  modes"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        for s in sorted(run.points, key=lambda p: p.rate_scale):
            modes = " ".join(f"{k}={v}" for k, v in sorted(s.modes.items()))
            lines.append(
                f"{run.policy:<14}{s.rate_scale:>7.3g}{s.rate_rps:>8.1f}"
                f"{s.attainment * 100:>7.1f}%{s.attainment_ttft * 100:>7.1f}%"
                f"{s.attainment_tpot * 100:>7.1f}%{_fmt(s.ttft_ms['p50']):>9}"
                f"{_fmt(s.ttft_ms['p90']):>9}{_fmt(s.tpot_ms['p90'], 1):>9}"
                f"{_fmt(s.tbt_ms['p90'], 1):>8}{s.rejected:>6}  {modes}"
            )
    searched = [r for r in runs if r.goodput_rps is not None]
    if searched:
        lines.append("")
        lines.append(
            f"{'policy':<14}{'goodput req/s':>14}{'per GPU':>9}{'req per $':>11}{'vs bound':>10}"
        )
        for r in searched:
            g = r.goodput_rps or 0.0
            per_usd = g * 3600.0 / cluster.price_per_hour if cluster.price_per_hour else 0.0
            vs = f"{g / bound_rps * 100:.0f}%" if bound_rps else "-"
            lines.append(
                f"{r.policy:<14}{g:>14.2f}{g / cluster.gpus:>9.2f}{per_usd:>11.0f}{vs:>10}"
            )
        if bound_rps is not None:
            lines.append(f"{'fluid bound':<14}{bound_rps:>14.2f}{bound_rps / cluster.gpus:>9.2f}")
    return "\n".join(lines)


def _plot(
    runs: Sequence[PolicyRun], out: Path, slo: Slo, target: float, bound_rps: float = 0.0
) -> str | None:
    """Write attainment.png (each policy's SLO attainment per request rate tried, the
    attainment target, and the cluster's fluid capacity bound); return a message instead
    when matplotlib is missing."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return "matplotlib is not installed: no PNG written (pip install 'hetero-pd[plots]')"
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for run in runs:
        pts = sorted(run.points, key=lambda p: p.rate_rps)
        ax.plot(
            [p.rate_rps for p in pts],
            [p.attainment * 100 for p in pts],
            marker="o",
            label=run.policy,
        )
    ax.axhline(
        target * 100, color="grey", linestyle="--", linewidth=1,
        label=f"attainment target {target:.0%}",
    )  # fmt: skip
    if bound_rps > 0:
        # no policy can sustain more: every GPU busy at its best SLO-feasible rate
        ax.axvline(
            bound_rps, color="black", linestyle=":", linewidth=1.2,
            label=f"fluid capacity bound {bound_rps:.1f} req/s",
        )  # fmt: skip
    ax.set_xlabel("request rate offered (req/s)")
    ax.set_ylabel("requests within both SLOs (%)")
    ax.set_title(f"SLO attainment: TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms")
    ax.set_ylim(0, 102)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "attainment.png", dpi=120)
    plt.close(fig)
    return None


def _load_inputs(args: argparse.Namespace) -> tuple[Trace, ClusterSpec]:
    source = str(args.trace or default_trace_path())
    if source.startswith("synthetic:"):
        n = args.max_requests or SYNTHETIC_REQUESTS
        trace = synthetic_trace(source.partition(":")[2], n=n, seed=args.seed)
    else:
        trace = load_trace(source)
    if args.duration is not None or args.max_requests is not None:
        trace = reshape(trace, duration_s=args.duration, max_requests=args.max_requests)
    cluster = load_cluster(args.cluster)
    return trace, cluster


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hpd sim``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        slo = Slo.parse(args.slo)
        trace, cluster = _load_inputs(args)
    except (ValueError, OSError, ClusterError) as exc:
        print(f"hpd sim: {exc}", file=sys.stderr)
        return 2
    if len(trace) < 2:
        print("hpd sim: the trace needs at least two requests", file=sys.stderr)
        return 2
    policies = [p.strip() for arg in (args.policy or ["ours"]) for p in arg.split(",") if p.strip()]
    scales = args.rate_scale or ([] if args.search_goodput else [1.0])
    config = SimConfig(seed=args.seed, tiers=args.tier, report_interval_s=args.report_interval)
    bar = _Bar(sys.stderr, not args.no_progress and sys.stderr.isatty())
    if args.advise:
        return _advise(args, trace, cluster, slo, config, policies[0])
    runs: list[PolicyRun] = []
    try:
        for policy in policies:
            runs.append(
                run_policy(
                    cluster,
                    policy,
                    trace,
                    slo,
                    config,
                    scales=scales,
                    search=args.search_goodput,
                    target=args.target,
                    start=args.start_scale,
                    rel_tol=args.tolerance,
                    progress=bar,
                )
            )
    except ValueError as exc:
        print(f"hpd sim: {exc}", file=sys.stderr)
        return 2
    bound = fluid_bound(cluster, trace.requests, slo.tpot_ms)
    doc: dict[str, Any] = {
        "trace": {"name": trace.name, "requests": len(trace), "mean_rate_rps": trace.mean_rate},
        "cluster": {
            "name": cluster.name,
            "gpus": cluster.gpus,
            "price_per_hour_usd": cluster.price_per_hour,
        },
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "tbt_ms": slo.tbt_ms},
        "fluid_bound": bound.to_dict(),
        "policies": [r.to_dict(cluster.gpus, cluster.price_per_hour) for r in runs],
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sim.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
        msg = _plot(runs, out, slo, args.target, bound.rps)
        if msg:
            print(f"hpd sim: {msg}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc))
    else:
        print(
            f"trace {trace.name}: {len(trace)} requests, {trace.mean_rate:.2f} req/s; cluster "
            f"{cluster.name}: {cluster.gpus} GPUs, ${cluster.price_per_hour:.2f}/h; SLO TTFT <= "
            f"{slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms"
        )
        print(render_table(runs, cluster, bound.rps if args.search_goodput else None))
    return 0


def _advise(
    args: argparse.Namespace,
    trace: Trace,
    cluster: ClusterSpec,
    slo: Slo,
    config: SimConfig,
    policy: str,
) -> int:
    """``--advise``: every candidate deployment's goodput, and the one advised."""
    try:
        profile = resolve_policy(policy)
    except ValueError as exc:
        print(f"hpd sim: {exc}", file=sys.stderr)
        return 2
    if not args.no_progress and sys.stderr.isatty():
        names = ", ".join(d.name for d in DEPLOYMENTS)
        print(f"simulating {names} (a goodput search each) ...", file=sys.stderr)
    advice = advise(cluster, profile, trace, slo, config, args.start_scale, args.tolerance)
    if args.json:
        print(json.dumps({"cluster": cluster.name, "trace": trace.name, **advice.to_dict()}))
        return 0
    print(f"cluster {cluster.name}, trace {trace.name} ({len(trace)} requests), policy {policy}")
    for d in DEPLOYMENTS:
        mark = "->" if d is advice.chosen else "  "
        g = advice.goodput_rps[d.name]
        shown = f"{g:8.2f}" if g is not None else f"< {advice.failed_at_rps[d.name]:6.2f}"
        print(f"{mark} {d.name:<17} goodput {shown} req/s  {d.description}")
    if not advice.chosen.every_pool_both:
        print("advised: keep the pools as declared")
    else:
        print("advised: every engine with a KV connector on both sides (kv_both), its agent with")
        print("`--role both` (cluster files: `stage: both`)")
        if advice.chosen.routing:
            print(f"and the built-in `{advice.chosen.routing}` profile as the scheduler's")
            print(f"(HPD_PROFILE={advice.chosen.routing})")
        elif advice.chosen.colocated:
            print("and `pairing: colocated` in the scheduler's profile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
