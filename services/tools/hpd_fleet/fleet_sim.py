"""The simulator on a running real fleet: a cluster written from what the control plane
knows of it, and the simulator's goodput on given requests (``bench/real_fleet.py``'s
``sim_vs_real_goodput``: the simulator earns its figures only if it predicts real runs).

The cluster is written from what the control plane knows of the real fleet, as a user
would write it from a running one (``cluster_of``):

* the model: the architecture numbers the agents registered (layers, KV heads, head dim
  from the KV format; parameters and attention width from their labels);
* each engine one pool of one worker, its GPU what every agent declared;
* each engine's ``actual`` speed: its prefill as the scheduler's learner fitted it (fixed
  cost per request, scale of the declared compute, the share of the fixed cost each queued
  prompt adds), or, for an engine our arm never used (it has no fit), its unloaded TTFT as
  the fixed cost; its decode step as the learner fitted it (scale of the declared step and
  a cost per sequence), or its unloaded TPOT over the declared step at the mix's mean
  context; its prefill iterations batched up to the engine's token budget
  (``ENGINE_BATCH_TOKENS``), as vLLM's scheduler batches queued prompts.

The simulator then replays the requests of the rate where our goodput peaked, with the
default profile and the benchmark's tier, learning from its own outcomes as the service
does. A disaggregated fleet is not written (its figures need the hand-off fitted per pool
pair as well): the figure is null there, with the reason.
"""

from __future__ import annotations

import statistics
from typing import Any

import grpc
import yaml

from hetero_pd.v1 import registry_pb2 as r
from hetero_pd.v1 import registry_pb2_grpc as r_grpc
from hetero_pd.v1 import scheduler_pb2 as s
from hetero_pd.v1 import scheduler_pb2_grpc as s_grpc
from hpd_common import perfmodel
from hpd_common.gpus import GpuProfile
from hpd_fleet.real_fleet import FleetStack
from hpd_scheduler.policy import parse_profile
from hpd_sim import SimConfig, Slo, attainment, parse_cluster, simulate
from hpd_sim.traces import TraceRequest

__all__ = ["ENGINE_BATCH_TOKENS", "cluster_of", "sim_goodput"]

ENGINE_BATCH_TOKENS = 2048
"""The prompt tokens one of the fleet's engines prefills in a step: vLLM's
``max_num_batched_tokens`` as its CPU build sets it for an API server (the fleet file does
not set it; a fleet file that did would be read here)."""


def cluster_of(
    stack: FleetStack, unloaded: dict[str, Any], mean_context: float
) -> dict[str, Any] | None:
    """The cluster document of the running fleet (module docstring); None for a
    disaggregated one."""
    if stack.fleet.disaggregated:
        return None
    fleet = stack.fleet
    with grpc.insecure_channel(stack.addrs["registry"]) as ch:
        first = fleet.engines[0].name
        w = r_grpc.RegistryServiceStub(ch).GetWorker(
            r.GetWorkerRequest(worker_id=first), timeout=10
        )
    cap = w.worker.capability
    labels = dict(cap.labels)
    model = {
        "name": cap.model_id,
        "params_b": int(labels.get("model-params", "0")) / 1e9,
        "num_layers": cap.kv_format.num_layers,
        "num_kv_heads": cap.kv_format.num_kv_heads,
        "head_dim": cap.kv_format.head_dim,
        "hidden_size": int(labels.get("model-attention-width", "0")),
    }
    with grpc.insecure_channel(stack.addrs["scheduler"]) as ch:
        recs = s_grpc.SchedulerServiceStub(ch).GetRecommendations(
            s.GetRecommendationsRequest(), timeout=10
        )
    learned = {e.worker_id: e for e in recs.workers if e.learned_prefill_samples}
    steps = {e.worker_id: e for e in recs.workers if e.learned_decode_samples}
    d = fleet.declare
    spec = perfmodel.ModelSpec(
        model["name"], model["params_b"], num_layers=model["num_layers"],
        num_kv_heads=model["num_kv_heads"], head_dim=model["head_dim"],
        hidden_size=model["hidden_size"],
    )  # fmt: skip
    pools = []
    for e in fleet.engines:
        hbm_gib = e.kv_cache_gib / 0.9 + 0.1  # its KV cache at the cluster's memory share
        gpu = {"name": d.gpu_type, "peak_tflops": d.peak_tflops, "hbm_gbps": d.hbm_gbps,
               "hbm_gib": hbm_gib}  # fmt: skip
        figures = unloaded["engines"].get(e.name, {})
        est = learned.get(e.name)
        if est is not None:
            actual = {"prefill_scale": est.learned_prefill_scale,
                      "prefill_fixed_ms": est.learned_prefill_fixed_ms,
                      "prefill_queue_share": est.learned_prefill_queue_share}  # fmt: skip
        else:
            actual = {"prefill_scale": 1.0, "prefill_fixed_ms": figures.get("ttft_ms_p50", 0.0)}
        step_est = steps.get(e.name)
        if step_est is not None:
            actual["decode_scale"] = step_est.learned_decode_scale
            actual["decode_seq_ms"] = step_est.learned_decode_seq_ms
        else:
            declared = GpuProfile(d.gpu_type, d.peak_tflops, 0.0, hbm_gib, d.hbm_gbps, 0.0, 0.0)
            step = perfmodel.decode_step_ms(spec, declared, 1, 1, round(mean_context))
            tpot = figures.get("tpot_ms_p50", 0.0)
            actual["decode_scale"] = max(tpot / step, 1e-3) if tpot and step > 0 else 1.0
        pools.append({
            "id": e.name, "gpu": gpu, "count": 1, "tp": 1, "stage": "both", "zone": "local",
            "kv_connector": e.connector == "nixl", "actual": actual,
            "prefill_batch_tokens": ENGINE_BATCH_TOKENS,
        })  # fmt: skip
    return {"name": "real-fleet", "model": model, "pools": pools}


def sim_goodput(
    cluster_doc: dict[str, Any],
    jobs: list[tuple[float, int, int]],
    window_s: float,
    slo: dict[str, float],
    profile_yaml: str,
) -> dict[str, Any]:
    """Goodput (requests/s meeting both targets) and attainment of the simulator on the
    cluster with ``jobs`` (arrival s, prompt tokens, output tokens)."""
    cluster = parse_cluster(cluster_doc)
    profile = parse_profile(yaml.safe_load(profile_yaml))
    requests = [TraceRequest(at, p, o) for at, p, o in jobs]
    res = simulate(
        cluster, profile, requests, SimConfig(seed=0, tiers=(("standard", 1.0),), learn=True)
    )
    target = Slo(slo["ttft_ms"], slo["tpot_ms"])
    att = attainment(res.outcomes, target)
    pools: dict[str, int] = {}
    for o in res.outcomes:
        if o.prefill_worker:
            pools[o.prefill_worker] = pools.get(o.prefill_worker, 0) + 1
    ttfts = [o.ttft_ms for o in res.outcomes if not o.rejected]
    return {
        "goodput_rps": round(att * len(jobs) / window_s, 3),
        "attainment": round(att, 4),
        "refused": sum(o.rejected for o in res.outcomes),
        "ttft_ms_p50": round(statistics.median(ttfts), 1) if ttfts else None,
        "workers": pools,
    }
