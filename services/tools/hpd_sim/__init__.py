"""The discrete-event cluster simulator behind ``hpd sim`` and ``bench/goodput.py``.

It replays a request trace on a heterogeneous cluster described in YAML, with every
scheduling decision made by the policy core (the same ``Planner`` the scheduler service runs)
and every service time taken from the shared performance model. See ``engine.py`` for the
model of a worker, ``metrics.py`` for the metric definitions and ``goodput.py`` for the
goodput search and the fluid capacity bound.
"""

from .cluster import ClusterError, ClusterSpec, PoolSpec, load_cluster, parse_cluster
from .engine import RequestOutcome, SimConfig, SimResult, Simulator, simulate, tbt_ms
from .metrics import Slo, Summary, attainment, percentile, summarize

__all__ = [
    "ClusterError",
    "ClusterSpec",
    "PoolSpec",
    "RequestOutcome",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Slo",
    "Summary",
    "attainment",
    "load_cluster",
    "parse_cluster",
    "percentile",
    "simulate",
    "summarize",
    "tbt_ms",
]
